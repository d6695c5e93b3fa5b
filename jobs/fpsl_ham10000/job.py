"""fpsl_ham10000 — FPSL on HAM10000 with FedLSM's label-set mismatch split (5 sites x 3 classes) (README.md).

Run: ``python jobs/fpsl_ham10000/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fpsl_ham10000",
    method="fpsl",
    dataset="ham10000",
    num_sites=5,
    num_rounds=20,
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
