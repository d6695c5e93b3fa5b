"""fedlc_ham10000 — FedLC on HAM10000 with FedLSM's label-set mismatch split (5 sites x 3 classes) (README.md).

Run: ``python jobs/fedlc_ham10000/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedlc_ham10000",
    method="fedlc",
    dataset="ham10000",
    num_sites=5,
    num_rounds=20,
    method_args={"tau": 1.0},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
