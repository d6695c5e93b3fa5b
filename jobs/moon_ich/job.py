"""moon_ich — MOON on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/moon_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="moon_ich",
    method="moon",
    dataset="ich_phantom",
    num_sites=5,
    num_rounds=20,
    method_args={"mu": 1.0, "tau": 0.5},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
