"""Before any training: every site validates its data and reports what it annotates.

- :class:`DataSummaryProcessor` (a ``ResponseProcessor`` for NVFlare's ``BroadcastAndProcess`` workflow) sends
  the server's job spec (method, resolved options, model architecture) to every site, stops the job with the
  site's own error (site, file, line) when a manifest is bad or the site's job configuration differs from the
  server's, refuses a class list that differs from the server's, checks that every class is annotated by some
  site and that the federation suits the method (the rule's ``check_federation``, e.g. FedIRM needs labelled
  and unlabelled sites), and logs the per-site table of annotated positives.
- :class:`SummaryFilter` (a server task-data filter) attaches that summary to every ``train`` task, so methods
  that need global label statistics (FedLSM's class weights, FedMLP's global positive rates) have them from
  round 0 on.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.client import Client
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.response_processor import ResponseProcessor

from ..data.manifest import ManifestError, check_coverage
from .keys import META_SPEC, META_SUMMARY
from .spec import job_spec
from ..models import ARCH_OPTIONS


def summary_table(summary: dict) -> str:
    """Per-site annotated positives per class ('-' where the site does not annotate the class)."""
    classes = summary["classes"]
    width = max(8, *(len(c) for c in classes))
    lines = ["site".ljust(10) + "n".rjust(7) + "".join(c[:width].rjust(width + 1) for c in classes)]
    for site, s in sorted(summary["sites"].items()):
        cells = [str(p) if a else "-" for p, a in zip(s["positives"], s["annotated"])]
        lines.append(site[:10].ljust(10) + str(s["n_train"]).rjust(7) + "".join(c.rjust(width + 1) for c in cells))
    return "\n".join(lines)


class DataSummaryProcessor(ResponseProcessor):
    """Args:
        classes: the job's class list (every site must use it).
        aggregator_id, model_id: the components whose method / options and model architecture make the job spec
            sent to the sites (absent components: no spec check).
        max_missing: how many connected sites may leave the data check unanswered (dead, or slower than the
            workflow's ``timeout``); the job goes on without them (their updates are refused) or stops when more
            are missing. A site that answers with an error always stops the job.
    """

    def __init__(self, classes: list[str] | None = None, aggregator_id: str = "aggregator", model_id: str = "model",
                 max_missing: int = 0, class_without_annotator: str = "stop"):
        """``class_without_annotator``: what the data check does when up to ``max_missing`` sites are absent and
        some class is annotated only at absent sites: ``stop`` the job (naming the classes and absent sites), or
        ``train_without`` them (a warning naming the classes and sites, recorded as ``unannotated_classes`` in the
        summary; those classes are not learnt in this run). A class no site annotates at all always stops."""
        super().__init__()
        self.classes, self.aggregator_id, self.model_id = classes, aggregator_id, model_id
        self.max_missing = int(max_missing)
        if class_without_annotator not in CLASS_POLICIES:
            raise ValueError(f"class_without_annotator must be one of {CLASS_POLICIES}, got {class_without_annotator!r}")
        self.class_without_annotator = class_without_annotator
        self.summary: dict | None = None
        self._sites: dict[str, dict] = {}
        self.error: str | None = None

    def _fail(self, fl_ctx: FLContext, error: str) -> bool:
        self.error = error
        self.log_error(fl_ctx, f"DATA CHECK FAILED: {error}")
        self.system_panic(f"data check failed: {error}", fl_ctx)
        return False

    def _spec(self, fl_ctx: FLContext) -> dict | None:
        engine = fl_ctx.get_engine()
        agg, model = engine.get_component(self.aggregator_id), engine.get_component(self.model_id)
        if agg is None or getattr(agg, "rule", None) is None:
            return None
        arch = {k: getattr(model, k) for k in ARCH_OPTIONS if hasattr(model, k)} if model is not None else {}
        return job_spec(agg.method, agg.method_args, arch)

    def create_task_data(self, task_name: str, fl_ctx: FLContext) -> Shareable:
        self._sites, self.summary, self.error = {}, None, None
        task = Shareable()
        spec = self._spec(fl_ctx)
        if spec is not None:
            task[META_SPEC] = spec
        return task

    def process_client_response(self, client: Client, task_name: str, response: Shareable, fl_ctx: FLContext) -> bool:
        rc = response.get_return_code()
        if rc and rc != ReturnCode.OK:
            return self._fail(fl_ctx, response.get_header("error")
                              or f"site '{client.name}' failed the data check (return code {rc})")
        info = from_shareable(response).get_meta_prop(META_SUMMARY)
        if self.classes is not None and list(info["classes"]) != list(self.classes):
            return self._fail(fl_ctx, f"site '{client.name}' uses classes {info['classes']}, the server expects "
                                      f"{self.classes}")
        self._sites[client.name] = info
        return True

    def final_process(self, fl_ctx: FLContext) -> bool:
        if not self._sites:
            return self._fail(fl_ctx, "no site answered the data check")
        try:
            connected = sorted(c.name for c in fl_ctx.get_engine().get_clients())
        except Exception:  # noqa: BLE001
            connected = sorted(self._sites)
        silent = [c for c in connected if c not in self._sites]
        if len(silent) > self.max_missing:
            return self._fail(fl_ctx, f"site(s) {silent} did not answer the data check (at most {self.max_missing} "
                                      "may be missing)")
        if silent:
            self.log_warning(fl_ctx, f"site(s) {silent} did not answer the data check; the job goes on without them")
        classes = self.classes or next(iter(self._sites.values()))["classes"]
        summary = {"classes": list(classes), "sites": self._sites}
        agg = fl_ctx.get_engine().get_component(self.aggregator_id)
        annotated = {s: np.asarray(i["annotated"], bool) for s, i in self._sites.items()}
        uncovered = [c for j, c in enumerate(classes) if not any(a[j] for a in annotated.values())]
        if uncovered and (silent or self.max_missing):  # their annotators may be the absent (or undeployed) sites
            absent = f"the absent site(s) {silent}" if silent else "sites absent from this job"
            where = f"annotated by none of the sites present ({', '.join(sorted(self._sites))}), only by {absent}"
            if self.class_without_annotator == "stop":
                return self._fail(fl_ctx, f"class(es) {uncovered} are {where} (class_without_annotator: stop; set "
                                          "it to train_without to train the other classes without them)")
            self.log_warning(fl_ctx, f"class(es) {uncovered} are {where}: training WITHOUT them "
                                     "(class_without_annotator: train_without)")
            summary["unannotated_classes"] = uncovered
            annotated = {s: a | np.isin(np.asarray(classes), uncovered) for s, a in annotated.items()}  # checked above
        try:
            check_coverage(annotated, classes)
            if getattr(agg, "rule", None) is not None:
                agg.rule.check_federation(summary)
        except (ManifestError, ValueError) as e:
            return self._fail(fl_ctx, str(e))
        self.summary = summary
        if any(i.get("synthetic") for i in self._sites.values()):
            self.log_warning(fl_ctx, "*** SYNTHETIC DATA: the sites train on a generated phantom, not real scans ***")
        self.log_info(fl_ctx, "annotated positives per site and class:\n" + summary_table(self.summary))
        return True


CLASS_POLICIES = ("stop", "train_without")

# what of each site's data-check answer travels to the other sites (no configuration paths, no vocabulary)
SHARED_SITE_FIELDS = ("n_train", "n_val", "n_test", "annotated", "positives", "negatives", "classes", "synthetic",
                      "eval_sets")


def shared_summary(summary: dict) -> dict:
    """The federation summary as the sites receive it: per site only :data:`SHARED_SITE_FIELDS` (annotated
    counts, set sizes, evaluation-set fingerprints); the rest of each site's answer stays at the server."""
    return {**{k: v for k, v in summary.items() if k != "sites"},
            "sites": {s: {k: info[k] for k in SHARED_SITE_FIELDS if k in info}
                      for s, info in (summary.get("sites") or {}).items()}}


class SummaryFilter(DXOFilter):
    """Adds the data summary (component ``summary_id``, reduced to :func:`shared_summary`) to the meta of
    outgoing task data."""

    def __init__(self, summary_id: str = "data_summary"):
        super().__init__(supported_data_kinds=None, data_kinds_to_filter=None)
        self.summary_id = summary_id

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        comp = fl_ctx.get_engine().get_component(self.summary_id)
        summary = getattr(comp, "summary", None)
        if summary is not None:
            dxo.set_meta_prop(META_SUMMARY, shared_summary(summary))
        return dxo


# ------------------------------------------------------------------------------------------ what leaves a site
# per-class statistics a method sends, with the per-class image counts behind them: FedMLP's prototypes P0 / P1
# are backed by counts[:, 0] / counts[:, 1]; FedLSM's estimated class counts q are their own counts; FedNoRo's
# per-class losses by fednoro_class_count.
from ..methods.fedlsm.maths import META_Q as FEDLSM_Q  # noqa: E402
from ..methods.fedmlp.maths import META_COUNTS as FEDMLP_COUNTS, META_P0 as FEDMLP_P0, META_P1 as FEDMLP_P1  # noqa: E402
from ..methods.fednoro.maths import META_CLASS_COUNT as FEDNORO_COUNT, META_CLASS_LOSS as FEDNORO_LOSS  # noqa: E402


def suppress_small_counts(meta: dict, min_count: int) -> tuple[dict, list[str]]:
    """Drop every per-class statistic computed from fewer than ``min_count`` images (but at least one).

    - FedMLP: prototype row ``P_n[c]`` with ``0 < counts[c, n] < min_count`` becomes a zero row and its count 0
      (the server leaves a prototype with count 0 out of the average, as one the site does not hold).
    - FedLSM: ``q[c]`` with ``0 < q[c] < min_count`` becomes 0 (AWPA then gives the site no weight for class c;
      a class no site reports falls back to sample-count weights).
    - FedNoRo: the per-class loss ``fednoro_class_loss[c]`` from ``0 < fednoro_class_count[c] < min_count`` images
      becomes NaN and its count 0 (the server fills a missing class as the paper fills an absent one).

    Returns ``(new meta, ["key[c]", ...] of what was dropped)``; ``meta`` itself is not modified.
    """
    out, dropped = dict(meta), []
    if min_count <= 1:
        return out, dropped
    if FEDMLP_COUNTS in meta:
        counts = np.array(meta[FEDMLP_COUNTS], dtype=np.int64, copy=True)  # (C, 2)
        for n, key in enumerate((FEDMLP_P0, FEDMLP_P1)):
            small = (counts[:, n] > 0) & (counts[:, n] < min_count)
            if not small.any():
                continue
            if key in meta:
                p = np.array(meta[key], copy=True)
                p[small] = 0
                out[key] = p
            counts[small, n] = 0
            dropped += [f"{key}[{c}]" for c in np.flatnonzero(small)]
        out[FEDMLP_COUNTS] = counts
    if FEDLSM_Q in meta:
        q = np.array(meta[FEDLSM_Q], dtype=np.float64, copy=True)
        small = (q > 0) & (q < min_count)
        q[small] = 0.0
        out[FEDLSM_Q] = q
        dropped += [f"{FEDLSM_Q}[{c}]" for c in np.flatnonzero(small)]
    if FEDNORO_COUNT in meta and FEDNORO_LOSS in meta:
        count = np.array(meta[FEDNORO_COUNT], dtype=np.float64, copy=True)
        loss = np.array(meta[FEDNORO_LOSS], dtype=np.float64, copy=True)
        small = (count > 0) & (count < min_count)
        loss[small], count[small] = np.nan, 0.0
        out[FEDNORO_LOSS], out[FEDNORO_COUNT] = loss, count
        dropped += [f"{FEDNORO_LOSS}[{c}]" for c in np.flatnonzero(small)]
    return out, dropped


class MinCountFilter(DXOFilter):
    """Client-side task result filter (``task_result_filters`` of ``config_fed_client.json``, tasks ``train``):
    per-class statistics computed from fewer than ``min_count`` images never leave the site
    (:func:`suppress_small_counts`). A site can enforce it whatever the job says by listing it in its own NVFlare
    privacy policy (``local/privacy.json``)."""

    def __init__(self, min_count: int = 5):
        super().__init__(supported_data_kinds=None, data_kinds_to_filter=None)
        self.min_count = int(min_count)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        meta, dropped = suppress_small_counts(dict(dxo.meta or {}), self.min_count)
        if dropped:
            for k, v in meta.items():
                dxo.set_meta_prop(k, v)
            self.log_info(fl_ctx, f"min_count {self.min_count}: not sent: {', '.join(dropped)}")
        return dxo
