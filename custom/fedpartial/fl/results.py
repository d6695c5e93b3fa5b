"""Server-side results: per-round validation / test metrics of the global model, the best round on
validation, the final cross-site evaluation of the last and best global models, written to
``<server run dir>/results.json`` and printed as per-class tables at the end of the run.

Each site evaluates the model it receives on its own validation / test data; the server averages the sites'
numbers weighted by their evaluation-set sizes (in simulation every site holds the same central sets, so the
average is that set's score).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from nvflare.apis.dxo import MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.widgets.widget import Widget

from ..metrics import format_table
from .keys import META_RESULTS

RESULTS_FILE = "results.json"


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

    out = {k: v for k, v in first.items() if k not in ("macro", "per_class", "n")}
    out["n"] = sum(r.get("n", 0) for r, _ in results)
    out["macro"] = {m: avg(lambda r, m=m: r["macro"].get(m)) for m in first.get("macro", {})}
    out["per_class"] = {c: {m: avg(lambda r, c=c, m=m: r["per_class"][c].get(m)) for m in first["per_class"][c]}
                        for c in first.get("per_class", {})}
    out["n_sites"] = len(results)
    return out


class ResultsRecorder(Widget):
    """Args:
        key_metric: validation metric used to name the best round (same as IntimeModelSelector's).
        method, dataset: recorded in the results file.
    """

    def __init__(self, key_metric: str = "auc", method: str = "", dataset: str = ""):
        super().__init__()
        self.key_metric, self.method, self.dataset = key_metric, method, dataset
        self._reset()

    def _reset(self):
        self.rounds: dict[int, dict] = {}
        self.final: dict[str, dict] = {}
        self._round_start: dict[int, float] = {}
        self._t0 = time.time()

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            self._reset()
        elif event_type == AppEventType.ROUND_STARTED:
            self._round_start[int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND))] = time.time()
        elif event_type == AppEventType.BEFORE_CONTRIBUTION_ACCEPT:
            self._record_contribution(fl_ctx)
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
            "results": meta.get(META_RESULTS, {}), "train_loss": meta.get("train_loss"),
            "steps": meta.get(MetaKey.NUM_STEPS_CURRENT_ROUND), "train_seconds": meta.get("train_seconds"),
            "eval_seconds": meta.get("eval_seconds"),
        }

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
            res = {s: v["results"] for s, v in e["sites"].items()}
            rounds.append({
                "round": rnd, "trained_rounds": rnd,  # the received model has been aggregated `rnd` times
                "val": self._site_average(res, "val"), "test": self._site_average(res, "test"),
                "train_loss": {s: v["train_loss"] for s, v in e["sites"].items()},
                "sites": sorted(e["sites"]), "seconds": e.get("seconds"),
            })
        best = None
        for r in rounds:
            v = ((r["val"] or {}).get("macro") or {}).get(self.key_metric)
            if r["round"] > 0 and v is not None and (best is None or v > best["val_" + self.key_metric]):
                best = {"trained_rounds": r["trained_rounds"], "val_" + self.key_metric: v}
        final = {}
        for owner, per_site in self.final.items():
            name = owner.replace("SRV_", "")
            final[name] = {"test": self._site_average(per_site, "test"), "val": self._site_average(per_site, "val"),
                           "sites": sorted(per_site)}
        secs = [r["seconds"] for r in rounds if r.get("seconds")]
        return {"method": self.method, "dataset": self.dataset, "key_metric": self.key_metric,
                "num_rounds": len(rounds), "seconds_per_round": (sum(secs) / len(secs)) if secs else None,
                "wall_seconds": time.time() - self._t0, "best": best, "final": final, "rounds": rounds}

    def _write(self, fl_ctx: FLContext):
        out = self.summary()
        workspace = fl_ctx.get_engine().get_workspace()
        path = Path(workspace.get_run_dir(fl_ctx.get_job_id())) / RESULTS_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(out, indent=1, default=float))
        os.replace(tmp, path)
        for name, res in out["final"].items():
            for split in ("test", "val"):
                if res.get(split):
                    self.log_info(fl_ctx, "\n" + format_table(res[split], title=f"{self.method} / {self.dataset}: "
                                                                                f"{name} on {split} (site average)"))
        self.log_info(fl_ctx, f"results written to {path}")
