"""fed_consistency_isic — a baseline of FedIRM's Table 1 on HAM10000 (10 sites) (README.md).

Run: ``python jobs/fed_consistency_isic/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import fedirm_isic

recipe = partial(
    PartialLabelRecipe,
    **fedirm_isic.settings(),
    name="fed_consistency_isic",
    method="fed_consistency",
    method_args=fedirm_isic.METHOD_ARGS,
)

if __name__ == "__main__":
    job_main(recipe)
