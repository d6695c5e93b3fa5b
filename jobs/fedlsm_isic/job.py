"""fedlsm_isic — FedLSM on HAM10000 / ISIC 2018 (single-label, 5 sites x 3 classes) (README.md).

Run: ``python jobs/fedlsm_isic/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedLSMRecipe, job_main
from fedpartial.table_settings import fedlsm, ham10000_fedlsm_split

recipe = partial(
    FedLSMRecipe,
    **ham10000_fedlsm_split.SETTINGS,
    name="fedlsm_isic",
    train=fedlsm.train(local_steps=30),
    n_uncertain=0.035,
    n_confident=0.14,
    awpa=fedlsm.AWPA,
)

if __name__ == "__main__":
    job_main(recipe)
