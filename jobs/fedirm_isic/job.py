"""fedirm_isic — FedIRM on HAM10000 / ISIC 2018 (10 sites: 2 labelled, 8 unlabelled) (README.md).

Run: ``python jobs/fedirm_isic/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedIRMRecipe, job_main
from fedpartial.table_settings import fedirm_isic

recipe = partial(FedIRMRecipe, **fedirm_isic.settings(), **fedirm_isic.METHOD_ARGS, name="fedirm_isic")

if __name__ == "__main__":
    job_main(recipe)
