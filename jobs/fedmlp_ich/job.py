"""FedMLP on intracranial haemorrhage (ICH), "missing 4 classes" (README.md).

Run: ``python jobs/fedmlp_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedMLPRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(FedMLPRecipe, **ich_phantom.SETTINGS, name="fedmlp_ich", warmup_rounds=5, cr_warmup=True)

if __name__ == "__main__":
    job_main(recipe)
