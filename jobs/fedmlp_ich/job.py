"""FedMLP on intracranial haemorrhage (ICH), "missing 4 classes" (README.md).

Run: ``python jobs/fedmlp_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import FedMLPRecipe, job_main

JOB = dict(
    name="fedmlp_ich",
    dataset="ich_phantom",
    num_sites=5,
    num_rounds=20,
    warmup_rounds=5,
    cr_warmup=True,
)


def recipe(**overrides) -> FedMLPRecipe:
    """The job's recipe (``overrides``: any FedMLPRecipe keyword, e.g. ``num_rounds=2``)."""
    return FedMLPRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
