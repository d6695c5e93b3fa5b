"""fedlsm_isic — FedLSM on HAM10000 / ISIC 2018 (single-label, 5 sites x 3 classes) (README.md).

Run: ``python jobs/fedlsm_isic/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedLSMRecipe, job_main
from fedpartial.table_settings import fedlsm, ham10000_fedlsm_split

recipe = partial(
    FedLSMRecipe,
    **{**ham10000_fedlsm_split.SETTINGS, "train": {**fedlsm.train(30), **ham10000_fedlsm_split.TRAIN}},
    name="fedlsm_isic",  # the paper's Adam (betas, state kept) at the table's budget
    n_mix=2,  # the paper's 4 mixed of 64, at batch 32
    n_uncertain=0.035,
    n_confident=0.14,
    awpa=fedlsm.AWPA,
)

if __name__ == "__main__":
    job_main(recipe)
