"""pfl_ich — the PFL baseline of surgical aggregation on the ICH phantom (SYNTHETIC images) (README.md).

Run: ``python jobs/pfl_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import surgical

recipe = partial(PartialLabelRecipe, **surgical.ICH, name="pfl_ich", method="pfl", method_args=surgical.METHOD_ARGS)

if __name__ == "__main__":
    job_main(recipe)
