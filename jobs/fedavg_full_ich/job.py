"""fedavg_full_ich — all-labels upper bound (FedAvg-PL, every label kept) on the ICH phantom (5 sites, full;
SYNTHETIC images) (README.md).

Run: ``python jobs/fedavg_full_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedavg_full_ich",
    method="fedavg_pl",
    dataset={"preset": "ich_phantom", "prepare": {"protocol": "full", "k": None}},
    num_sites=5,
    num_rounds=20,
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
