"""The server side of every method as one NVFlare ``Aggregator``: collect the sites' updates, refuse broken
ones, and hand the rest to the method's :class:`~fedpartial.methods.ServerRule`.

An update is refused (and the round goes on without it) when it is from another round, is not full weights,
or has missing / extra tensors, wrong shapes or non-finite values. An update with participation weight 0 is
accepted but not averaged (the site sat the round out). When nothing usable arrives, or the rule raises, the
previous global model and the previous method metadata are kept, the round and the error are logged and
recorded in ``results.json``, and the job goes on; after ``max_rule_failures`` consecutive rule failures the job
stops cleanly (its last good model kept). The rule's returned meta (prototypes, learning degrees, ...) travels to
the sites with the next round's model.
"""

from __future__ import annotations

import traceback

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from ..aggregation import check_update
from ..methods import Contribution, ServerRule, get_method
from .keys import META_GROUPS, META_N_TRAIN, META_RULE_ERROR, META_SKIPPED, META_WEIGHT


def to_builtin(value):
    """numpy arrays / scalars inside the rule's meta -> lists / python numbers: the persistor stores the meta
    inside the model file, which NVFlare reloads with ``torch.load(weights_only=True)`` (no numpy allowed)."""
    if isinstance(value, dict):
        return {k: to_builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_builtin(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


class PartialLabelAggregator(Aggregator):
    """Args:
        method: the registered method whose server rule aggregates (e.g. ``fedavg_masked``).
        method_args: the method's options (the rule takes its own; every key must belong to the method).
        summary_id: id of the :class:`~fedpartial.fl.data_check.DataSummaryProcessor` component (optional).
        max_rule_failures: consecutive rounds in which the rule may raise before the job is stopped.
    """

    def __init__(self, method: str = "fedavg", method_args: dict | None = None, summary_id: str = "data_summary",
                 max_rule_failures: int = 3):
        super().__init__()
        self.method, self.method_args, self.summary_id = method, method_args or {}, summary_id
        self.max_rule_failures = int(max_rule_failures)
        self.config_error: str | None = None
        try:
            self.rule: ServerRule | None = get_method(method).make_rule(self.method_args, "server aggregator")
        except ValueError as e:  # reported with the job's name when the job starts (no context here)
            self.rule, self.config_error = None, str(e)
        self._contributions: list[Contribution] = []
        self.rejected: list[tuple[str, str]] = []
        self._last_meta: dict = {}
        self._failures = 0

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            self._last_meta, self._failures = {}, 0
            if self.config_error:
                job = (fl_ctx.get_prop(FLContextKey.JOB_META) or {}).get("name") or fl_ctx.get_job_id()
                self.system_panic(f"job '{job}': {self.config_error}", fl_ctx)

    def reset(self, fl_ctx: FLContext):
        self._contributions, self.rejected = [], []

    def _previous(self, fl_ctx: FLContext) -> dict[str, np.ndarray] | None:
        model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        if model is None:
            return None
        return {k: np.asarray(v) for k, v in model[ModelLearnableKey.WEIGHTS].items()}

    def _reject(self, fl_ctx: FLContext, site: str, why: str) -> bool:
        self.rejected.append((site, why))
        self.log_error(fl_ctx, f"update from site '{site}' REJECTED: {why}; the global model is not touched by it")
        return False

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = fl_ctx.get_peer_context().get_identity_name() if fl_ctx.get_peer_context() else "?"
        try:
            dxo = from_shareable(shareable)
        except Exception as e:  # noqa: BLE001
            return self._reject(fl_ctx, site, f"not a DXO ({e})")
        rnd = shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND)
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if rnd is not None and current is not None and rnd != current:
            return self._reject(fl_ctx, site, f"contribution for round {rnd} arrived in round {current}")
        if dxo.data_kind != DataKind.WEIGHTS:
            return self._reject(fl_ctx, site, f"data kind {dxo.data_kind}, expected {DataKind.WEIGHTS}")
        if any(c.site == site for c in self._contributions):
            return self._reject(fl_ctx, site, "second contribution in the same round")
        weights = {k: np.asarray(v) for k, v in (dxo.data or {}).items()}
        previous = self._previous(fl_ctx)
        why = check_update(weights, previous) if previous is not None else None
        if why:
            return self._reject(fl_ctx, site, why)
        meta = dict(dxo.meta or {})
        try:
            n, w = float(meta.get(META_N_TRAIN, 1.0)), float(meta.get(META_WEIGHT, 1.0))
        except (TypeError, ValueError):
            return self._reject(fl_ctx, site, f"sample count {meta.get(META_N_TRAIN)!r} or participation weight "
                                              f"{meta.get(META_WEIGHT)!r} is not a number")
        if not np.isfinite(n) or n <= 0:
            return self._reject(fl_ctx, site, f"invalid sample count {n}")
        if not np.isfinite(w) or w < 0:
            return self._reject(fl_ctx, site, f"invalid participation weight {w}")
        self._contributions.append(Contribution(site=site, weights=weights, n=n, meta=meta, weight=w))
        return True

    def _keep_previous(self, previous, extra: dict | None = None) -> Shareable:
        """The previous global model with the previous method metadata (sites keep e.g. their prototypes)."""
        return DXO(data_kind=DataKind.WEIGHTS, data=previous or {}, meta={**self._last_meta, **(extra or {})}).to_shareable()

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        previous = self._previous(fl_ctx)
        rnd = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0)
        received = sorted(self._contributions, key=lambda c: c.site)
        self._contributions = []
        contributions = [c for c in received if c.weight > 0]
        sat_out = {META_SKIPPED: [c.site for c in received if c.weight <= 0]}
        if sat_out[META_SKIPPED]:
            self.log_info(fl_ctx, f"round {rnd}: site(s) {sat_out[META_SKIPPED]} sat this round out (weight 0)")
        if not contributions:
            self.log_error(fl_ctx, f"round {rnd}: no usable update; keeping the previous global model")
            return self._keep_previous(previous, sat_out)
        groups = contributions[0].meta.get(META_GROUPS) or {}
        summary_comp = fl_ctx.get_engine().get_component(self.summary_id) if self.summary_id else None
        summary = getattr(summary_comp, "summary", None)
        try:
            weights, meta = self.rule.aggregate(previous, contributions, groups, rnd, summary)
            meta = to_builtin(meta)
            bad = check_update(weights, previous) if previous is not None else None
            if bad:  # a rule must never produce a broken model
                raise ValueError(f"the aggregated model is unusable ({bad})")
        except Exception as e:  # noqa: BLE001 - the federation outlives a failing rule
            self._failures += 1
            msg = f"rule {type(self.rule).__name__} failed in round {rnd}: {type(e).__name__}: {e}"
            self.log_error(fl_ctx, f"{msg}; keeping the previous global model "
                                   f"({self._failures} consecutive failure(s))\n{traceback.format_exc()}")
            if self._failures >= self.max_rule_failures:
                self.system_panic(f"stopping: the server rule failed {self._failures} rounds in a row ({msg}); "
                                  "the last good global model is kept", fl_ctx)
            return self._keep_previous(previous, {META_RULE_ERROR: msg, **sat_out})
        self._failures = 0
        self._last_meta = meta
        self.log_info(fl_ctx, f"round {rnd}: aggregated {len(contributions)} site(s) "
                              f"{[c.site for c in contributions]} with rule {type(self.rule).__name__}")
        return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta={**meta, **sat_out}).to_shareable()
