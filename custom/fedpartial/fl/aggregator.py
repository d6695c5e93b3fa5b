"""The server side of every method as one NVFlare ``Aggregator``: collect the sites' updates, refuse broken
ones, and hand the rest to the method's :class:`~fedpartial.methods.ServerRule`.

An update is refused (and the round goes on without it) when it is from another round, is not full weights,
or has missing / extra tensors, wrong shapes or non-finite values. When nothing usable arrives, the previous
global model is kept. The rule's returned meta (prototypes, learning degrees, ...) travels to the sites with
the next round's model.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from ..aggregation import check_update
from ..methods import Contribution, get_method
from .keys import META_CLASSIFIER_KEYS, META_N_TRAIN


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
        method_args: options of the rule (e.g. ``{"row_weighting": "uniform"}``).
        summary_id: id of the :class:`~fedpartial.fl.data_check.DataSummaryProcessor` component (optional).
    """

    def __init__(self, method: str = "fedavg", method_args: dict | None = None, summary_id: str = "data_summary"):
        super().__init__()
        self.method, self.method_args, self.summary_id = method, method_args or {}, summary_id
        _, rule_cls, _ = get_method(method)
        self.rule = rule_cls(**self.method_args)
        self._contributions: list[Contribution] = []
        self.rejected: list[tuple[str, str]] = []

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
        n = float(meta.get(META_N_TRAIN, 1.0))
        if not np.isfinite(n) or n <= 0:
            return self._reject(fl_ctx, site, f"invalid sample count {n}")
        self._contributions.append(Contribution(site=site, weights=weights, n=n, meta=meta))
        return True

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        previous = self._previous(fl_ctx)
        rnd = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0)
        contributions = sorted(self._contributions, key=lambda c: c.site)
        self._contributions = []
        if not contributions:
            self.log_error(fl_ctx, f"round {rnd}: no usable update; keeping the previous global model")
            return DXO(data_kind=DataKind.WEIGHTS, data=previous or {}, meta={}).to_shareable()
        keys = list(contributions[0].meta.get(META_CLASSIFIER_KEYS, []))
        summary_comp = fl_ctx.get_engine().get_component(self.summary_id) if self.summary_id else None
        summary = getattr(summary_comp, "summary", None)
        weights, meta = self.rule.aggregate(previous, contributions, keys, rnd, summary)
        meta = to_builtin(meta)
        bad = check_update(weights, previous) if previous is not None else None
        if bad:  # a rule must never produce a broken model; keep the previous one if it does
            self.log_error(fl_ctx, f"round {rnd}: aggregated model unusable ({bad}); keeping the previous model")
            return DXO(data_kind=DataKind.WEIGHTS, data=previous, meta={}).to_shareable()
        self.log_info(fl_ctx, f"round {rnd}: aggregated {len(contributions)} site(s) "
                              f"{[c.site for c in contributions]} with rule {type(self.rule).__name__}")
        return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
