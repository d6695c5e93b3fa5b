"""selfsup_ich — federated self-supervised warm start (BYOL) on the ICH phantom (5 sites, missing 4; SYNTHETIC images): every site's training
images, labels unused; writes the encoder that ``--set model.pretrained=<encoder>`` starts any job from (README.md).

Run: ``python jobs/selfsup_ich/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import PartialLabelRecipe, job_main
from fedpartial.table_settings import ich_phantom

recipe = partial(PartialLabelRecipe, **ich_phantom.SETTINGS, name="selfsup_ich", method="byol")

if __name__ == "__main__":
    job_main(recipe)
