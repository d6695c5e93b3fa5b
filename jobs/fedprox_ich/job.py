"""fedprox_ich — FedProx on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/fedprox_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(
    PartialLabelRecipe, **ich_phantom.SETTINGS, name="fedprox_ich", method="fedprox", method_args={"mu": 0.01}
)

if __name__ == "__main__":
    job_main(recipe)
