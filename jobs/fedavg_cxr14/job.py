"""fedavg_cxr14 — FedAvg, missing labels as negatives, on NIH ChestX-ray14 (8 sites, missing 7; real images)
(README.md).

Run: ``python jobs/fedavg_cxr14/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import nih_cxr14_missing_7

recipe = partial(PartialLabelRecipe, **nih_cxr14_missing_7.SETTINGS, name="fedavg_cxr14", method="fedavg")

if __name__ == "__main__":
    job_main(recipe)
