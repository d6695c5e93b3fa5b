"""fedstats_ich — look before you train: what each of the 5 sites of the ICH phantom (missing 4: one subtype each;
SYNTHETIC images) holds (classes annotated, positives, patients, splits, image sizes, intensities after the CT
windows), from NVFlare's federated statistics under each site's privacy policy, with shortcut warnings (README.md).

Run: ``python jobs/fedstats_ich/job.py`` (``--help``); the report: ``workspaces/fedstats_ich/server/simulate_job/
data_report.md``.
"""

from functools import partial

from fedpartial.stats_recipe import DataStatsRecipe, stats_main
from fedpartial.table_settings import ich_phantom

recipe = partial(
    DataStatsRecipe,
    name="fedstats_ich",
    dataset=ich_phantom.SETTINGS["dataset"],
    num_sites=ich_phantom.SETTINGS["num_sites"],
)

if __name__ == "__main__":
    stats_main(recipe)
