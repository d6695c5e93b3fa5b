"""FedMLP on ChestX-ray14, 8 sites, "missing 7 classes" (README.md).

Run: ``python jobs/fedmlp_cxr14/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedMLPRecipe, job_main
from fedpartial.table_settings import nih_cxr14_missing_7

recipe = partial(FedMLPRecipe, **nih_cxr14_missing_7.SETTINGS, name="fedmlp_cxr14", warmup_rounds=5, cr_warmup=True)

if __name__ == "__main__":
    job_main(recipe)
