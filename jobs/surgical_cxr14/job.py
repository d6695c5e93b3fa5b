"""surgical_cxr14 — surgical aggregation on real NIH chest X-rays (4 sites, 7 of 14 findings each) (README.md).

Run: ``python jobs/surgical_cxr14/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.data.catalog.nih_cxr14 import CLASSES as NIH_CLASSES
from fedpartial.recipes import SurgicalRecipe, job_main
from fedpartial.table_settings import surgical

recipe = partial(
    SurgicalRecipe,
    name="surgical_cxr14",
    num_sites=4,
    num_rounds=20,
    dataset={
        "preset": "nih_cxr14",
        "classes": NIH_CLASSES,
        "prepare": {"classes": NIH_CLASSES, "protocol": "missing_k", "k": 7},
    },
    key_metric=surgical.KEY_METRIC,
    model=surgical.model(1),
    **surgical.METHOD_ARGS,
)

if __name__ == "__main__":
    job_main(recipe)
