"""Server-side results: per-round validation / test metrics of the global model, the best round on
validation, the final cross-site evaluation of the last and best global models, written to
``<server run dir>/results.json`` and printed as per-class tables at the end of the run.

Pooled and per-site numbers: the sites score the model they receive on their validation / test data; a set
several sites share (the simulator's central splits) is scored once, by the first of them by name (see
``fedpartial.fl.executor``). ``val`` / ``test`` in ``results.json`` pool the scored sets: the average of each
set's metrics weighted by its size, ``n`` = the images scored, each once, ``evaluated_by`` = who scored. When a
method keeps parts of the model local (FedBN, PFL) every site scores its own model and the pooled numbers
average the sites' own models; each site's numbers stay under ``rounds[i].site_results`` and
``final[model].per_site``; ``final[model].val_score_hist`` / ``test_score_hist`` pool the sets' score histograms
(the ROC / PR curves of ``show_results``); ``final[model].across_sites`` compares the test AUROC within each
site's own set, their mean and the sets pooled (:func:`across_sites`). ``data`` records the federation's data summary (sizes, annotated classes, which
evaluation sets are shared).

Operating thresholds (multi-label): every round and every final model get per-class thresholds chosen on the
pooled validation score histograms (``threshold_criterion``: ``youden`` / ``bacc``, the same choice, or ``f1``;
``fedpartial.metrics.apply_validation_thresholds``) under ``rounds[i].thresholds`` / ``final[model].thresholds``,
and every val / test result gains ``bacc_val_thr``, ``f1_val_thr``, ``precision_val_thr``, ``recall_val_thr``
beside the 0.5-threshold ``bacc`` / ``f1`` / ... (on validation they are in-sample, hence optimistic). The final
models' thresholds are also written to ``thresholds.json`` next to the saved global models (``app_server/``),
where ``fedpartial-predict --thresholds validation`` finds them. Single-label runs predict the argmax: none.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import numpy as np
from nvflare.apis.dxo import MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.widgets.widget import Widget

from ..data.presets import resolve_dataset
from ..metrics import THRESHOLD_CRITERIA, apply_validation_thresholds, histogram_auroc, pool_histograms
from ..models import ENCODER_FILE, save_encoder, start_normalisation
from ..stats import add_run_statistics
from ..tables import setting_label
from .keys import (
    BEST_MODEL,
    LAST_MODEL,
    META_ANNOTATED,
    META_CLIPPED,
    META_GROUPS,
    META_MISSING,
    META_N_TRAIN,
    META_PRIVACY,
    META_REJECTED,
    META_RESULTS,
    META_RULE_ERROR,
    META_SKIPPED,
    META_TEST,
    META_WEIGHT,
)
from .privacy import add_cumulative_epsilon, ledger_totals
from .report import RESULTS_FILE, TABLE_FILE, THRESHOLDS_FILE, degradation, render_tables
from .spec import global_model_note, local_parts, resolved_options

# meta every site sends each round; the rest (prototypes, degrees, counts, ...) is the method's own exchange
_STANDARD_META = {
    META_RESULTS,
    META_TEST,
    META_N_TRAIN,
    META_ANNOTATED,
    META_GROUPS,
    META_WEIGHT,
    META_RULE_ERROR,
    META_SKIPPED,
    META_MISSING,
    META_REJECTED,
    META_CLIPPED,
    META_PRIVACY,
    "train_loss",
    "train_seconds",
    "eval_seconds",
    "device",
    MetaKey.INITIAL_METRICS,
    MetaKey.NUM_STEPS_CURRENT_ROUND,
}


def average_results(results: list[tuple[dict, float]]) -> dict | None:
    """Weighted average of several metric result dicts (``fedpartial.metrics`` layout); None entries skipped."""
    results = [(r, w) for r, w in results if r]
    if not results:
        return None
    first = results[0][0]

    def avg(get):
        vals = [(get(r), w) for r, w in results]
        vals = [(v, w) for v, w in vals if isinstance(v, (int, float)) and v == v]
        tot = sum(w for _, w in vals)
        return sum(v * w for v, w in vals) / tot if tot > 0 else None

    out = {k: v for k, v in first.items() if k not in ("macro", "per_class", "n", "counts")}
    if all(isinstance(r.get("counts"), dict) for r, _ in results):  # counts add up (None: kept at a site)
        out["counts"] = {
            c: {
                k: (
                    None
                    if any((r["counts"].get(c) or {}).get(k) is None for r, _ in results)
                    else sum(r["counts"][c][k] for r, _ in results)
                )
                for k in first["counts"][c]
            }
            for c in first["counts"]
        }
    out["n"] = sum(r.get("n", 0) for r, _ in results)
    out["macro"] = {m: avg(lambda r, m=m: r["macro"].get(m)) for m in first.get("macro", {})}
    out["per_class"] = {
        c: {m: avg(lambda r, c=c, m=m: r["per_class"][c].get(m)) for m in first["per_class"][c]}
        for c in first.get("per_class", {})
    }
    out["n_sites"] = len(results)
    return out


class ResultsRecorder(Widget):
    """Args:
        key_metric: validation metric used to name the best round (same as IntimeModelSelector's).
        method, dataset: recorded in the results file.
        summary_id: id of the data-summary component (names the partial-annotation setting in the table).
        threshold_criterion: how the per-class operating thresholds are chosen on validation (multi-label):
            ``youden`` (default; ``bacc`` chooses the same) or ``f1``.

    Besides the metrics, each round records the names of the method's own metadata each site sent and the
    server sent back (e.g. FedMLP's prototypes), so the exchange can be audited from ``results.json``.
    """

    def __init__(
        self,
        key_metric: str = "auc",
        method: str = "",
        dataset: str = "",
        summary_id: str = "data_summary",
        selector_id: str = "model_selector",
        threshold_criterion: str = "youden",
    ):
        super().__init__()
        if threshold_criterion not in THRESHOLD_CRITERIA:
            raise ValueError(f"threshold_criterion must be one of {THRESHOLD_CRITERIA}, got {threshold_criterion!r}")
        self.key_metric, self.method, self.dataset, self.summary_id = key_metric, method, dataset, summary_id
        self.threshold_criterion = threshold_criterion
        self.selector_id = selector_id
        self._reset()

    def _reset(self):
        self.rounds: dict[int, dict] = {}
        self.setting = "unknown"
        self.final: dict[str, dict] = {}
        self.data: dict = {}
        self._round_start: dict[int, float] = {}
        self._t0 = time.time()

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            self._reset()
        elif event_type == AppEventType.ROUND_STARTED:
            self._round_start[int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND))] = time.time()
        elif event_type == AppEventType.BEFORE_CONTRIBUTION_ACCEPT:
            self._record_contribution(fl_ctx)
        elif event_type == AppEventType.AFTER_AGGREGATION:
            self._record_aggregation(fl_ctx)
        elif event_type == AppEventType.ROUND_DONE:
            rnd = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND))
            entry = self.rounds.setdefault(rnd, {"sites": {}})
            entry["seconds"] = time.time() - self._round_start.get(rnd, self._t0)
        elif event_type == AppEventType.VALIDATION_RESULT_RECEIVED:
            self._record_validation(fl_ctx)
        elif event_type == EventType.END_RUN:
            self._write(fl_ctx)

    def _record_contribution(self, fl_ctx: FLContext):
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer else "?"
        shareable = peer.get_prop(FLContextKey.SHAREABLE) if peer else None
        if shareable is None:
            return
        try:
            dxo = from_shareable(shareable)
        except Exception:  # noqa: BLE001 - the aggregator reports broken updates
            return
        rnd = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0)
        meta = dxo.meta or {}
        self.rounds.setdefault(rnd, {"sites": {}})["sites"][site] = {
            "results": meta.get(META_RESULTS, {}),
            "train_loss": meta.get("train_loss"),
            "steps": meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND),
            "train_seconds": meta.get("train_seconds"),
            "eval_seconds": meta.get("eval_seconds"),
            "method_meta": _method_meta_keys(meta),
            "method_stats": method_stats(meta),
            "participation": meta.get(META_WEIGHT, 1.0),
            "privacy": _ledger_entry(meta.get(META_PRIVACY)),
            "device": meta.get("device"),  # the site's training device (fedpartial.device.device_record)
        }

    def _record_aggregation(self, fl_ctx: FLContext):
        result = fl_ctx.get_prop(AppConstants.AGGREGATION_RESULT)
        try:
            meta = from_shareable(result).meta or {}
        except Exception:  # noqa: BLE001
            return
        rnd = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0)
        entry = self.rounds.setdefault(rnd, {"sites": {}})
        entry["server_meta"], entry["server_stats"] = _method_meta_keys(meta), method_stats(meta)
        entry["rule_error"], entry["sat_out"] = meta.get(META_RULE_ERROR), meta.get(META_SKIPPED, [])
        entry["missing"], entry["rejected"] = meta.get(META_MISSING, []), meta.get(META_REJECTED, {})
        entry["clipped"] = meta.get(META_CLIPPED, [])

    def _record_validation(self, fl_ctx: FLContext):
        owner = fl_ctx.get_prop(AppConstants.MODEL_OWNER)
        site = fl_ctx.get_prop(AppConstants.DATA_CLIENT)
        result = fl_ctx.get_prop(AppConstants.VALIDATION_RESULT)
        if not (owner and site and result):
            return
        try:
            dxo = from_shareable(result)
        except Exception:  # noqa: BLE001
            return
        self.final.setdefault(str(owner), {})[site] = (dxo.meta or {}).get(META_RESULTS, {})

    @staticmethod
    def _site_average(per_site: dict, split: str) -> dict | None:
        return average_results([(r.get(split), (r.get(split) or {}).get("n", 0)) for r in per_site.values()])

    def summary(self) -> dict:
        rounds = []
        for rnd in sorted(self.rounds):
            e = self.rounds[rnd]
            res, thresholds = apply_validation_thresholds(
                {s: v["results"] for s, v in e["sites"].items()}, self.threshold_criterion
            )
            scored = {s: r for s, r in res.items() if r}
            rounds.append(
                {
                    "round": rnd,
                    "trained_rounds": rnd,  # the received model has been aggregated `rnd` times
                    "val": self._site_average(res, "val"),
                    "test": self._site_average(res, "test"),
                    "evaluated_by": {
                        split: sorted(s for s, r in res.items() if (r or {}).get(split)) for split in ("val", "test")
                    },
                    "site_results": scored if len(scored) > 1 else {},
                    "train_loss": {s: v["train_loss"] for s, v in e["sites"].items()},
                    "site_seconds": {
                        s: {"train": v.get("train_seconds"), "eval": v.get("eval_seconds")}
                        for s, v in e["sites"].items()
                    },
                    "site_devices": {s: v.get("device") for s, v in e["sites"].items()},
                    "sites": sorted(e["sites"]),
                    "seconds": e.get("seconds"),
                    "site_meta": {s: v.get("method_meta", []) for s, v in e["sites"].items()},
                    "server_meta": e.get("server_meta", []),
                    "site_stats": {s: v.get("method_stats", {}) for s, v in e["sites"].items()},
                    "server_stats": e.get("server_stats", {}),
                    "sat_out": e.get("sat_out", []),
                    "rule_error": e.get("rule_error"),
                    "missing": e.get("missing", []),
                    "rejected": e.get("rejected", {}),
                    "clipped": e.get("clipped", []),
                    "thresholds": thresholds,
                    **(
                        {"privacy": privacy}
                        if (privacy := {s: v["privacy"] for s, v in e["sites"].items() if v.get("privacy")})
                        else {}
                    ),
                }
            )
        best = None
        for r in rounds:
            v = ((r["val"] or {}).get("macro") or {}).get(self.key_metric)
            if r["round"] > 0 and v is not None and (best is None or v > best["val_" + self.key_metric]):
                best = {"trained_rounds": r["trained_rounds"], "val_" + self.key_metric: v}
        final = {}
        for owner, per_site in self.final.items():
            name = owner.replace("SRV_", "")
            scored, thresholds = apply_validation_thresholds(
                {site: r for site, r in per_site.items() if r}, self.threshold_criterion
            )
            if thresholds and len(scored) > 1:  # each site's own validation scores (its own model, with local parts)
                own = {
                    site: apply_validation_thresholds({site: per_site[site]}, self.threshold_criterion)[1]
                    for site in scored
                }
                thresholds = {**thresholds, "sites": {site: rec for site, rec in own.items() if rec}}
            final[name] = {
                "test": self._site_average(scored, "test"),
                "val": self._site_average(scored, "val"),
                "sites": sorted(scored),
                "per_site": scored if len(scored) > 1 else {},
                "thresholds": thresholds,
                **pooled_histograms(per_site),
            }
            final[name]["across_sites"] = across_sites(scored, final[name].get("test_score_hist"))
        ledger = ledger_totals(rounds)
        add_cumulative_epsilon(rounds)
        secs = [r["seconds"] for r in rounds if r.get("seconds")]
        return {
            "method": self.method,
            "dataset": self.dataset,
            "key_metric": self.key_metric,
            "setting": self.setting,
            "data": self.data,
            "num_rounds": len(rounds),
            "seconds_per_round": (sum(secs) / len(secs)) if secs else None,
            "wall_seconds": time.time() - self._t0,
            "best": best,
            "final": final,
            "rounds": rounds,
            **({"privacy": ledger} if ledger else {}),
        }

    def checkpoint_state(self) -> dict:
        """The rounds recorded so far and the seconds they took (a resumed job appends to them)."""
        return {"rounds": self.rounds, "seconds_before": time.time() - self._t0}

    def restore_checkpoint(self, state: dict) -> None:
        self.rounds = {int(k): v for k, v in (state.get("rounds") or {}).items()}
        self._t0 = time.time() - float(state.get("seconds_before", 0.0))

    def _setting(self, fl_ctx: FLContext) -> str:
        sites = self._summary_sites(fl_ctx)
        return setting_label([sites[s]["annotated"] for s in sorted(sites)]) if sites else "unknown"

    def _summary_sites(self, fl_ctx: FLContext) -> dict:
        comp = fl_ctx.get_engine().get_component(self.summary_id) if self.summary_id else None
        return (getattr(comp, "summary", None) or {}).get("sites") or {}

    def _write(self, fl_ctx: FLContext):
        self.setting = self._setting(fl_ctx)
        self.data = data_record(self._summary_sites(fl_ctx))
        out = self.summary()
        used = dataset_used(fl_ctx.get_prop(FLContextKey.APP_ROOT), self.dataset, self._summary_sites(fl_ctx))
        if used != self.dataset:  # e.g. a job keeping a preset's name for data prepared from another source
            out["dataset"], out["job_dataset"] = used, self.dataset
        selector = fl_ctx.get_engine().get_component(self.selector_id)
        if getattr(selector, "best_round", None) is not None:  # the selector's choice (its metric, e.g. site_bce)
            out["best"] = {
                "trained_rounds": selector.best_round,
                "metric": selector.key_metric,
                f"val_{selector.key_metric}": selector.best_raw_val_metric,
            }
        if getattr(selector, "patience", 0):
            out["early_stopping"] = {
                "patience": selector.patience,
                "best_round": selector.best_round,
                "stopped": selector.should_stop(),
                "last_round": selector.last_round,
            }
        agg = fl_ctx.get_engine().get_component("aggregator")
        if getattr(agg, "rule", None) is not None:
            out["method_options"] = resolved_options(agg.method, agg.method_args)
            out["local_parts"] = local_parts(agg.method, agg.method_args)
            out["global_model_note"] = global_model_note(out["local_parts"])
            if getattr(agg.rule, "scores_note", None):
                out["scores_note"] = agg.rule.scores_note
        add_run_statistics(out, self._summary_sites(fl_ctx))  # AUROC intervals, own-class scores (fedpartial.stats)

        out["degraded"] = degradation(out)
        run_dir = Path(fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id()))
        app_dir = Path(fl_ctx.get_prop(FLContextKey.APP_ROOT) or run_dir / "app_server")
        if getattr(getattr(agg, "rule", None), "writes_encoder", False):
            # the model that was best on validation (a self-supervised stage: its kNN vote) where there is one
            source = next((app_dir / f for f in (BEST_MODEL, LAST_MODEL) if (app_dir / f).is_file()), None)
            if source is not None:
                norm = job_normalisation(fl_ctx.get_prop(FLContextKey.APP_ROOT))
                out["encoder"] = str(save_encoder(source, run_dir / ENCODER_FILE, norm))
                out["encoder_from"] = (
                    f"the best on validation (after {out['best']['trained_rounds']} rounds)"
                    if source.name == BEST_MODEL and out.get("best")
                    else "the last round's"
                )
        out["thresholds"] = model_thresholds(out)
        text = render_tables(out)
        files = [(run_dir / RESULTS_FILE, json.dumps(out, indent=1, default=float)), (run_dir / TABLE_FILE, text)]
        if out["thresholds"].get("models"):  # next to the global models, for fedpartial-predict
            files.append((app_dir / THRESHOLDS_FILE, json.dumps(out["thresholds"], indent=1)))
        for path, content in files:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(content)
            os.replace(tmp, path)
        self.log_info(fl_ctx, "\n" + text)
        self.log_info(fl_ctx, f"results written to {run_dir / RESULTS_FILE} and {run_dir / TABLE_FILE}")
        if "encoder" in out:
            self.log_info(
                fl_ctx,
                f"encoder written to {out['encoder']}: start a job from it with --set model.pretrained=<that file>",
            )


def pooled_histograms(per_site: dict) -> dict:
    """``{"val_score_hist", "test_score_hist"}``: the sum of the sites' score histograms of a final model (what
    the validation thresholds are chosen on; ``fedpartial.plots`` draws the ROC / PR curves from them), for the
    splits where every scored set sent one (a site under a policy without histograms sends none)."""
    out = {}
    for split in ("val", "test"):
        sets = [r[split] for r in per_site.values() if r and r.get(split)]
        hists = [s.get("score_hist") for s in sets]
        if hists and all(hists):
            out[f"{split}_score_hist"] = pool_histograms(hists)
    return out


SITE_GAP = 5.0  # AUROC points the pooled test AUROC may exceed the mean within-site one before results warn


def across_sites(per_site: dict, pooled_hist: dict | None, split: str = "test") -> dict | None:
    """Whether a model ranks findings or sites: with two or more sites scoring test sets of their own, the macro
    AUROC within each site, their unweighted mean, and the AUROC of all sites' test images pooled (from the pooled
    score histograms; None where a site's policy sends none). A pooled AUROC well above the within-site mean
    (``SITE_GAP`` points) means part of it comes from telling the sites apart (prevalences that differ by site
    and images that show which site they come from), not from the findings; ``warning`` says so. None with fewer
    than two sites' own sets (the simulator's shared test set)."""
    within = {
        site: r[split]["macro"].get("auc")
        for site, r in sorted(per_site.items())
        if (r or {}).get(split) and r[split].get("macro", {}).get("auc") is not None
    }
    if len(within) < 2:
        return None
    mean = float(np.mean(list(within.values())))
    pooled = None
    if pooled_hist:
        per_class = [v for v in histogram_auroc(pooled_hist).values() if v is not None]
        pooled = float(np.mean(per_class)) if per_class else None
    out = {"within_site_auc": within, "mean_within_site_auc": mean, "pooled_auc": pooled, "warning": None}
    if pooled is not None and 100 * (pooled - mean) > SITE_GAP:
        out["warning"] = (
            f"the {split} AUROC of all sites pooled ({100 * pooled:.1f}) exceeds the mean within-site AUROC "
            f"({100 * mean:.1f}) by {100 * (pooled - mean):.1f} points: part of the pooled score comes from telling "
            "the sites apart, not the findings (check the label prevalences and image statistics per site: the "
            "statistics job)"
        )
    return out


def model_thresholds(results: dict) -> dict:
    """What ``thresholds.json`` holds: per final global model (file name) the per-class thresholds chosen on
    its validation result (None = none chosen, 0.5 applies), with the criterion; or why there are none."""
    models = {name: f["thresholds"] for name, f in (results.get("final") or {}).items() if f.get("thresholds")}
    if models:
        return {
            "models": models,
            "note": "per-class operating thresholds chosen on the validation set "
            "(predict positive when probability >= threshold; null: none chosen, use 0.5)",
        }
    tasks = [(f.get("test") or f.get("val") or {}).get("task") for f in (results.get("final") or {}).values()]
    why = (
        "single-label task: the prediction is the argmax, no threshold applies"
        if "multiclass" in tasks
        else "no validation result of a final model"
    )
    return {"models": {}, "note": why}


def source_label(source: dict | None) -> str | None:
    """A site's data source as results name it: ``csv (export.csv)``, ``folder (c)``, ``manifest (train.csv)``."""
    if not source or not source.get("source"):
        return None
    return str(source["source"]) + (f" ({source['file']})" if source.get("file") else "")


def dataset_used(app_root: str | None, job_dataset: str, sites: dict) -> str:
    """The data a run trained on: the source of the job's simulated split when every site used it (the job may
    keep a preset's name, e.g. ``ich_phantom``, for data prepared from ``rsna_ich``); the sites' own data
    (``--site-data`` folders, site configurations: each one's source and export file, ``+``-joined) otherwise;
    the job's dataset name when the sites say nothing."""
    if {s.get("origin") for s in sites.values()} != {"simulated"}:
        own = list(dict.fromkeys(x for x in (source_label(sites[s].get("source")) for s in sorted(sites)) if x))
        return " + ".join(own) if own else job_dataset
    args = _site_executor_args(app_root)
    try:
        if args.get("dataset"):
            prep = resolve_dataset(args["dataset"]).get("prepare") or {}
            if prep.get("sources"):
                return "+".join(str(x.get("source")) for x in prep["sources"])
            return str(prep.get("source") or job_dataset)
    except (ValueError, TypeError, AttributeError):
        pass
    return job_dataset


def _site_executor_args(app_root: str | None) -> dict:
    """The arguments of the job's site executor (``config_fed_client.json`` of the job's app, the one the
    simulator and a deployed job share), or an empty dict where the app has none."""
    if not app_root:
        return {}
    try:
        cfg = json.loads((Path(app_root) / "config" / "config_fed_client.json").read_text())
        for ex in cfg.get("executors", []):
            args = ex.get("executor", {}).get("args") or {}
            if args.get("dataset"):
                return args
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return {}


def job_normalisation(app_root: str | None) -> dict | None:
    """The input normalisation the job's sites trained with (``{"mean", "std"}``: the dataset's, or the one its
    model's start set), as the sites' executor resolves it; None where the job's configuration is not readable."""
    args = _site_executor_args(app_root)
    try:
        ds = resolve_dataset(args["dataset"])
        ds = start_normalisation(ds, args.get("model") or {}, int(ds["channels"]))
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    return {"mean": ds.get("mean"), "std": ds.get("std")}


def _ledger_entry(entry: dict | None) -> dict | None:
    """A site's privacy ledger entry of the round as results.json keeps it (without the declarations)."""
    if not entry:
        return None
    return {k: v for k, v in entry.items() if k != "declared"}


def data_record(sites: dict) -> dict:
    """The federation's data as results.json records it: per site its sizes and annotated class indices, and
    per evaluation split the groups of sites holding the same set (fingerprints are not recorded)."""
    out: dict = {"sites": {}, "shared_eval_sets": {}}
    for site in sorted(sites):
        info = sites[site]
        out["sites"][site] = {
            "n_train": info.get("n_train"),
            "n_val": info.get("n_val"),
            "n_test": info.get("n_test"),
            "annotated": [i for i, a in enumerate(info.get("annotated", [])) if a],
            "origin": info.get("origin"),
            "source": info.get("source"),
        }
    for split in ("val", "test"):
        groups: dict[str, list[str]] = {}
        for site in sorted(sites):
            fp = (sites[site].get("eval_sets") or {}).get(split)
            if fp:
                groups.setdefault(fp, []).append(site)
        out["shared_eval_sets"][split] = [g for g in groups.values() if len(g) > 1]
    return out


def _method_meta_keys(meta: dict) -> list[str]:
    return sorted(k for k in meta if k not in _STANDARD_META and not k.startswith("__"))


STATS_MAX_SIZE = 64


def method_stats(meta: dict) -> dict:
    """The method's small numeric meta as plain JSON values: numbers, and numeric lists / arrays of at most
    ``STATS_MAX_SIZE`` entries (FedLSM's pseudo-label count, pool sizes and ``q_c^k``; FedMLP's learning degrees and
    prototype counts). Prototypes and other large arrays are left out (their keys stay in ``*_meta``).
    A non-finite float (NaN, inf) becomes None (JSON null): ``results.json`` stays strict JSON."""
    out = {}
    for key in _method_meta_keys(meta):
        value = meta[key]
        if isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
            out[key] = _finite_or_none(value.item() if isinstance(value, np.generic) else value)
            continue
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):  # ragged or not numeric
            continue
        if arr.dtype.kind in "biuf" and 0 < arr.size <= STATS_MAX_SIZE:
            out[key] = _finite_or_none(arr.tolist())
    return out


def _finite_or_none(value):
    """``value`` (a number or nested lists of numbers) with every NaN / inf replaced by None."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value
