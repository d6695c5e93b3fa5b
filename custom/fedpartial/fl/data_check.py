"""Before any training: every site validates its data and reports what it annotates.

- :class:`DataSummaryProcessor` (a ``ResponseProcessor`` for NVFlare's ``BroadcastAndProcess`` workflow) sends
  the server's job spec (method, resolved options, model architecture) to every site, stops the job with the
  site's own error (site, file, line) when a manifest is bad or the site's job configuration differs from the
  server's, refuses a class list that differs from the server's, checks that every class is annotated by some
  site and that the federation suits the method (the rule's ``check_federation``, e.g. a method that needs labelled
  and unlabelled sites), and logs the per-site table of annotated positives.
- :class:`SummaryFilter` (a server task-data filter) sends each site, with every task, what it needs of that
  summary (:func:`site_summary`: the federation's per-class totals for methods that need global label
  statistics, and which of its evaluation sets it scores), never another site's counts.
- :class:`MinCountFilter` (a client task-result filter): per-class statistics from fewer than ``min_count``
  images never leave the site, from the statistics each method declares.
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
from ..methods import available_methods, get_method
from ..models import ARCH_OPTIONS
from ..privacy import DEFAULT_MIN_COUNT, ClassStat, from_dicts, suppress_small
from .keys import META_PRIVACY, META_SPEC, META_SUMMARY
from .scoring import scorer_of
from .spec import job_spec


def summary_table(summary: dict) -> str:
    """Per-site annotated positives per class ('-' where the site does not annotate the class)."""
    classes = summary["classes"]
    width = max(8, *(len(c) for c in classes))
    lines = ["site".ljust(10) + "n".rjust(7) + "".join(c[:width].rjust(width + 1) for c in classes)]
    for site, s in sorted(summary["sites"].items()):
        m = int(s.get("min_count", 1))  # a site reports fewer than its minimum count as 0: shown as "<m"
        cells = [
            ("-" if not a else f"<{m}" if p == 0 and m > 1 else str(p)) for p, a in zip(s["positives"], s["annotated"])
        ]
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

    def __init__(
        self,
        classes: list[str] | None = None,
        aggregator_id: str = "aggregator",
        model_id: str = "model",
        max_missing: int = 0,
        class_without_annotator: str = "stop",
    ):
        """``class_without_annotator``: what the data check does when up to ``max_missing`` sites are absent and
        some class is annotated only at absent sites: ``stop`` the job (naming the classes and absent sites), or
        ``train_without`` them (a warning naming the classes and sites, recorded as ``unannotated_classes`` in the
        summary; those classes are not learnt in this run). A class no site annotates at all always stops."""
        super().__init__()
        self.classes, self.aggregator_id, self.model_id = classes, aggregator_id, model_id
        self.max_missing = int(max_missing)
        if class_without_annotator not in CLASS_POLICIES:
            raise ValueError(
                f"class_without_annotator must be one of {CLASS_POLICIES}, got {class_without_annotator!r}"
            )
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
            return self._fail(
                fl_ctx, response.get_header("error") or f"site '{client.name}' failed the data check (return code {rc})"
            )
        info = from_shareable(response).get_meta_prop(META_SUMMARY)
        if self.classes is not None and list(info["classes"]) != list(self.classes):
            return self._fail(
                fl_ctx, f"site '{client.name}' uses classes {info['classes']}, the server expects {self.classes}"
            )
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
            return self._fail(
                fl_ctx, f"site(s) {silent} did not answer the data check (at most {self.max_missing} may be missing)"
            )
        if silent:
            self.log_warning(fl_ctx, f"site(s) {silent} did not answer the data check; the job goes on without them")
        for sites in same_training_rows(self._sites):
            self.log_warning(
                fl_ctx,
                f"sites {sites} train on identical manifests (the same rows and labels): is "
                "each site configured with its own data?",
            )
        classes = self.classes or next(iter(self._sites.values()))["classes"]
        summary = {"classes": list(classes), "sites": self._sites}
        agg = fl_ctx.get_engine().get_component(self.aggregator_id)
        annotated = {s: np.asarray(i["annotated"], bool) for s, i in self._sites.items()}
        uncovered = [c for j, c in enumerate(classes) if not any(a[j] for a in annotated.values())]
        if uncovered and (silent or self.max_missing):  # their annotators may be the absent (or undeployed) sites
            present = ", ".join(sorted(self._sites))
            where = (
                f"annotated by none of the sites present ({present}), only by the absent site(s) {silent}"
                if silent
                else f"annotated by no site present ({present}; sites absent from this job may annotate them)"
            )
            if self.class_without_annotator == "stop":
                return self._fail(
                    fl_ctx,
                    f"class(es) {uncovered} are {where} (class_without_annotator: stop; set "
                    "it to train_without to train the other classes without them)",
                )
            self.log_warning(
                fl_ctx,
                f"class(es) {uncovered} are {where}: training WITHOUT them (class_without_annotator: train_without)",
            )
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


def same_training_rows(sites: dict[str, dict]) -> list[list[str]]:
    """Groups of two or more sites whose data-check answers report the same training-set fingerprint."""
    by_fp: dict[str, list[str]] = {}
    for site, info in sorted(sites.items()):
        if info.get("train_set") and info.get("n_train"):
            by_fp.setdefault(info["train_set"], []).append(site)
    return [group for group in by_fp.values() if len(group) > 1]


CLASS_POLICIES = ("stop", "train_without")

# what of each site's data-check answer travels to the other sites (no configuration paths, no vocabulary)
SHARED_SITE_FIELDS = (
    "n_train",
    "n_val",
    "n_test",
    "annotated",
    "positives",
    "negatives",
    "classes",
    "synthetic",
    "eval_sets",
)


def shared_summary(summary: dict) -> dict:
    """The federation summary as the sites receive it: per site only :data:`SHARED_SITE_FIELDS` (annotated
    counts, set sizes, evaluation-set fingerprints); the rest of each site's answer stays at the server."""
    return {
        **{k: v for k, v in summary.items() if k != "sites"},
        "sites": {
            s: {k: info[k] for k in SHARED_SITE_FIELDS if k in info} for s, info in (summary.get("sites") or {}).items()
        },
    }


def site_summary(summary: dict, site: str) -> dict:
    """The data summary as ``site`` receives it: only what a site uses. The federation's totals per class
    (annotated positives and negatives, summed over the sites, each site's counts below its minimum count
    already reported as 0; training images) under the single entry ``sites["federation"]`` (so
    :func:`fedpartial.methods.base.summary_counts` reads it as before), and ``scores``: which of its own
    evaluation sets this site scores (a set several sites share is scored by the first of them by name). No
    other site's counts, sizes, fingerprints or configuration."""
    sites = summary.get("sites") or {}
    C = len(summary["classes"])
    total = {"positives": np.zeros(C, np.int64), "negatives": np.zeros(C, np.int64), "annotated": np.zeros(C, bool)}
    n_train = 0
    for info in sites.values():
        for k in total:
            total[k] = (
                total[k] + np.asarray(info.get(k, np.zeros(C)), total[k].dtype)
                if k != "annotated"
                else total[k] | np.asarray(info.get(k, np.zeros(C)), bool)
            )
        n_train += int(info.get("n_train", 0))
    mine = (sites.get(site) or {}).get("eval_sets") or {}
    scores = {split: scorer_of(split, fp, sites) in (None, site) for split, fp in mine.items()}
    return {
        "classes": list(summary["classes"]),
        "sites": {
            "federation": {
                "positives": total["positives"].tolist(),
                "negatives": total["negatives"].tolist(),
                "annotated": total["annotated"].tolist(),
                "n_train": n_train,
                "n_sites": len(sites),
            }
        },
        "scores": scores,
    }


class SummaryFilter(DXOFilter):
    """Server task-data filter: adds to every ``train`` and ``validate`` task the data summary as its site needs
    it (:func:`site_summary`: federation totals, which of its sets it scores), in a metadata dict of that site's
    task alone.

    NVFlare gives each site a shallow copy of a round's broadcast task (``make_copy``): the DXO's metadata dict is
    shared by every site's copy, so a summary written into it in place reached the sites whose replies left after
    it (each site scored by another site's ``scores``: a shared test set counted twice, or scored by no site).
    Sent with every task, not only a site's first: NVFlare resends a task whose delivery was lost and the filter
    cannot tell a resend from a new task. The summary is a few numbers per class; the server logs, once per site
    and summary, which sets the site scores."""

    def __init__(self, summary_id: str = "data_summary"):
        super().__init__(supported_data_kinds=None, data_kinds_to_filter=None)
        self.summary_id = summary_id
        self._logged: dict[str, int] = {}  # site -> id of the summary whose scoring was logged

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        comp = fl_ctx.get_engine().get_component(self.summary_id)
        summary = getattr(comp, "summary", None)
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer else None
        if summary is None or site is None:
            return dxo
        mine = site_summary(summary, site)
        dxo = DXO(data_kind=dxo.data_kind, data=dxo.data, meta={**(dxo.meta or {}), META_SUMMARY: mine})
        if self._logged.get(site) != id(summary):  # which of its evaluation sets each site scores, once per site
            self.logger.info(
                f"data summary sent to {site}: it scores "
                f"{sorted(k for k, v in mine['scores'].items() if v) or 'none of its sets'}"
                + (
                    ""
                    if site in (summary.get("sites") or {})
                    else " (the site is not in the data summary: it did not answer the data check)"
                )
            )
            self._logged[site] = id(summary)
        return dxo


# ------------------------------------------------------------------------------------------ what leaves a site
def declared_statistics() -> list[ClassStat]:
    """Every registered method's per-class statistics (``LocalTrainer.per_class_metadata``), one per key."""
    out: dict[str, ClassStat] = {}
    for name in available_methods():
        for st in get_method(name).trainer.per_class_metadata:
            out.setdefault(st.key, st)
    return list(out.values())


def suppress_small_counts(meta: dict, min_count: int, stats: list[ClassStat] | None = None) -> tuple[dict, list[str]]:
    """:func:`fedpartial.privacy.suppress_small` with the declarations ``stats`` (default: every registered
    method's, :func:`declared_statistics`): every declared per-class statistic computed from fewer than
    ``min_count`` images (but at least one) is dropped. Returns ``(new meta, ["key[c]", ...] dropped)``;
    ``meta`` itself is not modified."""
    return suppress_small(meta, declared_statistics() if stats is None else stats, min_count)


class MinCountFilter(DXOFilter):
    """Client-side task result filter (``task_result_filters`` of ``config_fed_client.json``, tasks ``train``):
    per-class statistics computed from fewer than ``min_count`` images never leave the site. It works from the
    statistics the method declares (the round's privacy ledger entry; :func:`suppress_small_counts` for an update
    without one) and records its minimum count in the ledger entry. A site enforces its own minimum whatever
    the job says with its NVFlare privacy policy (``local/privacy.json``, :mod:`fedpartial.fl.privacy`)."""

    def __init__(self, min_count: int = DEFAULT_MIN_COUNT):
        super().__init__(supported_data_kinds=None, data_kinds_to_filter=None)
        self.min_count = int(min_count)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        meta = dict(dxo.meta or {})
        entry = meta.get(META_PRIVACY)
        stats = from_dicts(entry["declared"]) if entry else None
        if entry and entry.get("released") and any(r.get("noise_multiplier") for r in entry["released"]):
            return dxo  # noised by the site's policy, thresholded on the noised counts already
        new, dropped = suppress_small_counts(meta, self.min_count, stats)
        for k, v in new.items():
            if v is not meta[k]:
                dxo.set_meta_prop(k, v)
        if entry and self.min_count > int(entry.get("min_count", 1)):
            entry = {
                **entry,
                "min_count": self.min_count,
                "released": [{**r, "min_count": self.min_count} for r in entry.get("released", [])],
            }
            dxo.set_meta_prop(META_PRIVACY, entry)
        if dropped:
            self.log_info(fl_ctx, f"min_count {self.min_count}: not sent: {', '.join(dropped)}")
        return dxo
