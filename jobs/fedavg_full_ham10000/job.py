"""fedavg_full_ham10000 — all-labels upper bound (FedAvg-PL, every label kept) on HAM10000 (5 sites, full; real
images) (README.md).

Run: ``python jobs/fedavg_full_ham10000/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedavg_full_ham10000",
    method="fedavg_pl",
    dataset={"preset": "ham10000", "prepare": {"protocol": "full", "table": None}},
    num_sites=5,
    num_rounds=20,
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
