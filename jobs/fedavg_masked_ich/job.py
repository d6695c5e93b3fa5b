"""fedavg_masked_ich — partial loss + class-masked classifier rows on the ICH phantom (5 sites, missing 4; SYNTHETIC
images) (README.md).

Run: ``python jobs/fedavg_masked_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(PartialLabelRecipe, **ich_phantom.SETTINGS, name="fedavg_masked_ich", method="fedavg_masked")

if __name__ == "__main__":
    job_main(recipe)
