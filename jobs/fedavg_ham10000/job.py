"""fedavg_ham10000 — FedAvg on HAM10000 with FedLSM's label-set split (5 sites x 3 classes; real images)
(README.md).

Run: ``python jobs/fedavg_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(PartialLabelRecipe, **ham10000_fedlsm_split.SETTINGS, name="fedavg_ham10000", method="fedavg")

if __name__ == "__main__":
    job_main(recipe)
