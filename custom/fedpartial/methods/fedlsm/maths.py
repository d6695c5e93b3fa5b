"""FedLSM's mathematics as pure functions on tensors (equation numbers of Deng, Luo, Chen, MICCAI 2023)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...losses import labelled_rows
from ..common import binary_entropy, ema_update, plogp, softmax_entropy  # noqa: F401 - Eq. 3 and the teacher

__all__ = [
    "multilabel_entropy",
    "pool_sizes",
    "split_pools",
    "multiclass_targets",
    "multilabel_targets",
    "pseudo_ce",
    "negative_positive_ratio",
    "weighted_bce",
    "mixup",
    "soft_ce",
    "awpa_weights",
    "META_Q",
    "META_POOLS",
    "META_PSEUDO",
    "META_UDE_PAIRS",
    "AWPA_MODES",
    "ENTROPIES",
    "WEIGHTINGS",
    "Q_COUNTS",
    "softmax_entropy",
    "ema_update",
]

# site -> server
META_Q = "fedlsm_q"  # (C,) float: estimated class counts q_c^k (labelled + pseudo positives)
META_POOLS = "fedlsm_pools"  # [confident, medium, uncertain] pool sizes this round
META_PSEUDO = "fedlsm_pseudo"  # pseudo labels used in training this round (entries / rows)
META_UDE_PAIRS = "fedlsm_ude_pairs"  # mixed samples (pairs with a label on both sides) used this round

AWPA_MODES = ("adaptive", "masked", "fedavg")
ENTROPIES = ("binary", "plogp")
WEIGHTINGS = ("positive", "entry", "none")
Q_COUNTS = ("dataset", "seen")


# ------------------------------------------------------------------------------------------ uncertainty


def multilabel_entropy(probs: torch.Tensor, unknown: torch.Tensor, kind: str = "binary") -> torch.Tensor:
    """Multi-label uncertainty over the locally unknown classes U_k, normalised to [0, 1].

    ``kind="binary"`` (the paper: "similar to single-label ... only consider U_k and normalize to [0, 1]"):
    ``H_i = mean_{c in U_k} h(p_ic) / ln 2`` with the binary entropy ``h(p) = -p ln p - (1-p) ln(1-p)``.
    ``kind="plogp"`` (released code): ``sum_{c in U_k} -p_ic ln p_ic``, divided by its maximum ``|U_k| / e`` (the
    ranking is the code's).

    Args:
        probs: ``(N, C)`` sigmoid outputs; unknown: ``(C,)`` bool, U_k.

    Returns:
        ``(N,)`` in [0, 1]; zeros when U_k is empty.
    """
    if kind not in ENTROPIES:
        raise ValueError(f"entropy must be one of {ENTROPIES}, got {kind!r}")
    u = torch.as_tensor(unknown, dtype=torch.bool)
    if not bool(u.any()):
        return torch.zeros(probs.shape[0], dtype=probs.dtype)
    p = probs[:, u].double()
    if kind == "binary":
        return (binary_entropy(p) / math.log(2.0)).mean(1).to(probs.dtype)
    return (-plogp(p).sum(1) / (p.shape[1] / math.e)).to(probs.dtype)


def pool_sizes(n: int, n_uncertain: float, n_confident: float) -> tuple[int, int]:
    """Pool sizes from counts or fractions: a value in [0, 1) is a fraction of ``n`` (rounded), a value >= 1 a
    count. The uncertain pool is served first; the confident pool gets at most what is left.

    Returns:
        ``(n_h, n_l)`` with ``n_h + n_l <= n``.
    """

    def size(v: float) -> int:
        v = float(v)
        if v < 0:
            raise ValueError(f"pool sizes must be >= 0, got {v}")
        return int(round(v * n)) if v < 1 else int(v)

    n_h = min(size(n_uncertain), n)
    return n_h, min(size(n_confident), n - n_h)


def split_pools(
    scores: torch.Tensor, n_uncertain: int, n_confident: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split sample indices by uncertainty (Sec. 2.3, UE).

    Args:
        scores: ``(N,)`` uncertainty (entropy); ties keep the lower index first in the ascending order.
        n_uncertain, n_confident: pool sizes (``n_uncertain + n_confident <= N``).

    Returns:
        ``(confident, medium, uncertain)`` index tensors: the ``n_confident`` lowest scores, the rest, and the
        ``n_uncertain`` highest scores (each in ascending score order).
    """
    n = scores.shape[0]
    if n_uncertain + n_confident > n:
        raise ValueError(f"pools of {n_uncertain} + {n_confident} samples exceed the {n} samples")
    order = torch.sort(scores, stable=True).indices
    return order[:n_confident], order[n_confident : n - n_uncertain], order[n - n_uncertain :]


# ------------------------------------------------------------------------------------------ pseudo labels


def multiclass_targets(
    labels: torch.Tensor,
    mask: torch.Tensor,
    teacher_probs: torch.Tensor,
    tau: float,
    unknown: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-label targets: the label where the row is labelled, else the teacher's pseudo label (Eq. 4).

    Args:
        labels, mask: ``(B, C)`` one-hot labels and annotation mask (a row is labelled when it has a 1 among
            its annotated entries); teacher_probs: ``(B, C)`` softmax of the teacher on the weak view.
        tau: confidence threshold (``max_c q_c >= tau``).
        unknown: ``(C,)`` bool U_k: pseudo labels only for classes in U_k (the paper's ``sum_{c in U_k}``);
            None = any class (released code).

    Returns:
        ``(targets (B, C) one-hot or zero rows, labelled (B,) bool, pseudo (B,) bool)``.
    """
    lab = labelled_rows(labels, mask)
    conf, cls = teacher_probs.max(dim=1)
    pseudo = ~lab & (conf >= tau)
    if unknown is not None:
        pseudo &= torch.as_tensor(unknown, dtype=torch.bool, device=cls.device)[cls]
    targets = torch.zeros_like(teacher_probs)
    targets[lab] = (labels * mask.to(labels.dtype))[lab]
    targets[pseudo, cls[pseudo]] = 1.0
    return targets, lab, pseudo


def multilabel_targets(
    labels: torch.Tensor, mask: torch.Tensor, teacher_probs: torch.Tensor, tau_p: float, tau_n: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-label targets (Eq. 5): annotated entries keep their label; an unannotated entry becomes 1 when the
    teacher's probability is ``>= tau_p``, 0 when ``<= tau_n``, and stays unlabelled otherwise.

    Args:
        labels, mask: ``(B, C)``; teacher_probs: ``(B, C)`` sigmoid outputs of the teacher on the weak view.

    Returns:
        ``(targets (B, C), known (B, C) bool = annotated or pseudo-labelled, pseudo (B, C) bool)``.
    """
    m = mask.bool()
    pos = ~m & (teacher_probs >= tau_p)
    neg = ~m & (teacher_probs <= tau_n)
    targets = torch.where(m, labels.to(teacher_probs.dtype), pos.to(teacher_probs.dtype))
    return targets, m | pos | neg, pos | neg


def pseudo_ce(logits: torch.Tensor, targets: torch.Tensor, pseudo: torch.Tensor, n_unlabelled: int) -> torch.Tensor:
    """Eq. 4: ``L_U = -(1/N_U) sum_{i pseudo} log softmax(z_i)[y^_i]``; 0 (with gradient) when N_U = 0.

    Args:
        logits: ``(B, C)`` student logits (strong view); targets: ``(B, C)`` one-hot; pseudo: ``(B,)`` bool rows
        with a pseudo label; n_unlabelled: N_U, the unlabelled rows of the batch.
    """
    if n_unlabelled <= 0 or not bool(pseudo.any()):
        return logits.sum() * 0.0
    logp = torch.log_softmax(logits[pseudo], dim=1)
    return -(targets[pseudo] * logp).sum() / n_unlabelled


def negative_positive_ratio(positives: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """FPSL's class weights: ``w_c = negatives_c / positives_c`` over every site's labels; 1 where a class has
    no positive or no negative (no information to weight with).

    Args:
        positives, negatives: ``(C,)`` counts.
    """
    pos, neg = torch.as_tensor(positives, dtype=torch.float64), torch.as_tensor(negatives, dtype=torch.float64)
    ok = (pos > 0) & (neg > 0)
    return torch.where(ok, neg / pos.clamp_min(1.0), torch.ones_like(pos)).float()


def weighted_bce(
    logits: torch.Tensor,
    targets: torch.Tensor,
    known: torch.Tensor,
    class_weights: torch.Tensor | None = None,
    weighting: str = "positive",
) -> torch.Tensor:
    """Eq. 5's form: ``(1/B) sum_i sum_{c known} w-BCE(z_ic, y_ic)`` (soft targets allowed, for UDE).

    ``weighting="positive"``: ``-(w_c y log s + (1 - y) log(1 - s))`` (torch's ``pos_weight``: positives of class c
    weigh as much as its negatives); ``"entry"``: ``-w_c (y log s + (1 - y) log(1 - s))`` (released code);
    ``"none"`` or ``class_weights=None``: unweighted.

    Args:
        logits, targets: ``(B, C)``; known: ``(B, C)`` bool; class_weights: ``(C,)``.

    Returns:
        scalar; 0 (with gradient) for an empty batch.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"class_weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    w = None if class_weights is None or weighting == "none" else class_weights.to(logits)
    per = F.binary_cross_entropy_with_logits(
        logits, targets.to(logits.dtype), reduction="none", pos_weight=w if weighting == "positive" else None
    )
    if w is not None and weighting == "entry":
        per = per * w
    return (per * known.to(per.dtype)).sum() / logits.shape[0]


# ------------------------------------------------------------------------------------------ mixup


def mixup(
    x_l: torch.Tensor, y_l: torch.Tensor, x_h: torch.Tensor, y_h: torch.Tensor, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6: ``x~ = lam x_l + (1 - lam) x_h``, ``y~ = lam y_l + (1 - lam) y_h`` (l = confident, h = uncertain).

    Args:
        x_l, x_h: ``(B, ...)`` images; y_l, y_h: ``(B, C)`` (pseudo) labels; lam: in [0, 1].
    """
    return lam * x_l + (1 - lam) * x_h, lam * y_l + (1 - lam) * y_h


def soft_ce(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """UDE loss for single-label: ``-(1/|rows|) sum_{i in rows} sum_c y~_ic log softmax(z_i)_c``; 0 if no row."""
    if not bool(rows.any()):
        return logits.sum() * 0.0
    return -(targets[rows] * torch.log_softmax(logits[rows], dim=1)).sum(1).mean()


# ------------------------------------------------------------------------------------------ AWPA


def awpa_weights(q: np.ndarray, n: Sequence[float]) -> np.ndarray:
    """AWPA (Eq. 7) weights of each site for each class row: ``q_c^k / sum_j q_c^j``; a class no site reports
    (``sum_j q_c^j = 0``) falls back to ``n_k / sum_j n_j``.

    Args:
        q: ``(K, C)`` non-negative estimated class counts; n: ``(K,)`` sample counts.

    Returns:
        ``(K, C)``, every column sums to 1.
    """
    q = np.asarray(q, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    if q.ndim != 2 or q.shape[0] != len(n):
        raise ValueError(f"q must be (K, C) with K = {len(n)} sites, got {q.shape}")
    if not np.all(np.isfinite(q)) or np.any(q < 0):
        raise ValueError("class counts q must be finite and non-negative")
    total = q.sum(axis=0)
    by_n = np.repeat((n / n.sum())[:, None], q.shape[1], axis=1)
    return np.where(total > 0, q / np.where(total > 0, total, 1.0), by_n)
