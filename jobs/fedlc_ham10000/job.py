"""fedlc_ham10000 — FedLC on HAM10000 with FedLSM's label-set mismatch split (5 sites x 3 classes) (README.md).

Run: ``python jobs/fedlc_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(
    PartialLabelRecipe,
    **ham10000_fedlsm_split.SETTINGS,
    name="fedlc_ham10000",
    method="fedlc",
    method_args={"tau": 1.0},
)

if __name__ == "__main__":
    job_main(recipe)
