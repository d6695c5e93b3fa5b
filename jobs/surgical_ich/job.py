"""surgical_ich — surgical aggregation on the ICH phantom (5 sites, 2 of 5 classes each; SYNTHETIC images)
(README.md).

Run: ``python jobs/surgical_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import SurgicalRecipe, job_main
from fedpartial.table_settings import surgical

recipe = partial(SurgicalRecipe, **surgical.ICH, **surgical.METHOD_ARGS, name="surgical_ich")

if __name__ == "__main__":
    job_main(recipe)
