"""fedavg_labelled_full_isic — a baseline of FedIRM's Table 1 on HAM10000 (10 sites) (README.md).

Run: ``python jobs/fedavg_labelled_full_isic/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import PartialLabelRecipe, job_main

JOB = dict(
    name="fedavg_labelled_full_isic",
    method="fedavg_labelled",
    dataset={"preset": "ham10000", "prepare": {"num_sites": 10, "protocol": "full", "table": None}},
    num_sites=10,
    num_rounds=30,
    model={"arch": "small_cnn", "in_channels": 3, "dropout": 0.2},
    train={
        "optimizer": "adam",
        "lr": 0.001,
        "betas": [0.9, 0.99],
        "weight_decay": 0.0005,
        "batch_size": 32,
        "local_steps": 10,
    },
    method_args={"warm_rounds": 10},
)


def recipe(**overrides) -> PartialLabelRecipe:
    """The job's recipe (``overrides``: any PartialLabelRecipe keyword, e.g. ``num_rounds=2``)."""
    return PartialLabelRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
