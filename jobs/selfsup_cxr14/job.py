"""selfsup_cxr14 — federated self-supervised warm start (BYOL) on NIH ChestX-ray14 (8 sites, missing 7; the shipped 1,000 real images): every site's training
images, labels unused; writes the encoder that ``--set model.pretrained=<encoder>`` starts any job from (README.md).

Run: ``python jobs/selfsup_cxr14/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import nih_cxr14_missing_7

recipe = partial(PartialLabelRecipe, **nih_cxr14_missing_7.SETTINGS, name="selfsup_cxr14", method="byol")

if __name__ == "__main__":
    job_main(recipe)
