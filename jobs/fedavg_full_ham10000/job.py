"""fedavg_full_ham10000 — all-labels upper bound (FedAvg-PL, every label kept) on HAM10000 (5 sites, full; real
images) (README.md).

Run: ``python jobs/fedavg_full_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(
    PartialLabelRecipe,
    **{**ham10000_fedlsm_split.SETTINGS, "dataset": ham10000_fedlsm_split.ALL_LABELS},
    name="fedavg_full_ham10000",
    method="fedavg_pl",
)

if __name__ == "__main__":
    job_main(recipe)
