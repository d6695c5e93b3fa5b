"""fedavgm_ich — FedAvgM (server momentum) on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/fedavgm_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(
    PartialLabelRecipe,
    **ich_phantom.SETTINGS,
    name="fedavgm_ich",
    method="fedavgm",
    method_args={"server_momentum": 0.9, "server_lr": 1.0},
)

if __name__ == "__main__":
    job_main(recipe)
