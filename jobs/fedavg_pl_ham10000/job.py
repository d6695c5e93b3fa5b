"""fedavg_pl_ham10000 — FedAvg + partial loss (restricted softmax) on HAM10000 (5 sites x 3 classes; real images)
(README.md).

Run: ``python jobs/fedavg_pl_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(PartialLabelRecipe, **ham10000_fedlsm_split.SETTINGS, name="fedavg_pl_ham10000", method="fedavg_pl")

if __name__ == "__main__":
    job_main(recipe)
