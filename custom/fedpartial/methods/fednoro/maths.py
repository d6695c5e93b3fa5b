"""FedNoRo's mathematics as pure functions (Wu et al., "FedNoRo: Towards Noise-Robust Federated Learning by
Addressing Class Imbalance and Label Noise Heterogeneity", IJCAI 2023; released code wnn2000/FedNoRo).

Shapes: logits / labels / mask ``(B, C)``; a site's per-class loss vector ``(C,)``; the server's loss matrix
``(K, C)`` (K sites); model states are ``{name: array}`` dicts.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...losses import labelled_rows
from ..common import plogp
from ..fedmlp.maths import class_rates

__all__ = [
    "class_prior",
    "la_adjustment",
    "la_loss",
    "kd_loss",
    "kd_loss_code",
    "kd_rampup",
    "class_mean_losses",
    "class_sample_counts",
    "normalise_class_losses",
    "detect_noisy",
    "model_distance",
    "noisy_distances",
    "daagg_weights",
    "META_CLASS_LOSS",
    "META_CLASS_COUNT",
    "META_STAGE",
    "META_NOISY",
    "META_KD_WEIGHT",
    "META_LOSS_LA",
    "META_LOSS_KD",
    "META_NOISY_SITES",
    "META_CLEAN_SITES",
    "META_DETECTED_ROUND",
    "META_N_NOISY",
    "META_SITES",
    "META_AGG_WEIGHTS",
    "META_DISTANCE",
    "META_DETECT_SITES",
    "META_DETECT_NOISY",
    "META_DETECT_SCORE",
    "META_ALL_NOISY",
]

# site -> server
META_CLASS_LOSS = "fednoro_class_loss"  # (C,) mean loss of the received global model per class (NaN: no sample)
META_CLASS_COUNT = "fednoro_class_count"  # (C,) samples behind each entry of META_CLASS_LOSS
META_STAGE = "fednoro_stage"  # 1 (warm-up, LA for everyone) or 2
META_NOISY = "fednoro_noisy"  # 1 when the site trained as a noisy site this round (LA + KD), else 0
META_KD_WEIGHT = "fednoro_kd_weight"  # lambda of the round (0 for clean sites and in stage 1)
META_LOSS_LA = "fednoro_loss_la"  # mean LA term over the round's steps (before the (1 - lambda) factor)
META_LOSS_KD = "fednoro_loss_kd"  # mean KD term (before the lambda factor; 0 when not distilling)
# server -> sites (every round once detected) and the server's counters
META_NOISY_SITES = "fednoro_noisy_sites"  # site names marked noisy
META_CLEAN_SITES = "fednoro_clean_sites"  # site names marked clean
META_DETECTED_ROUND = "fednoro_detected_round"  # the round whose aggregation ran the detection
META_N_NOISY = "fednoro_n_noisy"  # number of sites marked noisy
META_ALL_NOISY = "fednoro_all_noisy"  # 1 under all_noisy (every site noisy, no detection)
META_SITES = "fednoro_sites"  # this round's contributors (order of the two lists below)
META_AGG_WEIGHTS = "fednoro_agg_weights"  # their normalised aggregation weights (DaAgg once detected)
META_DISTANCE = "fednoro_distance"  # their normalised distances d_k / max d (0 for clean sites)
META_DETECT_SITES = "fednoro_detect_sites"  # detection round only: the sites with a loss vector (sorted)
META_DETECT_NOISY = "fednoro_detect_noisy"  # detection round only: 0/1 per site of META_DETECT_SITES
META_DETECT_SCORE = "fednoro_detect_score"  # detection round only: mean normalised per-class loss per site

_EPS = 1e-12


# ------------------------------------------------------------------------------------------ logit adjustment


def class_prior(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Single-label class prior of a site: ``pi_c = n_c / sum_j n_j`` over its labelled rows.

    Args:
        labels: ``(N, C)`` one-hot where annotated; mask: ``(N, C)`` bool, annotated entries.

    Returns:
        ``(C,)`` float64; 0 for a class without a labelled row (all 0 for a site without labelled rows).
    """
    rows = labelled_rows(labels, mask)
    counts = (labels.double() * mask.double())[rows].sum(0)
    total = counts.sum()
    return counts / total if total > 0 else torch.zeros_like(counts)


def la_adjustment(labels: torch.Tensor, mask: torch.Tensor, task: str, tau: float = 1.0) -> torch.Tensor:
    """The logit adjustment ``Delta`` (``(C,)``) added to the logits in the LA loss (Menon et al. 2021).

    - single-label: ``Delta_c = tau * log pi_c`` with :func:`class_prior` (``-inf`` for a class absent from the
      site, which takes it out of the softmax: LA's log 0, as the released code); 0 everywhere at a site without
      labelled rows.
    - multi-label (binary form, FedMLP's Eq. 3): ``Delta_c = tau * (log pi_c - log(1 - pi_c))`` with ``pi_c`` the
      share of positives among the site's annotated entries of class c (clamped to ``[1e-4, 1 - 1e-4]``); 0
      (``pi_c = 0.5``) for a class the site does not annotate, whose rate it cannot know.

    Args:
        labels: ``(N, C)`` 0/1; mask: ``(N, C)`` bool annotated entries; task: 'multilabel' / 'multiclass'.
    """
    if task == "multiclass":
        prior = class_prior(labels, mask)
        if tau == 0 or not bool((prior > 0).any()):
            return torch.zeros_like(prior, dtype=torch.float32)
        return (tau * torch.log(prior)).float()  # log 0 = -inf for the absent classes
    pi1, pi0 = class_rates(labels, mask)
    return (tau * (torch.log(pi1) - torch.log(pi0))).float()


def la_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    adjustment: torch.Tensor,
    task: str,
    missing: str = "negatives",
) -> torch.Tensor:
    """The logit-adjusted loss ``L_LA`` on ``z' = z + Delta``.

    - single-label: ``CE(z + Delta, y)`` averaged over the labelled rows (0 with a gradient when none).
    - multi-label: ``BCE(sigmoid(z + Delta), y)`` averaged over the entries: every entry with unannotated ones as
      negatives (``missing="negatives"``: the noisy-label reading, missing positives are label noise) or only
      the annotated entries (``"partial"``).

    Args:
        logits, labels: ``(B, C)``; mask: ``(B, C)`` bool; adjustment: ``(C,)`` from :func:`la_adjustment`.
    """
    z = logits + adjustment.to(logits.device, logits.dtype)
    if task == "multiclass":
        rows = labelled_rows(labels, mask)
        if not rows.any():
            return logits.sum() * 0.0
        return F.cross_entropy(z[rows], labels[rows].argmax(dim=1))
    m = mask.to(z.dtype)
    target = labels.to(z.dtype) * m
    per = F.binary_cross_entropy_with_logits(z, target, reduction="none")
    if missing == "partial":
        return (per * m).sum() / m.sum().clamp_min(1.0)
    return per.mean()


# ------------------------------------------------------------------------------------------ distillation


def kd_loss(
    logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    adjustment: torch.Tensor,
    task: str,
    temperature: float = 0.8,
    entries: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distillation term of a noisy site: the received global model (teacher, logits softened by ``T``)
    against the logit-adjusted student ``z + Delta`` (as the released code's ``LA_KD``).

    - single-label: ``KL(q || p~)`` per sample, mean over the batch, ``q = softmax(z_T / T)``,
      ``log p~ = log_softmax(z + Delta)``; a class absent from the site (``Delta_c = -inf``) has its ``log p~_c``
      replaced by 0 as the released code, i.e. it contributes the constant ``q_c log q_c`` and no gradient.
    - multi-label (sigmoid per class): the Bernoulli KL ``q log(q / p~) + (1 - q) log((1 - q) / (1 - p~))`` with
      ``q = sigmoid(z_T / T)``, ``p~ = sigmoid(z + Delta)``, averaged over ``entries`` (all entries by default).
      It equals BCE with the soft target ``q`` minus the teacher's binary entropy (a constant): same gradient.

    Args:
        logits, teacher_logits: ``(B, C)`` (the teacher's are a constant); adjustment: ``(C,)``;
        entries: optional ``(B, C)`` bool, the multi-label entries distilled (0 with gradient when none).
    """
    z = logits + adjustment.to(logits.device, logits.dtype)
    zt = teacher_logits.detach().to(logits.dtype) / temperature
    if task == "multiclass":
        q = torch.softmax(zt, dim=1)
        lp = torch.log_softmax(z, dim=1)
        lp = torch.where(torch.isinf(lp), torch.zeros_like(lp), lp)
        return (plogp(q) - q * lp).sum(1).mean()
    q = torch.sigmoid(zt)
    per = plogp(q) + plogp(1 - q) - q * F.logsigmoid(z) - (1 - q) * F.logsigmoid(-z)
    if entries is None:
        return per.mean()
    m = entries.to(per.dtype)
    return (per * m).sum() / m.sum().clamp_min(1.0)


def kd_loss_code(
    logits: torch.Tensor, teacher_logits: torch.Tensor, entries: torch.Tensor, temperature: float = 0.8
) -> torch.Tensor:
    """FedMLP's released multi-label adaptation (``utils/FedNoRo.py::LA_KD``): the mean squared difference
    ``(sigmoid(z) - sigmoid(z_T / T))^2`` over ``entries`` (the site's missing classes), no logit adjustment.

    Args:
        logits, teacher_logits: ``(B, C)``; entries: ``(B, C)`` bool.
    """
    q = torch.sigmoid(teacher_logits.detach().to(logits.dtype) / temperature)
    m = entries.to(logits.dtype)
    return ((torch.sigmoid(logits) - q) ** 2 * m).sum() / m.sum().clamp_min(1.0)


def kd_rampup(round_num: int, begin: int, end: int, weight: float) -> float:
    """``lambda(t) = weight * exp(-5 (1 - (clip(t, begin, end) - begin) / (end - begin))^2)`` (the released code's
    sigmoid ramp-up, Laine & Aila): ``weight * e^-5`` up to ``begin``, ``weight`` from ``end`` on."""
    if end <= begin:
        raise ValueError(f"kd ramp: end ({end}) must be > begin ({begin})")
    t = min(max(float(round_num), float(begin)), float(end))
    phase = 1.0 - (t - begin) / (end - begin)
    return float(weight) * math.exp(-5.0 * phase * phase)


# ------------------------------------------------------------------------------------------ noisy-site detection


def class_mean_losses(
    probs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, task: str, missing: str = "negatives"
) -> torch.Tensor:
    """A site's per-class loss indicator: the mean loss of the received global model on its samples of class c.

    - single-label: ``-log p_{i,c}`` averaged over the labelled rows of class c (plain CE, as the released code).
    - multi-label: the binary cross-entropy of class c averaged over the site's entries of class c (all entries,
      missing as negatives, or the annotated ones with ``missing="partial"``).

    Args:
        probs: ``(N, C)`` probabilities of the received model; labels: ``(N, C)``; mask: ``(N, C)`` bool.

    Returns:
        ``(C,)`` float64, NaN for a class without a sample (the server fills it, :func:`normalise_class_losses`).
    """
    p = probs.double().clamp(_EPS, 1 - _EPS)
    y = labels.double() * mask.double()
    w = _class_entries(labels, mask, task, missing)
    if task == "multiclass":
        per = -torch.log(p)
    else:
        per = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))
    n = w.sum(0)
    out = (per * w).sum(0) / n.clamp_min(1.0)
    return torch.where(n > 0, out, torch.full_like(out, float("nan")))


def _class_entries(labels: torch.Tensor, mask: torch.Tensor, task: str, missing: str) -> torch.Tensor:
    """``(N, C)`` float64 0/1: the entries behind each class's loss indicator (see :func:`class_mean_losses`)."""
    if task == "multiclass":
        return labels.double() * mask.double() * labelled_rows(labels, mask).double()[:, None]
    return mask.double() if missing == "partial" else torch.ones_like(labels, dtype=torch.float64)


def class_sample_counts(
    labels: torch.Tensor, mask: torch.Tensor, task: str, missing: str = "negatives"
) -> torch.Tensor:
    """``(C,)`` int64: how many samples each entry of :func:`class_mean_losses` averages (sent with the vector so
    that a privacy filter can drop the entries computed from too few images)."""
    return _class_entries(labels, mask, task, missing).sum(0).long()


def normalise_class_losses(losses: np.ndarray) -> np.ndarray:
    """The server's normalisation of the ``(K, C)`` loss matrix (released code): a missing entry (NaN: the site
    has no sample of c) takes the column's smallest loss; then each column is min-max scaled to [0, 1]
    (``(l - min_k l) / (max_k l - min_k l)``); a constant column (or one without any value) becomes 0."""
    m = np.asarray(losses, dtype=np.float64).copy()
    for j in range(m.shape[1]):
        col = m[:, j]
        finite = np.isfinite(col)
        if not finite.any():
            m[:, j] = 0.0
            continue
        col[~finite] = col[finite].min()
        lo, hi = col.min(), col.max()
        m[:, j] = (col - lo) / (hi - lo) if hi > lo else 0.0
    return m


def detect_noisy(losses: np.ndarray, seeds: Sequence[int] = (0,)) -> tuple[np.ndarray, np.ndarray]:
    """Noisy-site detection: :func:`normalise_class_losses`, then a 2-component Gaussian mixture
    (``sklearn.mixture.GaussianMixture``) on the K normalised loss vectors; the sites of the component with the
    larger mean (sum over classes of its mean vector) are noisy. With several ``seeds`` (the released code: 9
    random states) the most frequent noisy set wins (first seen on ties).

    Args:
        losses: ``(K, C)`` per-class mean losses (NaN allowed).

    Returns:
        ``(noisy (K,) bool, normalised (K, C))``; with fewer than 2 sites (or all vectors equal) nobody is noisy.
    """
    from sklearn.mixture import GaussianMixture

    x = normalise_class_losses(losses)
    K = x.shape[0]
    if K < 2 or np.allclose(x, x[0]):
        return np.zeros(K, dtype=bool), x
    votes: list[tuple[int, ...]] = []
    for seed in seeds:
        gmm = GaussianMixture(n_components=2, random_state=int(seed)).fit(x)
        pred = gmm.predict(x)
        votes.append(tuple(int(i) for i in np.flatnonzero(pred == int(np.argmax(gmm.means_.sum(1))))))
    best = max(votes, key=votes.count)  # max keeps the first of equally frequent sets
    noisy = np.zeros(K, dtype=bool)
    noisy[list(best)] = True
    return noisy, x


# ------------------------------------------------------------------------------------------ DaAgg


def model_distance(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], kind: str = "l2") -> float:
    """Distance between two model states over their floating-point tensors (integer buffers skipped):
    ``l2`` = the Euclidean norm of the whole difference ``sqrt(sum_t ||a_t - b_t||^2)``; ``tensor_sum`` (the
    released code's ``model_dist``) = ``sum_t ||a_t - b_t||``."""
    parts = []
    for key, va in a.items():
        va = np.asarray(va)
        if va.dtype.kind != "f":
            continue
        parts.append(float(np.linalg.norm((va.astype(np.float64) - np.asarray(b[key], dtype=np.float64)).ravel())))
    if kind == "tensor_sum":
        return float(sum(parts))
    if kind != "l2":
        raise ValueError(f"distance must be 'l2' or 'tensor_sum', got {kind!r}")
    return float(math.sqrt(sum(p * p for p in parts)))


def noisy_distances(states: Sequence[Mapping[str, np.ndarray]], noisy: Sequence[bool], kind: str = "l2") -> np.ndarray:
    """``(K,)`` ``d_k = min_{j clean} dist(theta_k, theta_j)`` for a noisy site k, 0 for a clean one (all 0 when
    there is no clean or no noisy site)."""
    noisy = np.asarray(noisy, dtype=bool)
    d = np.zeros(len(states), dtype=np.float64)
    clean = np.flatnonzero(~noisy)
    if len(clean) == 0:
        return d
    for k in np.flatnonzero(noisy):
        d[k] = min(model_distance(states[k], states[j], kind) for j in clean)
    return d


def daagg_weights(n: Sequence[float], distances: Sequence[float]) -> np.ndarray:
    """Distance-aware aggregation weights (DaAgg):

        w_k = n_k exp(-d_k / max_j d_j) / sum_i n_i exp(-d_i / max_j d_j)

    with ``d_k`` from :func:`noisy_distances` (0 for clean sites, so they keep their ``n_k`` share); all ``d`` 0
    gives FedAvg. Returns ``(K,)`` weights summing to 1."""
    n = np.asarray(n, dtype=np.float64)
    d = np.asarray(distances, dtype=np.float64)
    dmax = d.max() if len(d) else 0.0
    w = n * np.exp(-(d / dmax if dmax > 0 else d))
    return w / w.sum()
