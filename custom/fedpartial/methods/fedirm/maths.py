"""FedIRM's mathematics as pure functions on tensors (equation numbers of Liu, Yang, Dou, Heng, "Federated
Semi-supervised Medical Image Classification via Inter-client Relation Matching", MICCAI 2021).

Two kinds of relation rows:

- ``"softmax"`` (single-label, the paper): row c of the disease relation matrix is a distribution over the
  C classes, ``s_c = softmax(v_c / tau)`` (Eq. 3), compared with the KL divergence (Eq. 6).
- ``"sigmoid"`` (the multi-label generalisation, e.g. ICH / CXR14): row c holds, for every class j, the
  probability ``sigmoid(v_cj / tau)`` that class j fires on the samples positive for c; rows are compared with
  the sum over j of Bernoulli KL divergences.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...losses import masked_mean, row_ce
from .. import common
from ..common import ema_update, predictive_entropy  # noqa: F401 - the mean teacher's update (re-exported)

__all__ = [
    "Kind",
    "LN2",
    "relation_matrix",
    "average_relations",
    "server_relation",
    "symmetric_kl",
    "uncertainty_filter",
    "consistency_loss",
    "ema_decay",
    "rampup",
    "supervised_loss",
    "self_training_targets",
    "uniform_rows",
    "META_RELATION",
    "META_RELATION_VALID",
    "META_GLOBAL_RELATION",
    "META_GLOBAL_VALID",
    "META_SELECTED",
    "META_IRM",
    "META_CONSISTENCY",
    "META_DISTANCE",
    "META_RAMP",
    "META_PSEUDO",
    "META_RECEIVED",
    "META_DECAY",
    "ema_update",
]

Kind = Literal["softmax", "sigmoid"]
LN2 = math.log(2.0)
_EPS = 1e-8

# site -> server (labelled sites)
META_RELATION = "fedirm_relation"  # (C, C) the site's relation matrix of the round
META_RELATION_VALID = "fedirm_relation_valid"  # (C,) 0/1: classes the site saw this round
# server -> sites
META_GLOBAL_RELATION = "fedirm_global_relation"  # (C, C) the average of the labelled sites' matrices
META_GLOBAL_VALID = "fedirm_global_valid"  # (C,) 0/1: rows some labelled site has estimated
# site counters (unlabelled sites), recorded per round in results.json
META_SELECTED = "fedirm_selected"  # samples (entries, multi-label) passing the uncertainty filter this round
META_IRM = "fedirm_irm"  # mean relation-matching loss L_IRM over the round's steps (unweighted)
META_CONSISTENCY = "fedirm_consistency"  # mean consistency loss L_c (unweighted)
META_DISTANCE = "fedirm_distance"  # symmetric KL (Eq. 6) between the global and the round's local matrix
META_RAMP = "fedirm_ramp"  # the round's loss weight loss_weight * lambda(omega)
META_PSEUDO = "fedirm_pseudo"  # Fed-SelfTraining: pseudo labels (rows / entries) used this round
META_RECEIVED = "fedirm_received_relation"  # 1 when the site had a global matrix this round
META_DECAY = "fedirm_decay_dominated"  # the round's first step: share of entries the weight decay outweighs


def uniform_rows(num_classes: int, kind: Kind, dtype=torch.float32, device=None) -> torch.Tensor:
    """``(C, C)`` the rows of a class with no sample: ``softmax(0) = 1/C`` or ``sigmoid(0) = 1/2``."""
    value = 1.0 / num_classes if kind == "softmax" else 0.5
    return torch.full((num_classes, num_classes), value, dtype=dtype, device=device)


@common.full_precision()  # float32 under train.amp: both sites' matrices from float32 outputs
def relation_matrix(
    outputs: torch.Tensor, targets: torch.Tensor, tau: float = 2.0, kind: Kind = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The disease relation matrix of one batch (Eq. 2-3 at labelled sites, Eq. 5 at unlabelled ones).

    ``v_c = sum_i t_ic o_i / sum_i t_ic`` (the mean output of the samples of class c), row c =
    ``softmax(v_c / tau)`` (``kind="softmax"``) or ``sigmoid(v_c / tau)`` elementwise (``"sigmoid"``). A class
    without any sample gets the row of ``v_c = 0`` (uniform 1/C, or 1/2), as the released code, and count 0.
    Differentiable with respect to ``outputs``.

    Args:
        outputs: ``(B, C)`` pre-softmax outputs (logits), or probabilities for the literal reading of Eq. 5.
        targets: ``(B, C)`` float 0/1: one-hot labels / pseudo labels (single-label; a zero row = not used) or
            multi-hot positives (multi-label).
        tau: the temperature (> 0; the paper's 2).

    Returns:
        ``(M (C, C), counts (C,))``: the matrix and the number of samples of each class.
    """
    if tau <= 0:
        raise ValueError(f"fedirm: the temperature tau must be > 0, got {tau}")
    t = targets.to(outputs.dtype)
    counts = t.sum(0)
    v = (t.t() @ outputs) / counts.clamp_min(_EPS)[:, None]  # (C, C): row c = mean output over class c
    m = torch.softmax(v / tau, dim=1) if kind == "softmax" else torch.sigmoid(v / tau)
    return m, counts.detach()


def average_relations(
    matrices: Sequence[torch.Tensor] | torch.Tensor,
    counts: Sequence[torch.Tensor] | torch.Tensor,
    mode: Literal["batches", "code"] = "batches",
    kind: Kind = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A site's matrix of the round from its per-batch matrices ("averaged over the round's batches").

    ``"batches"``: row c is the mean of row c over the batches that held class c (rows no batch held: uniform,
    not valid). ``"code"``: the plain mean over all batches, absent-class batches contributing uniform rows
    (the released code's ``confuse_matrix / iter_max``).

    Args:
        matrices: ``(R, C, C)`` per-batch matrices; counts: ``(R, C)`` per-batch class counts.

    Returns:
        ``(M (C, C), valid (C,) bool)``.
    """
    m = torch.stack(list(matrices)) if not torch.is_tensor(matrices) else matrices
    n = torch.stack(list(counts)) if not torch.is_tensor(counts) else counts
    if m.ndim != 3 or n.shape != m.shape[:2]:
        raise ValueError(f"need (R, C, C) matrices and (R, C) counts, got {tuple(m.shape)} and {tuple(n.shape)}")
    present = (n > 0).to(m.dtype)
    valid = present.sum(0) > 0
    if mode == "code":
        return m.mean(0), valid
    summed = (m * present[:, :, None]).sum(0) / present.sum(0).clamp_min(1.0)[:, None]
    return torch.where(valid[:, None], summed, uniform_rows(m.shape[1], kind, m.dtype, m.device)), valid


def server_relation(
    matrices: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's global matrix ``M = (1/m) sum_l M^l`` over the labelled sites (Sec. 2.3), row by row over the
    sites that estimated the row.

    Args:
        matrices: ``(K, C, C)`` the labelled sites' matrices; valid: ``(K, C)`` bool, rows each site estimated.
        weights: ``(K,)`` site weights (None: uniform, the paper and the released code; n_k for sample weights).

    Returns:
        ``(M (C, C), valid (C,) bool)``; a row no site estimated is 0 and not valid (the caller keeps its previous).
    """
    k = matrices.shape[0]
    w = torch.ones(k, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    wv = w[:, None] * valid.to(torch.float64)  # (K, C)
    total = wv.sum(0)
    m = (wv[:, :, None] * matrices.to(torch.float64)).sum(0) / total.clamp_min(1e-300)[:, None]
    return m.to(matrices.dtype), total > 0


def _kl_rows(p: torch.Tensor, q: torch.Tensor, kind: Kind) -> torch.Tensor:
    """``(C,)`` KL(p_c || q_c) per row: categorical, or the sum over j of Bernoulli KLs."""
    p, q = p.clamp(_EPS, 1.0), q.clamp(_EPS, 1.0)
    kl = p * (p.log() - q.log())
    if kind == "sigmoid":
        p1, q1 = (1 - p).clamp_min(_EPS), (1 - q).clamp_min(_EPS)
        kl = kl + p1 * (p1.log() - q1.log())
    return kl.sum(1)


def symmetric_kl(
    global_m: torch.Tensor,
    local_m: torch.Tensor,
    rows: torch.Tensor | None = None,
    kind: Kind = "softmax",
    reduction: Literal["paper", "code"] = "paper",
) -> torch.Tensor:
    """The inter-client relation matching loss (Eq. 6):
    ``L_IRM = (1/C) sum_c [KL(M_c || M^u_c) + KL(M^u_c || M_c)]``.

    Args:
        global_m, local_m: ``(C, C)`` relation matrices (rows: distributions, or Bernoulli probabilities).
        rows: ``(C,)`` bool, the rows that count (e.g. classes with a selected sample in the batch and a global
            row); the others contribute 0 (their local row is a constant and carries no gradient); still / C.
        reduction: ``"paper"`` as Eq. 6; ``"code"`` halves it (the released ``kd_loss`` averages the two KLs).

    Returns:
        a scalar.
    """
    c = global_m.shape[0]
    per_row = _kl_rows(global_m, local_m, kind) + _kl_rows(local_m, global_m, kind)
    if rows is not None:
        per_row = per_row * rows.to(per_row.dtype)
    loss = per_row.sum() / c
    return loss / 2 if reduction == "code" else loss


def uncertainty_filter(
    passes: torch.Tensor,
    threshold: float,
    kind: Kind = "softmax",
    confidence: torch.Tensor | None = None,
    min_confidence: float = 0.0,
    pseudo: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uncertainty-aware pseudo labels (Sec. 2.2.2, Eq. 4-5): the predictive entropy of the mean of ``T``
    Monte-Carlo-dropout passes ``w = -sum_c qbar_c log qbar_c``; a sample is kept when ``w < h``, its pseudo label
    is ``y = argmax p`` of the prediction ``p`` given as ``pseudo`` (the paper: ``y^u = argmax(p^u)``, the training
    forward pass, as the released ``local_unsupervised.py``), or ``argmax qbar`` when ``pseudo`` is None.

    Single-label (``"softmax"``): ``(B,)`` entropies, one-hot rows of the kept samples. Multi-label
    (``"sigmoid"``): per entry the binary entropy of ``qbar_ic``, an entry is a selected positive when its
    prediction (``pseudo``, else ``qbar``) is ``> 1/2`` and its entropy ``< h``.

    Args:
        passes: ``(T, B, C)`` probabilities of the T stochastic passes.
        threshold: ``h`` in nats (paper ``ln 2``; the released code 2.0).
        confidence: optional ``(B, C)`` probabilities of the training forward pass; with ``min_confidence`` the
            released code's second test ``max_c p_ic >= 0.3`` (multi-label: ``p_ic >= min_confidence``).
        pseudo: optional ``(B, C)`` probabilities whose argmax (multi-label: entries > 1/2) is the pseudo label.

    Returns:
        ``(targets (B, C) float, kept (B,) or (B, C) bool, entropy (B,) or (B, C))``.
    """
    mean = passes.mean(0)
    source = mean if pseudo is None else pseudo.to(mean.dtype)
    task = "multiclass" if kind == "softmax" else "multilabel"
    entropy = predictive_entropy(mean.double(), task)
    kept = entropy < float(threshold)
    if kind == "softmax":
        if confidence is not None and min_confidence > 0:
            kept = kept & (confidence.max(1).values >= min_confidence)
        targets = F.one_hot(source.argmax(1), mean.shape[1]).to(mean.dtype) * kept[:, None].to(mean.dtype)
    else:
        kept = kept & (source > 0.5)
        if confidence is not None and min_confidence > 0:
            kept = kept & (confidence >= min_confidence)
        targets = kept.to(mean.dtype)
    return targets, kept, entropy.to(mean.dtype)


def consistency_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: Kind = "softmax"
) -> torch.Tensor:
    """Eq. 1 with a mean teacher: ``(1/B) sum_i ||p_student(x_i, xi) - p_teacher(x_i, xi')||_2^2`` on softmax
    (or sigmoid) outputs, no gradient into the teacher (the released ``softmax_mse_loss`` summed / batch size).

    Args:
        student_logits, teacher_logits: ``(B, C)``.
    """
    act = (lambda z: torch.softmax(z, 1)) if kind == "softmax" else torch.sigmoid
    diff = act(student_logits) - act(teacher_logits.detach())
    return (diff**2).sum() / max(student_logits.shape[0], 1)


def ema_decay(step: int, max_decay: float = 0.99) -> float:
    """The mean teacher's decay with this method's default bound (:func:`fedpartial.methods.common.ema_decay`)."""
    return common.ema_decay(step, max_decay)


def rampup(round_num: int, length: int = 30) -> float:
    """The Gaussian warm-up ``lambda(omega) = exp(-5 (1 - min(omega, Omega)/Omega)^2)`` (Tarvainen & Valpola; the
    paper prints it without the square, a typo of its reference [28]; the released ``sigmoid_rampup`` squares).
    ``length = 0``: 1."""
    if length <= 0:
        return 1.0
    t = min(max(float(round_num), 0.0), float(length)) / float(length)
    return float(np.exp(-5.0 * (1.0 - t) ** 2))


def supervised_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    known: torch.Tensor,
    kind: Kind = "softmax",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The labelled loss ``L_ce``: cross-entropy on the known rows (optionally label-smoothed, the released
    code's 0.1: ``(1 - eps) nll + eps mean_c(-log p_c)``), or BCE over the known entries (multi-label).
    0 (with gradient) when nothing is known.

    Args:
        logits: ``(B, C)``; targets: ``(B, C)`` one-hot / multi-hot; known: ``(B,)`` rows or ``(B, C)`` entries.
    """
    if kind == "softmax":
        return row_ce(logits, targets.argmax(1), known, label_smoothing)
    per = F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="none")
    return masked_mean(per, known.bool())


def self_training_targets(
    probs: torch.Tensor, threshold: float, kind: Kind = "softmax"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fed-SelfTraining's pseudo labels from the received model's probabilities ``(B, C)``: single-label, the
    argmax row where ``max_c p >= threshold``; multi-label, 1 where ``p >= threshold`` and 0 where
    ``p <= 1 - threshold``. Returns ``(targets (B, C), known (B,) or (B, C) bool)``."""
    if kind == "softmax":
        known = probs.max(1).values >= threshold
        return F.one_hot(probs.argmax(1), probs.shape[1]).to(probs.dtype), known
    return (probs >= threshold).to(probs.dtype), (probs >= threshold) | (probs <= 1 - threshold)
