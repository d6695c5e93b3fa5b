"""moon_ich — MOON on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/moon_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(
    PartialLabelRecipe, **ich_phantom.SETTINGS, name="moon_ich", method="moon", method_args={"mu": 1.0, "tau": 0.5}
)

if __name__ == "__main__":
    job_main(recipe)
