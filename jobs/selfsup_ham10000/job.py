"""selfsup_ham10000 — federated self-supervised warm start (BYOL) on HAM10000 (5 sites x 3 classes; real
images): every site's training images, labels unused; writes the encoder that ``--set model.pretrained=<encoder>`` starts any job from (README.md).

Run: ``python jobs/selfsup_ham10000/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(PartialLabelRecipe, **ham10000_fedlsm_split.SELF_SUPERVISED, name="selfsup_ham10000", method="byol")

if __name__ == "__main__":
    job_main(recipe)
