"""fedstats_cxr14 — look before you train: what each of the 8 NIH ChestX-ray14 sites (missing 7) holds (classes
annotated, positives, patients, splits, image sizes, intensities after decoding), from NVFlare's federated
statistics under each site's privacy policy, with shortcut warnings (README.md).

Run: ``python jobs/fedstats_cxr14/job.py`` (``--help``); the report: ``workspaces/fedstats_cxr14/server/
simulate_job/data_report.md``.
"""

from functools import partial

from fedpartial.stats_recipe import DataStatsRecipe, stats_main
from fedpartial.table_settings import nih_cxr14_missing_7

recipe = partial(
    DataStatsRecipe,
    name="fedstats_cxr14",
    dataset=nih_cxr14_missing_7.SETTINGS["dataset"],
    num_sites=nih_cxr14_missing_7.SETTINGS["num_sites"],
)

if __name__ == "__main__":
    stats_main(recipe)
