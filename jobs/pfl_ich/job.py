"""pfl_ich — the PFL baseline of surgical aggregation on the ICH phantom (SYNTHETIC images) (README.md).

Run: ``python jobs/pfl_ich/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="pfl_ich",
    method="pfl",
    dataset={"preset": "ich_phantom", "prepare": {"protocol": "missing_k", "k": 3}},
    num_sites=5,
    key_metric="site_bce",  # the paper selects the model with the lowest mean local validation BCE
    num_rounds=20,
    model={"arch": "small_cnn", "in_channels": 3, "head_hidden": 256, "head_dropout": 0.3},
    method_args={"warmup_epochs": 15, "warmup_lr": 0.005, "norm": "local"},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
