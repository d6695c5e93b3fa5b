"""fednoro_ich — FedNoRo on the ICH phantom (5 sites, missing 4; SYNTHETIC images), FedMLP's comparison (README.md).

Run: ``python jobs/fednoro_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(
    PartialLabelRecipe,
    **ich_phantom.SETTINGS,
    name="fednoro_ich",
    method="fednoro",
    method_args={"all_noisy": True, "ramp_begin": 0, "ramp_end": 19},
)

if __name__ == "__main__":
    job_main(recipe)
