"""fedirm_isic — FedIRM on HAM10000 / ISIC 2018 (10 sites: 2 labelled, 8 unlabelled) (README.md).

Run: ``python jobs/fedirm_isic/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import FedIRMRecipe, job_main

JOB = dict(
    name="fedirm_isic",
    dataset={
        "preset": "ham10000",
        "prepare": {"num_sites": 10, "protocol": "labeled_unlabeled", "m": 2, "table": None},
    },
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
    warm_rounds=10,
)


def recipe(**overrides) -> FedIRMRecipe:
    """The job's recipe (``overrides``: any FedIRMRecipe keyword, e.g. ``num_rounds=2``)."""
    return FedIRMRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
