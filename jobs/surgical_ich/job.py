"""surgical_ich — surgical aggregation on the ICH phantom (5 sites, 2 of 5 classes each; SYNTHETIC images)
(README.md).

Run: ``python jobs/surgical_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import SurgicalRecipe, job_main

JOB = dict(
    name="surgical_ich",
    dataset={"preset": "ich_phantom", "prepare": {"protocol": "missing_k", "k": 3}},
    num_sites=5,
    key_metric="site_bce",  # the paper selects the model with the lowest mean local validation BCE
    num_rounds=20,
    model={"arch": "small_cnn", "in_channels": 3, "head_hidden": 256, "head_dropout": 0.3},
    warmup_epochs=15,
    warmup_lr=0.005,
    norm="local",
)


def recipe(**overrides) -> SurgicalRecipe:
    """The job's recipe (``overrides``: any SurgicalRecipe keyword, e.g. ``num_rounds=2``)."""
    return SurgicalRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
