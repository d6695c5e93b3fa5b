"""fixmatch_masked_ham10000 — FedAvg* + FixMatch on HAM10000 with FedLSM's split (5 sites x 3 classes) (README.md).

Run: ``python jobs/fixmatch_masked_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(
    PartialLabelRecipe, **ham10000_fedlsm_split.SETTINGS, name="fixmatch_masked_ham10000", method="fixmatch_masked"
)

if __name__ == "__main__":
    job_main(recipe)
