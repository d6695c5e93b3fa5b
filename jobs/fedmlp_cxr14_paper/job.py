"""fedmlp_cxr14_paper — FedMLP with the paper's settings on NIH ChestX-ray14 (8 sites, missing 7; real images, full
dataset not shipped) (README.md).

Run: ``python jobs/fedmlp_cxr14_paper/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedMLPRecipe, job_main
from fedpartial.table_settings import fedmlp_paper

recipe = partial(
    FedMLPRecipe,
    **fedmlp_paper.settings(in_channels=1),
    name="fedmlp_cxr14_paper",
    num_sites=8,
    dataset={
        "preset": "nih_cxr14",
        "image_size": 224,
        "prepare": {
            "root": "data/nih-cxr14",
            "num_sites": 8,
            "k": 7,
            "test_frac": 0.3,
            "val_frac": 0.1,
            "site_sizes": 5889,
        },
        "cache": "disk",
    },
)

if __name__ == "__main__":
    job_main(recipe)
