"""fedavgm_ich — FedAvgM (server momentum) on the ICH phantom (5 sites, missing 4; SYNTHETIC images) (README.md).

Run: ``python jobs/fedavgm_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedavgm_ich",
    method="fedavgm",
    dataset="ich_phantom",
    num_sites=5,
    num_rounds=20,
    method_args={"server_momentum": 0.9, "server_lr": 1.0},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
