"""rscfed_ich — RSCFed on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/rscfed_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(PartialLabelRecipe, **ich_phantom.SETTINGS, name="rscfed_ich", method="rscfed")

if __name__ == "__main__":
    job_main(recipe)
