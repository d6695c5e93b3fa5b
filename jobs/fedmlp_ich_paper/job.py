"""fedmlp_ich_paper — FedMLP with the paper's settings on RSNA ICH (5 sites, missing 4; real images, not shipped)
(README.md).

Run: ``python jobs/fedmlp_ich_paper/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import FedMLPRecipe, job_main

JOB = dict(
    name="fedmlp_ich_paper",
    dataset={"preset": "rsna_ich", "prepare": {"root": "data/rsna-ich"}, "cache": "disk"},
    num_sites=5,
    num_rounds=500,
    model={"arch": "resnet18", "in_channels": 3, "pretrained": None},
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
