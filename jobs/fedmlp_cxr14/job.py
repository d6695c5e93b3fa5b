"""FedMLP on ChestX-ray14, 8 sites, "missing 7 classes" (README.md).

Run: ``python jobs/fedmlp_cxr14/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import FedMLPRecipe, job_main

JOB = dict(
    name="fedmlp_cxr14",
    dataset={"preset": "nih_cxr14", "prepare": {"num_sites": 8, "k": 7}},
    num_sites=8,
    num_rounds=20,
    warmup_rounds=5,
    cr_warmup=True,
)


def recipe(**overrides) -> FedMLPRecipe:
    """The job's recipe (``overrides``: any FedMLPRecipe keyword, e.g. ``num_rounds=2``)."""
    return FedMLPRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
