"""fedavg_masked_ham10000 — FedAvg* (restricted CE + class-masked rows) on HAM10000 (5 sites x 3 classes; real
images) (README.md).

Run: ``python jobs/fedavg_masked_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(
    PartialLabelRecipe, **ham10000_fedlsm_split.SETTINGS, name="fedavg_masked_ham10000", method="fedavg_masked"
)

if __name__ == "__main__":
    job_main(recipe)
