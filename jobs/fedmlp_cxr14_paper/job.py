"""fedmlp_cxr14_paper — FedMLP with the paper's settings on NIH ChestX-ray14 (8 sites, missing 7; real images, full
dataset not shipped) (README.md).

Run: ``python jobs/fedmlp_cxr14_paper/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import FedMLPRecipe, job_main

JOB = dict(
    name="fedmlp_cxr14_paper",
    dataset={
        "preset": "nih_cxr14",
        "image_size": 224,
        "prepare": {
            "root": "data/nih-cxr14",
            "num_sites": 8,
            "k": 7,
            "test_frac": 0.3,
            "val_frac": 0.1,
            "site_sizes": 5889,
        },
        "cache": "disk",
    },
    num_sites=8,
    num_rounds=500,
    model={"arch": "resnet18", "in_channels": 1, "pretrained": None},
    train={
        "optimizer": "adam",
        "lr": 3e-05,
        "weight_decay": 0.0005,
        "batch_size": 32,
        "local_epochs": 1,
        "num_workers": 4,
    },
    evaluation={"test_every": 10, "batch_size": 128},
    warmup_rounds=50,
    L=0.3,
    R=0.7,
    T0=0.005,
    T1=0.01,
    cr_warmup=False,
    parity="paper",
)


def recipe(**overrides) -> FedMLPRecipe:
    """The job's recipe (``overrides``: any FedMLPRecipe keyword, e.g. ``num_rounds=2``)."""
    return FedMLPRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
