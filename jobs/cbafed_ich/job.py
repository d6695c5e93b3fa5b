"""cbafed_ich — CBAFed on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/cbafed_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(PartialLabelRecipe, **ich_phantom.SETTINGS, name="cbafed_ich", method="cbafed")

if __name__ == "__main__":
    job_main(recipe)
