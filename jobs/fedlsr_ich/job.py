"""fedlsr_ich — FedLSR on the ICH phantom (5 sites, missing 4; SYNTHETIC images), FedMLP's comparison (README.md).

Run: ``python jobs/fedlsr_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedlsr_ich",
    method="fedlsr",
    dataset="ich_phantom",
    num_sites=5,
    num_rounds=20,
    method_args={"views": ["weak", "weak"], "lambda_e": 0.0, "t_w": 2, "class_weighting": "inverse"},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
