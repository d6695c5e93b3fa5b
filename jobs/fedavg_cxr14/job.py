"""fedavg_cxr14 — FedAvg, missing labels as negatives, on NIH ChestX-ray14 (8 sites, missing 7; real images)
(README.md).

Run: ``python jobs/fedavg_cxr14/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedavg_cxr14",
    method="fedavg",
    dataset={"preset": "nih_cxr14", "prepare": {"num_sites": 8, "k": 7}},
    num_sites=8,
    num_rounds=20,
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
