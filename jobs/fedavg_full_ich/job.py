"""fedavg_full_ich — all-labels upper bound (FedAvg-PL, every label kept) on the ICH phantom (5 sites, full;
SYNTHETIC images) (README.md).

Run: ``python jobs/fedavg_full_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(
    PartialLabelRecipe,
    **{**ich_phantom.SETTINGS, "dataset": ich_phantom.ALL_LABELS},
    name="fedavg_full_ich",
    method="fedavg_pl",
)

if __name__ == "__main__":
    job_main(recipe)
