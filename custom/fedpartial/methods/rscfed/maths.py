"""RSCFed's mathematics as pure functions (Liang, Lin, Fu, Zhu, Li, "RSCFed: Random Sampling Consensus Federated
Semi-supervised Learning", CVPR 2022): random sub-sets of the sites, distance-reweighted model aggregation
(DMA) inside each sub-set, the average of the sub-consensus models, and the local mean teacher.

Distance-reweighted aggregation of sub-set ``S_m`` (``n_k`` the site weight, default the training-set size):

    theta_bar_m = sum_{k in S_m} (n_k / N_m) theta_k,   N_m = sum_{k in S_m} n_k     (``center: uniform``: 1/|S_m|)
    d_k         = || theta_k - theta_bar_m ||_2     (every floating-point tensor; ``distance: sum``: sum of the
                                                       per-tensor norms, the released code's model_dist)
    w_k         = (n_k / N_m) exp(-beta d_k / n_k) / sum_{j in S_m} (n_j / N_m) exp(-beta d_j / n_j)
    theta_hat_m = sum_{k in S_m} w_k theta_k
    theta^{t+1} = (1 / M) sum_{m=1..M} theta_hat_m

A site far from its sub-set's average (a deviating model) gets a smaller weight; ``beta`` (the code's
``dist_scale``, 1e4; FedMLP's multi-label version 0.01, which makes every factor ~1) sets how much.
The weights are computed in log space (a softmax of ``log(n_k/N_m) - beta d_k / n_k``): no underflow.
"""

from __future__ import annotations

import math
from typing import Literal, Mapping, Sequence

import numpy as np
import torch

from ...aggregation import weighted_average
from ...losses import masked_mean
from .. import common
from ..common import ema_update  # noqa: F401 - the mean teacher's update (re-exported)

__all__ = [
    "ema_decay",
    "sharpen",
    "consistency_loss",
    "subset_size",
    "sample_subsets",
    "model_distance",
    "dma_weights",
    "dma_aggregate",
    "Kind",
    "META_SUPERVISED",
    "META_CONSISTENCY",
    "META_UNLABELLED",
    "META_CONFIDENT",
    "META_SUBSETS",
    "META_SUBSET_WEIGHTS",
    "META_DISTANCES",
    "META_SITE_SHARE",
    "META_SITES",
    "META_UNSAMPLED",
    "ema_update",
]

Kind = Literal["softmax", "sigmoid"]

# site counters, recorded per round in results.json (site_stats)
META_SUPERVISED = "rscfed_supervised"  # mean supervised loss over the round's steps
META_CONSISTENCY = "rscfed_consistency"  # mean (unweighted) mean-teacher consistency loss
META_UNLABELLED = "rscfed_unlabelled"  # unlabelled rows (single-label) / entries (multi-label) distilled this round
META_CONFIDENT = "rscfed_confident"  # share of those where the teacher is confident (max prob / p or 1-p >= 0.9)
# server -> sites (recorded as server_stats); site indices are into the round's contributing sites sorted by name
META_SITES = "rscfed_sites"  # the round's contributing sites, sorted by name
META_SUBSETS = "rscfed_subsets"  # (M, K) the sampled sub-sets (site indices)
META_SUBSET_WEIGHTS = "rscfed_subset_weights"  # (M, K) the DMA weights w_k inside each sub-set
META_DISTANCES = "rscfed_distances"  # (M, K) d_k of each member to its sub-set's average
META_SITE_SHARE = "rscfed_site_share"  # (n_sites,) each site's share of the new global model, sum_m w_mk / M
META_UNSAMPLED = "rscfed_unsampled"  # sites of the round in no sub-set (their update is not used)

CONFIDENT = 0.9  # the released code's confidence threshold (its count of confident pseudo labels)


# ------------------------------------------------------------------------------------------ site


def ema_decay(step: int, max_decay: float = 0.999) -> float:
    """The mean teacher's decay with this method's default bound (:func:`fedpartial.methods.common.ema_decay`)."""
    return common.ema_decay(step, max_decay)


def sharpen(probs: torch.Tensor, temperature: float, kind: Kind) -> torch.Tensor:
    """Temperature sharpening of the teacher's probabilities ``(B, C)``: softmax rows ``p^(1/T) / sum p^(1/T)``
    (the code's SimPLE ``sharpen``); sigmoid entries ``p^(1/T) / (p^(1/T) + (1-p)^(1/T))``. ``T = 1``: unchanged."""
    if temperature == 1.0:
        return probs
    a = probs.clamp_min(0.0) ** (1.0 / temperature)
    if kind == "softmax":
        return a / a.sum(1, keepdim=True).clamp_min(1e-12)
    b = (1.0 - probs).clamp_min(0.0) ** (1.0 / temperature)
    return a / (a + b).clamp_min(1e-12)


def consistency_loss(
    student_logits: torch.Tensor, teacher_probs: torch.Tensor, unknown: torch.Tensor, kind: Kind
) -> torch.Tensor:
    """Mean-teacher distillation on the unlabelled part (0 with a gradient when there is none).

    - ``softmax``: ``unknown`` ``(B,)`` rows; ``mean_rows sum_c (softmax(s)_c - t_c)^2`` (the code:
      ``sum(softmax_mse_loss) / batch``).
    - ``sigmoid``: ``unknown`` ``(B, C)`` entries; ``mean_entries (sigmoid(s) - t)^2`` (FedMLP's multi-label
      RSCFed: ``MSELoss`` over the missing classes).
    """
    if kind == "softmax":
        diff = (torch.softmax(student_logits, 1) - teacher_probs) ** 2
        return masked_mean(diff.sum(1), unknown.bool())
    diff = (torch.sigmoid(student_logits) - teacher_probs) ** 2
    return masked_mean(diff, unknown.bool())


# ------------------------------------------------------------------------------------------ server


def subset_size(n_sites: int, size: float) -> int:
    """Sites per sub-set: a fraction ``size < 1`` of the round's sites (``ceil``, at least 1) or a count
    ``size >= 1`` (at most ``n_sites``)."""
    if size <= 0:
        raise ValueError(f"subset_size must be > 0, got {size}")
    k = math.ceil(size * n_sites - 1e-9) if size < 1 else int(size)
    return max(1, min(k, n_sites))


def sample_subsets(n_sites: int, m: int, k: int, seed: int, round_num: int) -> np.ndarray:
    """``(M, K)`` int: M sub-sets of K distinct site indices (each sorted), drawn without replacement inside a
    sub-set and independently across sub-sets (a site may be in several or in none), by a generator seeded
    with ``(seed, round_num)``: the same seed and round give the same sub-sets (also after a restart)."""
    if not 1 <= k <= n_sites:
        raise ValueError(f"cannot draw {k} of {n_sites} sites")
    rng = np.random.default_rng([int(seed), int(round_num)])
    return np.stack([np.sort(rng.choice(n_sites, size=k, replace=False)) for _ in range(int(m))])


def _floating(state: Mapping[str, np.ndarray]) -> list[str]:
    return [key for key, v in state.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


def model_distance(
    state: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], how: Literal["l2", "sum"] = "l2"
) -> float:
    """``||theta - ref||_2`` over every floating-point tensor (``l2``), or the sum of the per-tensor L2 norms
    (``sum``, the released code's ``model_dist``); integer buffers are left out."""
    norms = [
        np.linalg.norm(np.asarray(state[key], np.float64) - np.asarray(reference[key], np.float64))
        for key in _floating(reference)
    ]
    if how == "sum":
        return float(np.sum(norms))
    return float(np.sqrt(np.sum(np.square(norms))))


def dma_weights(n: Sequence[float], distances: Sequence[float], beta: float) -> np.ndarray:
    """``(K,)`` DMA weights ``w_k ∝ (n_k / N) exp(-beta d_k / n_k)`` normalised to sum 1 (module docstring)."""
    n = np.asarray(n, np.float64)
    d = np.asarray(distances, np.float64)
    if np.any(n <= 0):
        raise ValueError(f"DMA needs positive site weights, got {n.tolist()}")
    logits = np.log(n / n.sum()) - float(beta) * d / n
    w = np.exp(logits - logits.max())
    return w / w.sum()


def dma_aggregate(
    states: Sequence[Mapping[str, np.ndarray]],
    n: Sequence[float],
    beta: float,
    center: Literal["samples", "uniform"] = "samples",
    distance: Literal["l2", "sum"] = "l2",
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """One sub-consensus model: ``(theta_hat, w (K,), d (K,))`` of K site states with site weights ``n``."""
    center_w = np.asarray(n, np.float64) if center == "samples" else np.ones(len(states))
    bar = {key: weighted_average([s[key] for s in states], center_w) for key in states[0]}
    d = np.array([model_distance(s, bar, distance) for s in states])
    w = dma_weights(n, d, beta)
    return {key: weighted_average([s[key] for s in states], w) for key in states[0]}, w, d
