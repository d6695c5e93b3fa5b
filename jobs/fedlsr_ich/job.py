"""fedlsr_ich — FedLSR on the ICH phantom (5 sites, missing 4; SYNTHETIC images), FedMLP's comparison (README.md).

Run: ``python jobs/fedlsr_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(
    PartialLabelRecipe,
    **ich_phantom.SETTINGS,
    name="fedlsr_ich",
    method="fedlsr",
    method_args={"views": ["weak", "weak"], "lambda_e": 0.0, "t_w": 2, "class_weighting": "inverse"},
)

if __name__ == "__main__":
    job_main(recipe)
