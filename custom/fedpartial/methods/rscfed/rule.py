"""RSCFed's server rule: random sub-sets of the round's sites, distance-reweighted aggregation (DMA) inside each,
then the plain average of the sub-consensus models (formulas: :mod:`.maths`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ...aggregation import clip_change_norms, weighted_average
from ...options import opt
from ..base import Contribution, RuleOptions, ServerRule
from .maths import (
    META_DISTANCES,
    META_SITE_SHARE,
    META_SITES,
    META_SUBSET_WEIGHTS,
    META_SUBSETS,
    META_UNSAMPLED,
    dma_aggregate,
    sample_subsets,
    subset_size,
)


@dataclass
class RSCFedRuleOptions(RuleOptions):
    """RSCFed's server options (method_args; the released code's defaults)."""

    subsets: int = opt(3, "M, sub-consensus models per round (code: meta_round 3; FedMLP's version 10)")
    subset_size: float = opt(
        0.5,
        "K, sites per sub-set: a fraction (< 1, rounded up) or a count (>= 1) "
        "(code: meta_client_num 5 of 10 clients; FedMLP's version 6 of 8)",
    )
    beta: float = opt(1e4, "DMA scale beta in exp(-beta d_k / n_k) (code: dist_scale 1e4; FedMLP's version 0.01)")
    center: Literal["samples", "uniform"] = opt(
        "samples", "the sub-set average d_k is measured from: n_k weights (code) or uniform (FedMLP's version)"
    )
    distance: Literal["l2", "sum"] = opt(
        "l2", "d_k: L2 norm over all floating-point tensors, or the sum of the per-tensor norms (the code's model_dist)"
    )
    seed: int = opt(0, "seed of the sub-set sampling (with the round number)")

    def __post_init__(self):
        if self.subsets < 1:
            raise ValueError(f"rscfed: subsets must be >= 1, got {self.subsets}")
        if self.subset_size <= 0:
            raise ValueError(f"rscfed: subset_size must be > 0, got {self.subset_size}")
        if self.beta < 0:
            raise ValueError(f"rscfed: beta must be >= 0, got {self.beta}")
        if self.robust != "none":
            raise ValueError(
                "rscfed: robust averaging (median / trimmed_mean) does not combine with the "
                "distance-reweighted aggregation; use robust: none (clip_norm is supported)"
            )


class RSCFedRule(ServerRule):
    """Every round: the contributions (sorted by site name) are sampled into ``subsets`` sub-sets of
    ``subset_size`` sites (seeded by ``seed`` and the round, :func:`~.maths.sample_subsets`); each sub-set gives
    a sub-consensus model by DMA with the site weights ``a_k`` (``site_weighting``: n_k by default, times the
    participation weight); the new global model is their plain mean. ``clip_norm`` applies before; ``norm:
    frozen`` keeps the previous norm layers. The sub-sets, DMA weights, distances and each site's share of the
    new model go to the sites in the round's meta (recorded as ``server_stats``).

    Mapping of the paper's protocol (which samples K clients per sub-round, trains them from the global model,
    and repeats M times, so a client drawn twice trains twice): here every site trains once per round and the
    server samples the M sub-sets from the round's updates, as FedMLP's multi-label RSCFed does. A site drawn
    into two sub-sets contributes the same update to both, and a site drawn into none trained for nothing that
    round (``rscfed_unsampled`` counts them).

    Options: :class:`RSCFedRuleOptions`.
    """

    Options = RSCFedRuleOptions

    def subsets_for(self, n_sites: int, round_num: int) -> np.ndarray:
        """``(M, K)`` site indices of the round (reproducible from ``seed`` and the round)."""
        k = subset_size(n_sites, float(self.opts.subset_size))
        return sample_subsets(n_sites, int(self.opts.subsets), k, int(self.opts.seed), round_num)

    def plain_weights(self, contributions: list[Contribution]) -> None:
        """None: the round's models are the subsets' distance-weighted means, never one plain mean."""
        return None

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        contributions = sorted(contributions, key=lambda c: c.site)
        states = [c.weights for c in contributions]
        if self.opts.clip_norm > 0 and previous is not None:
            states = clip_change_norms(states, previous, self.opts.clip_norm)
        a = self.site_weights(contributions)
        subsets = self.subsets_for(len(contributions), round_num)
        models, weights, distances = [], [], []
        share = np.zeros(len(contributions))
        for members in subsets:
            model, w, d = dma_aggregate(
                [states[i] for i in members], a[members], float(self.opts.beta), self.opts.center, self.opts.distance
            )
            models.append(model)
            weights.append(w)
            distances.append(d)
            share[members] += w / len(subsets)
        out = {key: weighted_average([m[key] for m in models], np.ones(len(models))) for key in models[0]}
        if self.opts.norm == "frozen" and previous is not None:
            out.update({k: np.asarray(previous[k]) for k in groups.get("norm", ()) if k in previous})
        meta = {
            META_SITES: [c.site for c in contributions],
            META_SUBSETS: subsets.astype(np.int64),
            META_SUBSET_WEIGHTS: np.stack(weights),
            META_DISTANCES: np.stack(distances),
            META_SITE_SHARE: share,
            META_UNSAMPLED: len(contributions) - len(np.unique(subsets)),
        }
        return out, meta
