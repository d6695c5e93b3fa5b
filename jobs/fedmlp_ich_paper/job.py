"""fedmlp_ich_paper — FedMLP with the paper's settings on RSNA ICH (5 sites, missing 4; real images, not shipped)
(README.md).

Run: ``python jobs/fedmlp_ich_paper/job.py`` (``--help``: rounds, sites, GPUs, data, export).
"""

from functools import partial

from fedpartial.recipes import FedMLPRecipe, job_main
from fedpartial.table_settings import fedmlp_paper

recipe = partial(
    FedMLPRecipe,
    **fedmlp_paper.settings(in_channels=3),
    name="fedmlp_ich_paper",
    num_sites=5,
    dataset={"preset": "rsna_ich", "prepare": {"root": "data/rsna-ich"}, "cache": "disk"},
)

if __name__ == "__main__":
    job_main(recipe)
