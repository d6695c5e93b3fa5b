"""Federated statistics of the sites' data (NVFlare's ``Statistics`` spec): what each hospital holds, before any
training (``jobs/fedstats_*``, :mod:`fedpartial.stats_recipe`).

Each site reads its data the way a training job does (:func:`~fedpartial.data.site_config.resolve_site_data`:
its ``local/fedpartial_data.json``, or in the simulator its share of the simulated split), its manifests, and its
training images decoded by the image store at the job's image size (the uint8 values training converts to float:
:class:`~fedpartial.data.sitedata.SiteDatasets`). NVFlare's statistics workflow asks for counts, sums, means,
minima / maxima (noised by ``AddNoiseToMinMax``), then, over the range agreed from those, histograms and standard
deviations. Datasets (NVFlare's word) are the splits ``train`` / ``val`` / ``test``; features:

- ``images``: one record per image (its count: the split's images);
- ``patients``: one record per patient (value: the patient's images); 0 records when the manifest has no ids;
- ``pos_<j>`` / ``neg_<j>``: one record per annotated positive / negative of class ``j`` (its index in the job's
  classes: a feature name is a key of the histogram configuration, which ``nvflare job submit`` re-reads as HOCON);
  the class's unlabelled images are the split's images less both;
- ``train`` only: ``width``, ``height``, ``aspect`` (width / height) of the original files, and
  ``intensity_c<k>``: every pixel of channel ``k`` after the site's decoding (0-255).

Privacy: :class:`PolicyMinCountCleanser` is NVFlare's ``MinCountCleanser`` with the stricter of the job's and
the site's privacy scope's ``min_count`` (``local/privacy.json``), which also withholds the count itself of a
feature with fewer records than that (a class's positives are a count): zero stays zero (a class the site does
not annotate). NVFlare's ``HistogramBinsCleanser`` drops a histogram with too many bins for its count. What was
withheld is missing from the site's answer; the report says "withheld" there.

The server's :class:`DataReportWriter` writes NVFlare's statistics JSON and the coordinator's report beside it
(:mod:`fedpartial.data_report`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.statistics_spec import Bin, DataType, Feature, Histogram, HistogramType, Statistics
from nvflare.app_common.app_constant import StatisticsConstants as StC
from nvflare.app_common.filters.statistics_privacy_filter import StatisticsPrivacyFilter
from nvflare.app_common.statistics.json_stats_file_persistor import JsonStatsFileWriter
from nvflare.app_common.statistics.min_count_cleanser import MinCountCleanser

from ..data.manifest import read_manifest
from ..data.presets import resolve_dataset
from ..data.site_config import resolve_site_data
from ..data.sitedata import SiteDatasets
from ..data.store import is_dicom, open_image
from ..data_report import class_feature, intensity_feature, write_report
from .privacy import effective_min_count, scope_of

SPLITS = ("train", "val", "test")
PIXEL_LEVELS = np.arange(256, dtype=np.float64)


class Values:
    """A feature's records as distinct values and their weights (a pixel channel: 256 levels and their counts)."""

    def __init__(self, values, weights=None):
        self.values = np.asarray(values, dtype=np.float64).reshape(-1)
        self.weights = np.ones_like(self.values) if weights is None else np.asarray(weights, dtype=np.float64)

    @property
    def count(self) -> int:
        return int(round(float(self.weights.sum())))

    @property
    def sum(self) -> float:
        return float((self.values * self.weights).sum())

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def _present(self) -> np.ndarray:
        return self.values[self.weights > 0]

    def min(self) -> float:
        v = self._present()
        return float(v.min()) if v.size else 0.0

    def max(self) -> float:
        v = self._present()
        return float(v.max()) if v.size else 0.0

    def stddev(self) -> float:
        if self.count < 2:
            return 0.0
        m = self.mean
        return math.sqrt(float((self.weights * (self.values - m) ** 2).sum()) / (self.count - 1))

    def variance_with_mean(self, mean: float, count: float) -> float:
        if count <= 1:
            return 0.0
        return float((self.weights * (self.values - mean) ** 2).sum()) / (count - 1)

    def histogram(self, bins: int, low: float, high: float) -> Histogram:
        counts, edges = np.histogram(self.values, bins=bins, range=(low, high), weights=self.weights)
        return Histogram(
            HistogramType.STANDARD,
            [Bin(float(edges[i]), float(edges[i + 1]), int(round(counts[i]))) for i in range(bins)],
        )


def image_size(path: str) -> tuple[int, int]:
    """``(width, height)`` of an image file from its header (a DICOM's Columns / Rows)."""
    if is_dicom(path):
        import pydicom

        ds = pydicom.dcmread(path, stop_before_pixels=True)
        return int(ds.Columns), int(ds.Rows)
    im = open_image(path)
    try:
        return im.size
    finally:
        im.close()


def pixel_tables(images, rows: int = 256) -> list[np.ndarray]:
    """Per channel, how many pixels of ``images`` (``(N, c, S, S)`` uint8, an image store) take each of the 256
    values."""
    n = len(images)
    if n == 0:
        return []
    c = int(images.shape[1])
    tables = [np.zeros(256, dtype=np.int64) for _ in range(c)]
    for a in range(0, n, rows):
        block = np.asarray(images[a : a + rows])
        for k in range(c):
            tables[k] += np.bincount(block[:, k].reshape(-1), minlength=256)
    return tables


def manifest_features(manifest, classes) -> dict[str, Values]:
    """The label and patient features of one split's manifest (see the module docstring)."""
    out: dict[str, Values] = {"images": Values(np.ones(len(manifest)))}
    ids = [p for p in manifest.patient_ids if p]
    _, per_patient = np.unique(np.asarray(ids, dtype=object), return_counts=True) if ids else (None, [])
    out["patients"] = Values(np.asarray(per_patient, dtype=np.float64))
    pos, neg = manifest.positives(), manifest.negatives()
    for j, c in enumerate(classes):
        out[class_feature("pos", j)] = Values(np.ones(int(pos[j])))
        out[class_feature("neg", j)] = Values(np.ones(int(neg[j])))
    return out


def image_features(paths, images) -> dict[str, Values]:
    """Size, aspect and per-channel pixel values of the training images (``images``: their decoded store)."""
    sizes = np.asarray([image_size(p) for p in paths], dtype=np.float64).reshape(-1, 2)
    out = {"width": Values(sizes[:, 0]), "height": Values(sizes[:, 1]), "aspect": Values(sizes[:, 0] / sizes[:, 1])}
    for k, table in enumerate(pixel_tables(images)):
        out[intensity_feature(k)] = Values(PIXEL_LEVELS, table)
    return out


class SiteStatistics(Statistics):
    """The site's data statistics (see the module docstring).

    Args:
        dataset: the job's dataset config (a preset and its overrides, as a training job's), resolved at the site.
        images: whether to decode the training images for sizes and intensities (False: labels and counts only).
    """

    def __init__(self, dataset: dict | str, images: bool = True):
        super().__init__()
        self.dataset = dataset
        self.images = images
        self.data: dict[str, dict[str, Values]] = {}

    def initialize(self, fl_ctx: FLContext):
        site = fl_ctx.get_identity_name()
        workspace = fl_ctx.get_engine().get_workspace()
        local_dir = workspace.get_site_config_dir() if hasattr(workspace, "get_site_config_dir") else None
        simulated = bool(fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False))
        ds = self.resolved()
        site_data = resolve_site_data(site, ds, local_dir, simulated=simulated)
        if site_data.synthetic:
            self.log_warning(
                fl_ctx, f"*** SYNTHETIC DATA *** site {site} describes the generated {site_data.dataset} phantom"
            )
        self.data = compute_site_statistics(site, ds, site_data, self.images, log=lambda m: self.log_info(fl_ctx, m))

    def resolved(self) -> dict:
        return resolve_dataset(self.dataset)

    # ----------------------------------------------------------------------------------------- the spec
    def features(self) -> dict[str, list[Feature]]:
        return {
            split: [
                Feature(name, DataType.FLOAT if name.startswith(("aspect", "intensity")) else DataType.INT)
                for name in feats
            ]
            for split, feats in self.data.items()
        }

    def count(self, dataset_name: str, feature_name: str) -> int:
        return self.data[dataset_name][feature_name].count

    def sum(self, dataset_name: str, feature_name: str) -> float:
        return self.data[dataset_name][feature_name].sum

    def mean(self, dataset_name: str, feature_name: str) -> float:
        return self.data[dataset_name][feature_name].mean

    def stddev(self, dataset_name: str, feature_name: str) -> float:
        return self.data[dataset_name][feature_name].stddev()

    def variance_with_mean(self, dataset_name, feature_name, global_mean, global_count) -> float:
        return self.data[dataset_name][feature_name].variance_with_mean(global_mean, global_count)

    def histogram(self, dataset_name, feature_name, num_of_bins, global_min_value, global_max_value) -> Histogram:
        return self.data[dataset_name][feature_name].histogram(num_of_bins, global_min_value, global_max_value)

    def max_value(self, dataset_name: str, feature_name: str) -> float:
        return self.data[dataset_name][feature_name].max()

    def min_value(self, dataset_name: str, feature_name: str) -> float:
        return self.data[dataset_name][feature_name].min()


def compute_site_statistics(site: str, ds: dict, site_data, images: bool = True, log=None) -> dict:
    """``{split: {feature: Values}}`` of a site's data (every split of :data:`SPLITS`, empty where the site has
    none, so that every site answers for the same datasets)."""
    classes = list(ds["classes"])
    read = dict(classes=classes, data_root=site_data.data_root, site=site, task=ds["task"], **site_data.vocabulary)
    full = read_manifest(site_data.train, require_annotated=False, **read)
    manifests = {"train": full.subset("train")}
    for split in ("val", "test"):
        path = getattr(site_data, split)
        if path is not None:
            manifests[split] = read_manifest(path, require_annotated=False, **read)
        elif split in full.splits:
            manifests[split] = full.subset(split)
    out = {}
    for split in SPLITS:
        m = manifests.get(split) or full.subset(split)  # an absent split: no rows
        out[split] = manifest_features(m, classes)
    if images and len(manifests["train"]):
        data = SiteDatasets({"train": manifests["train"]}, ds, log_fn=log)
        out["train"].update(image_features(manifests["train"].paths, data.store("train").images))
    return out


class PolicyMinCountCleanser(MinCountCleanser):
    """NVFlare's ``MinCountCleanser`` with the site's privacy policy: the minimum count is the stricter of the
    job's and the site's scope ``min_count`` (read when the job starts), and a feature with fewer records than
    that has its count withheld too (not only its other statistics); a count of zero is kept."""

    def __init__(self, min_count: int = 5):
        super().__init__(min_count=min_count)
        self.job_min_count = min_count

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            self.apply_policy(fl_ctx)

    def apply_policy(self, fl_ctx: FLContext) -> None:
        """The minimum count of the job at this site: the stricter of the job's and its privacy scope's."""
        _, props = scope_of(fl_ctx)
        self.min_count = effective_min_count(self.job_min_count, props)

    def apply(self, statistics: dict, client_name: str):
        valid = self.min_count_validate(client_name, statistics)
        statistics, modified = super().apply(statistics, client_name)
        counts = statistics.get(StC.STATS_COUNT, {})
        for ds_name, feats in valid.items():
            for feature, ok in feats.items():
                if not ok and counts.get(ds_name, {}).get(feature, 0) != 0:
                    counts[ds_name].pop(feature, None)
                    modified = True
        return statistics, modified


class PolicyStatisticsPrivacyFilter(StatisticsPrivacyFilter):
    """NVFlare's ``StatisticsPrivacyFilter`` that hands the site's privacy scope (the task result's FL context,
    where the site's policy filters read it too) to :class:`PolicyMinCountCleanser` before the cleansers run."""

    def process_dxo(self, dxo, shareable, fl_ctx: FLContext):
        for cleanser in self.get_cleansers(self.result_cleanser_ids, fl_ctx):
            if isinstance(cleanser, PolicyMinCountCleanser):
                cleanser.apply_policy(fl_ctx)
        return super().process_dxo(dxo, shareable, fl_ctx)


class DataReportWriter(JsonStatsFileWriter):
    """NVFlare's statistics JSON writer that also writes the coordinator's report beside it (in the server's run
    folder): ``data_report.md``, ``data_report.json``, ``data_intensity.png`` (:mod:`fedpartial.data_report`).

    Args:
        output_path: NVFlare's statistics JSON, relative to the server's run folder.
        classes: the job's classes (the report's column order).
        thresholds: the warnings' thresholds (:data:`fedpartial.data_report.THRESHOLDS` names them).
        min_count: the job's minimum count (the report says what was withheld below it).
    """

    def __init__(self, output_path: str, classes: list, thresholds: dict | None = None, min_count: int = 5):
        super().__init__(output_path=output_path, json_encoder_path="nvflare.app_common.utils.json_utils.ObjectEncoder")
        self.classes = list(classes)
        self.thresholds = dict(thresholds or {})
        self.min_count = int(min_count)

    def save(self, data: dict, overwrite_existing, fl_ctx: FLContext):
        super().save(data, overwrite_existing, fl_ctx)
        self.get_output_path(fl_ctx)  # sets job_dir: the server's run folder
        paths = write_report(data, self.classes, Path(self.job_dir), self.thresholds, self.min_count)
        self.log_info(fl_ctx, f"data report: {paths['md']}")
