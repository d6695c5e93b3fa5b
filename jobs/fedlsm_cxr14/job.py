"""fedlsm_cxr14 — FedLSM on NIH ChestX-ray14 (multi-label, 8 sites x 3 classes) (README.md).

Run: ``python jobs/fedlsm_cxr14/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.data.catalog.nih_cxr14 import CLASSES as NIH_CLASSES
from fedpartial.recipes import FedLSMRecipe, job_main
from fedpartial.table_settings import fedlsm

recipe = partial(
    FedLSMRecipe,
    name="fedlsm_cxr14",
    num_sites=8,
    num_rounds=20,
    dataset={
        "preset": "nih_cxr14",
        "classes": NIH_CLASSES,
        "prepare": {"num_sites": 8, "protocol": "random_s", "s": 3, "k": None, "seed": 524, "classes": None},
    },
    train=fedlsm.train(local_steps=10),
    n_uncertain=0.05,
    n_confident=0.2,
    awpa=fedlsm.AWPA,
)

if __name__ == "__main__":
    job_main(recipe)
