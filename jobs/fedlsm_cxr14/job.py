"""fedlsm_cxr14 — FedLSM on NIH ChestX-ray14 (multi-label, 8 sites x 3 classes) (README.md).

Run: ``python jobs/fedlsm_cxr14/job.py`` (``--help``: rounds, sites, data, export).
"""

from fedpartial.recipes import FedLSMRecipe, job_main

JOB = dict(
    name="fedlsm_cxr14",
    dataset={
        "preset": "nih_cxr14",
        "classes": [
            "Atelectasis", "Cardiomegaly", "Effusion", "Infiltration", "Mass", "Nodule", "Pneumonia",
            "Pneumothorax", "Consolidation", "Edema", "Emphysema", "Fibrosis", "Pleural_Thickening", "Hernia",
        ],
        "prepare": {"num_sites": 8, "protocol": "random_s", "s": 3, "k": None, "seed": 524, "classes": None},
    },
    num_sites=8,
    num_rounds=20,
    train={
        "optimizer": "adam",
        "lr": 0.001,
        "betas": [0.9, 0.99],
        "batch_size": 64,
        "local_steps": 10,
        "keep_optimizer_state": True,
    },
    n_uncertain=0.05,
    n_confident=0.2,
    awpa="adaptive",
)


def recipe(**overrides) -> FedLSMRecipe:
    """The job's recipe (``overrides``: any FedLSMRecipe keyword, e.g. ``num_rounds=2``)."""
    return FedLSMRecipe(**{**JOB, **overrides})


if __name__ == "__main__":
    job_main(recipe)
