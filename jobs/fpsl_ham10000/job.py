"""fpsl_ham10000 — FPSL on HAM10000 with FedLSM's label-set mismatch split (5 sites x 3 classes) (README.md).

Run: ``python jobs/fpsl_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(PartialLabelRecipe, **ham10000_fedlsm_split.SETTINGS, name="fpsl_ham10000", method="fpsl")

if __name__ == "__main__":
    job_main(recipe)
