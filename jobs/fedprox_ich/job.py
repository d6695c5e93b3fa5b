"""fedprox_ich — FedProx on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/fedprox_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedprox_ich",
    method="fedprox",
    dataset="ich_phantom",
    num_sites=5,
    num_rounds=20,
    method_args={"mu": 0.01},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
