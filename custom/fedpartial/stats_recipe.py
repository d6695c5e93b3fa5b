"""Look before you train: the federated statistics job (NVFlare's statistics workflow over
:class:`~fedpartial.fl.fedstats.SiteStatistics`) and its ``job.py`` command line.

:class:`DataStatsRecipe` is NVFlare's ``StatsJob`` (two passes: counts, sums, means and noised minima / maxima,
then histograms over the agreed range and standard deviations) with the bundle's parts: every site (``@ALL``, so
the exported folder deploys to a federation of any site names) computes its statistics with
:class:`~fedpartial.fl.fedstats.SiteStatistics` and filters them with NVFlare's cleansers (the minimum count
raised to the site's privacy policy's, :class:`~fedpartial.fl.fedstats.PolicyMinCountCleanser`; noised minima /
maxima; histogram bins); the server writes NVFlare's statistics JSON and the coordinator's report
(``data_report.md`` / ``.json``, ``data_intensity.png``) in its run folder::

    python jobs/fedstats_ham10000/job.py            # simulator: workspaces/fedstats_ham10000/server/simulate_job/
    nvflare job submit -j jobs/fedstats_ham10000    # a real federation (after make jobs)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from nvflare.job_config.stats_job import StatsJob
from nvflare.recipe.spec import ExecEnv, Recipe

from .data.presets import deep_merge, resolve_dataset
from .data.site_config import DATA_DIR_ENV
from .data_report import THRESHOLDS, class_feature, intensity_feature
from .fl.fedstats import DataReportWriter, PolicyMinCountCleanser, PolicyStatisticsPrivacyFilter, SiteStatistics
from .fl.job_export import PACKAGE_DIR, ConfigWriter
from .fl.simulator import RunFailed, Stopped, SupervisedSimEnv
from .privacy import DEFAULT_MIN_COUNT
from .recipes import prepared_sites, site_data_arg, site_data_problem, with_sites

STATS_JSON = "data_statistics.json"  # NVFlare's statistics, in the server's run folder beside the report
DEFAULT_BINS = 32


class BundleStatsJob(StatsJob):
    """NVFlare's ``StatsJob`` with the bundle's writer and minimum-count cleanser, exported by the bundle's
    :class:`~fedpartial.fl.job_export.ConfigWriter` (the whole package in the app's ``custom/``)."""

    def __init__(self, name: str, classes: list, thresholds: dict, **kwargs):
        self._classes, self._thresholds = list(classes), dict(thresholds)
        super().__init__(name=name, **kwargs)
        self.job = ConfigWriter(job_name=name, min_clients=1)
        self.job.set_app_packages([PACKAGE_DIR.name])
        self.job.record(self._writer, self._writer_args)  # every argument written out, defaults included
        self.job.record(
            self.stats_generator, {"dataset": self.stats_generator.dataset, "images": self.stats_generator.images}
        )

    def get_stats_output_writer(self):
        self._writer_args = dict(
            output_path=self.output_path, classes=self._classes, thresholds=self._thresholds, min_count=self.min_count
        )
        self._writer = DataReportWriter(**self._writer_args)
        return self._writer

    def add_privacy_result_filters(self, site_id: str):
        from nvflare.app_common.statistics.histogram_bins_cleanser import HistogramBinsCleanser
        from nvflare.app_common.statistics.min_max_cleanser import AddNoiseToMinMax
        from nvflare.job_config.defs import FilterType

        ids = [
            self.to(
                self.job.record(PolicyMinCountCleanser(min_count=self.min_count), {"min_count": self.min_count}),
                site_id,
                id="min_count_cleanser",
            ),
            self.to(
                AddNoiseToMinMax(min_noise_level=self.min_noise_level, max_noise_level=self.max_noise_level),
                site_id,
                id="min_max_noise_cleanser",
            ),
            self.to(HistogramBinsCleanser(max_bins_percent=self.max_bins_percent), site_id, id="hist_bins_cleanser"),
        ]
        self.to(
            PolicyStatisticsPrivacyFilter(result_cleanser_ids=ids),
            site_id,
            filter_type=FilterType.TASK_RESULT,
            tasks=["fed_stats"],
        )


class DataStatsRecipe(Recipe):
    """What each site holds: labels, patients, splits, image sizes and intensities (module docstring).

    Args:
        name: the job's name.
        dataset: a preset name or a dataset config, as a training job's (``image_size`` is the size the
            intensities are read at: the job's).
        num_sites: simulated sites (the simulated split is dealt over as many).
        min_count: the job's minimum count (a site's privacy policy may raise it).
        bins: intensity histogram bins (NVFlare's range agreement gives their range).
        thresholds: the report's warning thresholds (:data:`fedpartial.data_report.THRESHOLDS`).
        images: decode the training images (sizes, intensities); False: labels and counts only.
        prepared / site_data / data_dir: as :class:`~fedpartial.recipes.PartialLabelRecipe`'s.
        max_bins_percent, min_noise_level, max_noise_level: NVFlare's histogram-bins and min / max noise cleansers.
    """

    def __init__(
        self,
        *,
        name: str,
        dataset: dict | str,
        num_sites: int,
        min_count: int = DEFAULT_MIN_COUNT,
        bins: int = DEFAULT_BINS,
        thresholds: dict | None = None,
        images: bool = True,
        prepared: str | os.PathLike | None = None,
        site_data: dict | None = None,
        data_dir: str | os.PathLike | None = None,
        max_bins_percent: float = 10,
        min_noise_level: float = 0.1,
        max_noise_level: float = 0.3,
    ):
        dataset = {"preset": dataset} if isinstance(dataset, str) else copy.deepcopy(dataset)
        if prepared is not None:
            dataset["prepared"] = str(Path(prepared).expanduser().resolve())
        if site_data:
            dataset["site_data"] = {s: str(Path(f).expanduser().resolve()) for s, f in site_data.items()}
        unknown = sorted(set(thresholds or {}) - set(THRESHOLDS))
        if unknown:
            raise ValueError(f"job '{name}': unknown thresholds {unknown} (known: {sorted(THRESHOLDS)})")
        if not isinstance(min_count, int) or min_count < 1:
            raise ValueError(f"job '{name}': min_count must be an integer >= 1, got {min_count!r}")
        ds = resolve_dataset(dataset, f"job '{name}' 'dataset'")
        self.dataset, self.num_sites, self.min_count, self.bins = dataset, int(num_sites), min_count, int(bins)
        self.thresholds = {**THRESHOLDS, **(thresholds or {})}
        self.data_dir = None if data_dir is None else str(Path(data_dir).expanduser().resolve())
        # no "mean": NVFlare's site handler divides by the count itself, and a class a site does not annotate has
        # none (the report divides the sums)
        config = {
            "count": {},
            "sum": {},
            "stddev": {},
            # every feature named (no "*": nvflare job submit re-reads the configuration as HOCON, where "*" fails)
            "histogram": {
                **{f: {"bins": 20} for f in ("images", "patients", "width", "height", "aspect")},
                **{class_feature(k, j): {"bins": 20} for j in range(len(ds["classes"])) for k in ("pos", "neg")},
                **{intensity_feature(k): {"bins": self.bins} for k in range(int(ds["channels"]))},
            },
        }
        job = BundleStatsJob(
            name,
            list(ds["classes"]),
            self.thresholds,
            statistic_configs=config,
            stats_generator=SiteStatistics(dataset=dataset, images=images),
            output_path=STATS_JSON,
            min_count=min_count,
            min_noise_level=min_noise_level,
            max_noise_level=max_noise_level,
            max_bins_percent=max_bins_percent,
        )
        job.setup_clients(["@ALL"])
        super().__init__(job)

    def process_env(self, env: ExecEnv) -> None:
        from nvflare.recipe.sim_env import SimEnv

        if isinstance(env, SimEnv) and self.data_dir:
            os.environ[DATA_DIR_ENV] = self.data_dir

    def export(self, job_dir: str, server_exec_params=None, client_exec_params=None, env=None):
        """Export into ``<job_dir>/<name>/``, replacing only ``meta.json`` and the app folders."""
        import tempfile

        dest = Path(job_dir) / self.name
        with tempfile.TemporaryDirectory() as tmp:
            super().export(tmp, server_exec_params, client_exec_params, env)
            out = Path(tmp) / self.name
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "meta.json").unlink(missing_ok=True)
            for old in [p for p in dest.glob("app*") if p.is_dir()]:
                shutil.rmtree(old)
            for item in out.iterdir():
                if item.is_dir():
                    shutil.copytree(item, dest / item.name)
                else:
                    shutil.copy2(item, dest / item.name)
        return dest


def stats_main(make_recipe: Callable[..., DataStatsRecipe], argv: list[str] | None = None):
    """The command line of a ``jobs/fedstats_*/job.py``: run the statistics job in the simulator and print where
    its report is."""
    base = make_recipe()
    ap = argparse.ArgumentParser(
        prog=f"python jobs/{base.name}/job.py",
        description=f"Run the statistics job '{base.name}' in NVFlare's simulator: what each site holds, and "
        "warnings, in WORKSPACE/<job>/server/simulate_job/data_report.md",
    )
    ap.add_argument("--sites", type=int, default=None, help="simulated sites (default: the job's)")
    ap.add_argument("--data", default=None, metavar="PREPARED_DIR", help="a fedpartial-prepare output folder")
    ap.add_argument("--site-data", action="append", default=[], metavar="[SITE=]FOLDER", help="a site's own folder")
    ap.add_argument("--data-dir", default=None, help=f"folder relative data roots resolve against (${DATA_DIR_ENV})")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dataset.<key>=VALUE, min_count=N, bins=N or thresholds.<name>=VALUE (JSON values)",
    )
    ap.add_argument("--workspace", default="workspaces", help="results go to WORKSPACE/<job>")
    args = ap.parse_args(argv)
    kwargs: dict = {}
    if args.data:
        kwargs["prepared"] = args.data
    if args.site_data:
        kwargs["site_data"] = site_data_arg(args.site_data)
        problem = site_data_problem(kwargs["site_data"])
        if problem:
            ap.error(problem)
    if args.data_dir:
        kwargs["data_dir"] = args.data_dir
    sites = args.sites or (len(kwargs["site_data"]) if args.site_data else None)
    sites = sites or (prepared_sites(args.data) if args.data else None)
    if sites is not None and sites != base.num_sites:
        kwargs.update(num_sites=sites, dataset=with_sites(base.dataset, sites))
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            ap.error(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        top, *rest = key.strip().split(".")
        for k in reversed(rest):
            value = {k: value}
        if top in ("dataset", "thresholds") and rest:
            current = kwargs.get(top, getattr(base, top))
            current = {"preset": current} if isinstance(current, str) else current
            value = deep_merge(current, value)
        kwargs[top] = value
    try:
        recipe = make_recipe(**kwargs) if kwargs else base
    except (ValueError, OSError, TypeError) as e:
        ap.error(str(e))
    env = SupervisedSimEnv(
        num_clients=recipe.num_sites, num_threads=recipe.num_sites, workspace_root=str(Path(args.workspace).resolve())
    )
    try:
        run = recipe.execute(env)
    except Stopped as e:
        raise SystemExit(128 + e.signum) from None
    except RunFailed as e:
        print(f"\n{recipe.name} FAILED (simulator status {e.status}):")
        for line in e.lines or [f"see {e.workspace}/server/simulate_job/log.txt"]:
            print(f"  {line}")
        raise SystemExit(2) from None
    print(f"report: {Path(args.workspace) / recipe.name / 'server/simulate_job/data_report.md'}")
    return run
