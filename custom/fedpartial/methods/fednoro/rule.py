"""FedNoRo's server rule: FedAvg in the warm-up, the noisy-site detection (GMM on the per-class losses) once the
sites' loss vectors arrive, then distance-aware aggregation (DaAgg); the verdict travels to the sites every round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ...options import opt
from ..base import Contribution, RuleOptions, ServerRule
from .maths import (
    META_AGG_WEIGHTS,
    META_ALL_NOISY,
    META_CLASS_LOSS,
    META_CLEAN_SITES,
    META_DETECT_NOISY,
    META_DETECT_SCORE,
    META_DETECT_SITES,
    META_DETECTED_ROUND,
    META_DISTANCE,
    META_N_NOISY,
    META_NOISY_SITES,
    META_SITES,
    daagg_weights,
    detect_noisy,
    noisy_distances,
)


@dataclass
class FedNoRoRuleOptions(RuleOptions):
    """FedNoRo's server options (method_args)."""

    all_noisy: bool = opt(
        False,
        "every site noisy, no detection; aggregation is FedAvg (DaAgg has no clean site to "
        "measure against; FedMLP's comparison)",
    )
    gmm_votes: int = opt(
        1, "GMM fits with random states 0..gmm_votes-1, the most frequent noisy set wins (released code: 9)"
    )
    distance: Literal["l2", "tensor_sum"] = opt(
        "l2",
        "DaAgg model distance: Euclidean norm of the whole difference, or the released code's sum of per-tensor norms",
    )

    def __post_init__(self):
        if self.gmm_votes < 1:
            raise ValueError(f"gmm_votes must be >= 1, got {self.gmm_votes}")


class FedNoRoRule(ServerRule):
    """Server side of FedNoRo.

    - Until the verdict: FedAvg (``site_weighting``). In the first round where contributions carry
      :data:`~.maths.META_CLASS_LOSS` (the sites send it from round ``warmup_rounds - 1``), the ``(K, C)`` loss
      matrix of those sites goes through :func:`~.maths.detect_noisy`; the noisy / clean site lists are kept in
      the rule's state (a restart keeps them) and sent with every later model.
    - After the verdict, DaAgg: ``w_k = n_k exp(-d_k / max_j d_j) / sum_i n_i exp(-d_i / max_j d_j)`` with
      ``d_k = min over this round's clean contributors j of ||theta_k - theta_j||`` for a noisy k and 0 for a
      clean one (``n_k`` per ``site_weighting``, times the participation weight). A site in neither list (absent
      at the detection) counts as noisy. Without a clean or a noisy contributor the round is FedAvg.
    - ``all_noisy``: FedAvg every round, no detection.

    Options: :class:`FedNoRoRuleOptions`. Counters in the round's meta: ``fednoro_n_noisy``,
    ``fednoro_agg_weights`` / ``fednoro_distance`` (per contributor, in the order of ``fednoro_sites``), and in the
    detection round ``fednoro_detect_noisy`` / ``fednoro_detect_score`` (order of ``fednoro_detect_sites``).
    """

    Options = FedNoRoRuleOptions

    def __init__(self, **options):
        super().__init__(**options)
        self.noisy: list[str] | None = None
        self.clean: list[str] | None = None
        self.detected_round: int | None = None
        self._distances: np.ndarray | None = None

    def site_weights(self, contributions: list[Contribution]) -> np.ndarray:
        """:func:`~.maths.daagg_weights` of the base weights (``n_k`` x participation) and this round's distances
        while aggregating (the base weights otherwise)."""
        w = super().site_weights(contributions)
        return w if self._distances is None else daagg_weights(w, self._distances)

    def detect(self, contributions: list[Contribution], round_num: int) -> dict:
        """Run the detection on the contributions carrying a loss vector; returns the detection counters."""
        with_loss = sorted((c for c in contributions if META_CLASS_LOSS in c.meta), key=lambda c: c.site)
        losses = np.stack([np.asarray(c.meta[META_CLASS_LOSS], dtype=np.float64) for c in with_loss])
        noisy, normalised = detect_noisy(losses, seeds=range(int(self.opts.gmm_votes)))
        names = [c.site for c in with_loss]
        self.noisy = [s for s, f in zip(names, noisy) if f]
        self.clean = [s for s, f in zip(names, noisy) if not f]
        self.detected_round = int(round_num)
        return {
            META_DETECT_SITES: names,
            META_DETECT_NOISY: [int(f) for f in noisy],
            META_DETECT_SCORE: [float(v) for v in normalised.mean(1)],
        }

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        meta: dict = {}
        if self.opts.all_noisy:
            meta[META_ALL_NOISY] = 1
        elif self.clean is None and any(META_CLASS_LOSS in c.meta for c in contributions):
            meta.update(self.detect(contributions, round_num))
        distances = np.zeros(len(contributions))
        if self.clean is not None and not self.opts.all_noisy and meta.get(META_DETECT_SITES) is None:
            # DaAgg from the round after the detection (the detection round's models were trained in stage 1)
            clean = set(self.clean)
            flags = [c.site not in clean for c in contributions]
            distances = noisy_distances([c.weights for c in contributions], flags, self.opts.distance)
        dmax = distances.max() if len(distances) else 0.0
        self._distances = distances
        try:
            w = self.site_weights(contributions)
            weights = self.average(previous, contributions, groups)
        finally:
            self._distances = None
        meta.update(
            {
                META_SITES: [c.site for c in contributions],
                META_AGG_WEIGHTS: (w / w.sum()).tolist(),
                META_DISTANCE: (distances / dmax if dmax > 0 else distances).tolist(),
            }
        )
        if self.clean is not None:
            meta.update(
                {
                    META_NOISY_SITES: list(self.noisy),
                    META_CLEAN_SITES: list(self.clean),
                    META_N_NOISY: len(self.noisy),
                    META_DETECTED_ROUND: self.detected_round,
                }
            )
        return weights, meta

    def state_dict(self) -> dict:
        if self.clean is None:
            return {}
        return {"noisy": list(self.noisy), "clean": list(self.clean), "detected_round": self.detected_round}

    def load_state_dict(self, state: dict) -> None:
        if state.get("clean") is not None:
            self.noisy, self.clean = list(state.get("noisy", [])), list(state["clean"])
            self.detected_round = state.get("detected_round")
