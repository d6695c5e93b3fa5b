"""fedstats_ham10000 — look before you train: what each of the 5 HAM10000 sites of FedLSM's label-set split holds
(classes annotated, positives, patients, splits, image sizes, intensities after decoding), from NVFlare's federated
statistics under each site's privacy policy, with shortcut warnings (README.md).

Run: ``python jobs/fedstats_ham10000/job.py`` (``--help``); the report: ``workspaces/fedstats_ham10000/server/
simulate_job/data_report.md``.
"""

from functools import partial

from fedpartial.stats_recipe import DataStatsRecipe, stats_main
from fedpartial.table_settings import ham10000_fedlsm_split

recipe = partial(
    DataStatsRecipe,
    name="fedstats_ham10000",
    dataset=ham10000_fedlsm_split.SETTINGS["dataset"],
    num_sites=ham10000_fedlsm_split.SETTINGS["num_sites"],
)

if __name__ == "__main__":
    stats_main(recipe)
