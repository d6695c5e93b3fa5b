"""fedlsm_isic — FedLSM on HAM10000 / ISIC 2018 (single-label, 5 sites x 3 classes) (README.md).

Run: ``python jobs/fedlsm_isic/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import FedLSMRecipe, job_main

JOB = dict(
    name="fedlsm_isic",
    dataset="ham10000",
    num_sites=5,
    num_rounds=20,
    train={
        "optimizer": "adam",
        "lr": 0.001,
        "betas": [0.9, 0.99],
        "batch_size": 64,
        "local_steps": 30,
        "keep_optimizer_state": True,
    },
    n_uncertain=0.035,
    n_confident=0.14,
    awpa="adaptive",
)


def recipe(**overrides) -> FedLSMRecipe:
    """The job's recipe (``overrides``: any FedLSMRecipe keyword, e.g. ``num_rounds=2``)."""
    return FedLSMRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
