"""fedirm_ich — FedIRM on the ICH phantom (multi-label, 10 sites: 2 labelled, 8 unlabelled) (README.md).

Run: ``python jobs/fedirm_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedIRMRecipe, job_main
from fedpartial.table_settings import fedirm_isic

recipe = partial(FedIRMRecipe, **fedirm_isic.settings("ich_phantom"), **fedirm_isic.METHOD_ARGS, name="fedirm_ich")

if __name__ == "__main__":
    job_main(recipe)
