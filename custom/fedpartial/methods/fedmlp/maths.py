"""FedMLP's mathematics as pure functions on tensors (equation numbers of Sun et al., MICCAI 2024)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...aggregation import class_average
from ..base import summary_counts
from ..common import cosine, full_precision

__all__ = [
    "class_rates",
    "summary_rates",
    "prevalence_rates",
    "logit_adjust",
    "wpc_loss",
    "consistency_loss",
    "class_prototypes",
    "aggregate_prototypes",
    "prototype_scores",
    "candidate_counts",
    "selection_counts",
    "select_top",
    "select_pseudo_labels",
    "schedule_share",
    "accumulate_pseudo_labels",
    "learning_degree",
    "aggregate_learning_degree",
    "selection_ratios",
    "META_P0",
    "META_P1",
    "META_COUNTS",
    "META_DEGREE",
    "META_GLOBAL_P0",
    "META_GLOBAL_P1",
    "META_GLOBAL_VALID",
    "META_GLOBAL_DEGREE",
    "PARITIES",
    "REDUCTIONS",
]

# site -> server
META_P0 = "fedmlp_p0"  # (C, D) float32: local negative prototypes (rows of missing classes are 0)
META_P1 = "fedmlp_p1"  # (C, D) float32: local positive prototypes
META_COUNTS = "fedmlp_proto_counts"  # (C, 2) int64: samples behind P0 / P1
META_DEGREE = "fedmlp_degree"  # (C,) float64: local learning degree d_c^k (meaningful for missing classes)
# server -> sites
META_GLOBAL_P0 = "fedmlp_global_p0"  # (C, D) float32
META_GLOBAL_P1 = "fedmlp_global_p1"  # (C, D) float32
META_GLOBAL_VALID = "fedmlp_global_valid"  # list of C [bool, bool]: P0 / P1 of class c are defined
META_GLOBAL_DEGREE = "fedmlp_global_degree"  # list of C floats: d_c^G

PARITIES = ("paper", "code")
REDUCTIONS = ("classes", "entries")  # Eq. 4's 1/C per sample, or the mean over the labelled entries (released code)
_RATE_EPS = 1e-4


# ------------------------------------------------------------------------------------------ pure functions


def class_rates(
    labels: torch.Tensor, label_mask: torch.Tensor, eps: float = _RATE_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class positive / negative rates ``pi_{c,1}``, ``pi_{c,0} = 1 - pi_{c,1}`` used by Eq. 3.

    Args:
        labels: ``(N, C)`` 0/1 targets.
        label_mask: ``(N, C)`` bool, entries that carry a label (annotated or pseudo).

    Returns:
        ``(pi1 (C,), pi0 (C,))``: share of positives among the labelled entries of each class, 0.5 (no
        adjustment) for a class without labelled entries, clamped to ``[eps, 1 - eps]``.
    """
    m = label_mask.float()
    n = m.sum(0)
    pos = (labels.float() * m).sum(0)
    pi1 = torch.where(n > 0, pos / n.clamp_min(1.0), torch.full_like(n, 0.5)).clamp(eps, 1 - eps)
    return pi1, 1 - pi1


def summary_rates(summary: dict, num_classes: int, eps: float = _RATE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Global class rates from the server's data summary (``{"sites": {site: {"positives", "negatives"}}}``):
    ``pi_{c,1} = sum_k pos_{k,c} / sum_k (pos_{k,c} + neg_{k,c})`` over the sites' annotated entries."""
    pos, neg = summary_counts(summary, num_classes)
    n = pos + neg
    pi1 = torch.where(n > 0, pos / n.clamp_min(1.0), torch.full_like(n, 0.5)).clamp(eps, 1 - eps).float()
    return pi1, 1 - pi1


def prevalence_rates(positives: torch.Tensor, n: int, eps: float = _RATE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """A site's own prevalence estimate for classes it does not annotate: ``pi_{c,1} = (t_c + 1) / (N + 2)``.

    ``t_c`` = the positive pseudo labels of class c among the site's ``N`` samples; add-one smoothing keeps
    a class without positive pseudo labels away from 0 (``1 / (N + 2)``, not ``eps``). Used for Eq. 3 on missing classes
    when no data summary reached the site (the summary's global rate is the better estimate).

    Args:
        positives: ``(C,)`` positive pseudo labels per class; n: the site's sample count N.

    Returns:
        ``(pi1 (C,), pi0 (C,))`` float32, clamped to ``[eps, 1 - eps]``.
    """
    pos = torch.as_tensor(positives, dtype=torch.float64)
    pi1 = ((pos + 1.0) / (float(n) + 2.0)).clamp(eps, 1 - eps).float()
    return pi1, 1 - pi1


def logit_adjust(
    logits: torch.Tensor, pi1: torch.Tensor, pi0: torch.Tensor | None = None, tau: float = 1.0
) -> torch.Tensor:
    """Multi-label logit adjustment (Eq. 3, generalising Eq. 2).

    Eq. 3 ``y' = y*pi1 / (y*pi1 + (1-y)*pi0)`` with ``y = sigmoid(l)`` equals ``sigmoid(l + log pi1 - log pi0)``;
    with a temperature: ``l' = l + tau * (log pi1 - log pi0)`` (``tau = 1`` is Eq. 3 exactly, 0 disables it).

    Args:
        logits: ``(B, C)``; pi1, pi0: ``(C,)`` positive / negative rates (``pi0`` defaults to ``1 - pi1``).

    Returns:
        ``(B, C)`` adjusted logits (use them in the training loss only; predictions use the raw logits).
    """
    pi1 = torch.as_tensor(pi1, dtype=logits.dtype, device=logits.device)
    pi0 = 1 - pi1 if pi0 is None else torch.as_tensor(pi0, dtype=logits.dtype, device=logits.device)
    return logits + tau * (torch.log(pi1) - torch.log(pi0))


def wpc_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    label_mask: torch.Tensor,
    pi1: torch.Tensor | None = None,
    pi0: torch.Tensor | None = None,
    tau: float = 1.0,
    reduction: str = "classes",
) -> torch.Tensor:
    """Weighted-partial-class loss (Eq. 4) on logit-adjusted outputs (Eq. 3).

    ``reduction="classes"`` (Eq. 4): ``L_i = -(1/C) sum_{j labelled} [y_ij log y'_ij + (1 - y_ij) log(1 - y'_ij)]``,
    averaged over the batch; the division by C (not by the number of labelled classes) is the "weight" of the
    partial-class loss. ``reduction="entries"`` (the released code's balance): the mean of the same terms over the
    labelled entries of the batch (0 with gradient when there is none). With one labelled class of C the two
    differ by a factor C. "Labelled" = the active classes (Eq. 4) plus, in stage 2, the pseudo-labelled entries.

    Args:
        logits: ``(B, C)`` raw logits; labels: ``(B, C)`` 0/1; label_mask: ``(B, C)`` bool.
        pi1, pi0: ``(C,)`` class rates for Eq. 3; None = no adjustment.
        reduction: ``"classes"`` or ``"entries"``.

    Returns:
        scalar loss.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    z = logits if pi1 is None else logit_adjust(logits, pi1, pi0, tau)
    per = F.binary_cross_entropy_with_logits(z, labels.to(z.dtype), reduction="none")
    m = label_mask.to(z.dtype)
    if reduction == "entries":
        return (per * m).sum() / m.sum().clamp_min(1.0)
    return (per * m).sum(dim=1).div(logits.shape[1]).mean()


def consistency_loss(p_local: torch.Tensor, p_global: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Consistency regularisation (Sec. 2.4): mean squared difference between the local and the global model's
    probabilities over the masked entries (missing classes without a pseudo label); 0 (with gradient) if none.

    Args:
        p_local, p_global: ``(B, C)`` sigmoid outputs (``p_global`` is a constant target); mask: ``(B, C)`` bool.
    """
    m = mask.to(p_local.dtype)
    return ((p_local - p_global.detach()) ** 2 * m).sum() / m.sum().clamp_min(1.0)


@full_precision()  # float32 under train.amp
def class_prototypes(
    features: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local dual prototypes (Eq. 5): ``P_n^c = mean of F_i over the samples with y_ic = n`` (n in {0, 1}).

    Args:
        features: ``(N, D)``; labels: ``(N, C)`` 0/1; label_mask: ``(N, C)`` bool, the entries to use (the
            site's annotated entries of its active classes).

    Returns:
        ``(P0 (C, D), P1 (C, D), counts (C, 2) int64)``; a prototype with no sample is a zero row (count 0).
    """
    f = features.float()
    m = label_mask.float()
    y = labels.float()
    w1 = y * m  # (N, C)
    w0 = (1 - y) * m
    c1, c0 = w1.sum(0), w0.sum(0)
    p1 = (w1.t() @ f) / c1.clamp_min(1.0)[:, None]
    p0 = (w0.t() @ f) / c0.clamp_min(1.0)[:, None]
    counts = torch.stack([c0, c1], dim=1).round().long()
    return p0, p1, counts


def aggregate_prototypes(
    p0: torch.Tensor,
    p1: torch.Tensor,
    counts: torch.Tensor,
    annotated: torch.Tensor,
    site_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global prototypes (Eq. 6): ``P_n^c = sum_{i in S_c} a_i P_n^{i,c} / sum_{i in S_c} a_i``.

    S_c = the sites that annotate class c; a site whose prototype ``P_n^{i,c}`` has no sample (count 0) is left
    out of that prototype (it is undefined there). ``a_i = 1`` is the paper (``1/|S_c|``);
    ``site_weights = n_k`` is the released code. The per-class average is
    :func:`fedpartial.aggregation.class_average`.

    Args:
        p0, p1: ``(K, C, D)`` local prototypes; counts: ``(K, C, 2)``; annotated: ``(K, C)`` bool;
        site_weights: ``(K,)`` or None (uniform).

    Returns:
        ``(P0 (C, D), P1 (C, D), valid (C, 2) bool)``; rows with no contributing site are 0 and not valid.
    """
    K = p0.shape[0]
    a = np.ones(K) if site_weights is None else np.asarray(site_weights, dtype=np.float64)
    out, valid = [], []
    for n, p in enumerate((p0, p1)):
        w = np.asarray(annotated, dtype=np.float64) * (np.asarray(counts[..., n]) > 0) * a[:, None]  # (K, C)
        avg, held = class_average(np.asarray(p, dtype=np.float64), w)
        out.append(torch.as_tensor(avg).to(p.dtype))
        valid.append(torch.as_tensor(held))
    return out[0], out[1], torch.stack(valid, dim=1)


def prototype_scores(features: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """Prototype confidence (Eq. 7): ``Z_ic = cos(P0^c, F_i) - cos(P1^c, F_i)``; Z < 0 leans positive.

    Args:
        features: ``(N, D)``; p0, p1: ``(C, D)`` global prototypes.

    Returns:
        ``(N, C)`` scores in [-2, 2].
    """
    return cosine(features, p0) - cosine(features, p1)


def candidate_counts(scores: torch.Tensor, has_pseudo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(negative candidates (C,), positive candidates (C,))`` of the residual pool: samples without a pseudo label with
    ``Z >= 0`` / ``Z < 0`` (NaN scores are neither). Shapes as :func:`select_pseudo_labels`."""
    z = scores if scores.dim() == 2 else scores[:, None]
    free = ~(has_pseudo if has_pseudo.dim() == 2 else has_pseudo[:, None]).bool()
    return (free & (z >= 0)).sum(0), (free & (z < 0)).sum(0)


def selection_counts(
    n_neg: torch.Tensor,
    n_pos: torch.Tensor,
    tau0: float | torch.Tensor,
    tau1: float | torch.Tensor,
    carry: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How many candidates Eq. 8-9 pseudo-label this round: ``tau * #candidates`` rounded down.

    ``carry`` (``(2, C)``, the fractional parts left by earlier rounds, rows negative / positive) is added
    before rounding and the new remainder returned, so that over the rounds a site pseudo-labels ``tau`` of its
    candidates on average even where ``tau * #candidates < 1`` every round (a site of 100 images with
    ``T1 = 1 %``: plain rounding down never pseudo-labels anything). ``carry=None``: plain rounding down.

    Returns: ``(k0 (C,) int64, k1 (C,) int64, carry (2, C) float64)``.
    """
    exact = torch.stack(
        [
            torch.as_tensor(tau0, dtype=torch.float64).expand(n_neg.shape) * n_neg.double(),
            torch.as_tensor(tau1, dtype=torch.float64).expand(n_pos.shape) * n_pos.double(),
        ]
    )
    if carry is not None:
        exact = exact + torch.as_tensor(carry, dtype=torch.float64)
    k = torch.floor(exact + 1e-9)
    return k[0].long(), k[1].long(), (exact - k).clamp_min(0.0)


def select_top(
    scores: torch.Tensor, has_pseudo: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class c: the ``k0_c`` negative candidates (without a pseudo label, ``Z >= 0``) with the largest Z and the ``k1_c``
    positive candidates (``Z < 0``) with the smallest Z. Ties keep the lower index. Shapes as
    :func:`select_pseudo_labels`."""
    z = scores if scores.dim() == 2 else scores[:, None]
    taken = (has_pseudo if has_pseudo.dim() == 2 else has_pseudo[:, None]).bool()
    neg = torch.zeros_like(taken)
    pos = torch.zeros_like(taken)
    k0, k1 = torch.as_tensor(k0).expand(z.shape[1]), torch.as_tensor(k1).expand(z.shape[1])
    for c in range(z.shape[1]):
        zc, free = z[:, c], ~taken[:, c]
        for sel, cand, k, descending in (
            (neg, free & (zc >= 0), int(k0[c]), True),
            (pos, free & (zc < 0), int(k1[c]), False),
        ):
            if k <= 0:
                continue
            idx = torch.nonzero(cand, as_tuple=False).flatten()
            order = torch.sort(zc[idx], descending=descending, stable=True).indices[:k]
            sel[idx[order], c] = True
    if scores.dim() == 1:
        return neg[:, 0], pos[:, 0]
    return neg, pos


def select_pseudo_labels(
    scores: torch.Tensor, has_pseudo: torch.Tensor, tau0: float | torch.Tensor, tau1: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Missing-label detection (Eq. 8-9) on the residual pool of each class.

    For column c, among the samples without a pseudo label: the negative candidates (``Z >= 0``) and the positive
    candidates (``Z < 0``); ``floor(tau0_c * #negative candidates)`` of the largest Z become negatives and
    ``floor(tau1_c * #positive candidates)`` of the smallest Z become positives. Ties keep the lower index.
    (The trainer's default, ``pseudo_label_rounding: floor``, rounds down the same way; ``carry`` carries the
    fractional parts across rounds: :func:`selection_counts`.)

    Args:
        scores: ``(N,)`` or ``(N, C)`` Z scores (NaN = never selected).
        has_pseudo: same shape, bool: samples pseudo-labelled in earlier rounds (excluded, "residual samples").
        tau0, tau1: shares in [0, 1], scalars or ``(C,)`` (a 0 share selects nothing for that class).

    Returns:
        ``(new_negatives, new_positives)``: bool masks of the shape of ``scores``.
    """
    k0, k1, _ = selection_counts(*candidate_counts(scores, has_pseudo), tau0, tau1)
    return select_top(scores, has_pseudo, k0, k1)


def schedule_share(T: float, reference_rounds: int | None, rounds: int) -> float:
    """A per-round share ``T`` meant for ``reference_rounds`` stage-2 rounds, for a job with ``rounds`` of them:
    ``1 - (1 - T) ** (reference_rounds / rounds)``, so that a pool pseudo-labelled at that share every round is pseudo-labelled to
    the same total share by the last round (the paper: T1 = 1 % over 450 rounds pseudo-labels 99 % of the positive
    candidates; over 25 rounds 1 % pseudo-labels 22 %). ``reference_rounds`` None or ``rounds <= 0``: ``T`` unchanged."""
    if not reference_rounds or rounds <= 0:
        return T
    return 1.0 - (1.0 - T) ** (reference_rounds / rounds)


def accumulate_pseudo_labels(
    pseudo: torch.Tensor, new_negatives: torch.Tensor, new_positives: torch.Tensor
) -> torch.Tensor:
    """Permanent pseudo labels (Sec. 2.3.2): ``pseudo`` is ``(N, C)`` int8 with -1 = none, 0 / 1 = pseudo label;
    new selections are written only where the entry has none yet (earlier pseudo labels are never revised)."""
    free = pseudo < 0
    out = pseudo.clone()
    out[free & new_negatives.bool()] = 0
    out[free & new_positives.bool()] = 1
    return out


def learning_degree(probs: torch.Tensor, L: float = 0.3, R: float = 0.7) -> torch.Tensor:
    """Local learning degree (Eq. 10, left): ``d_c^k = #{i: p_ic < L or p_ic > R} / N_k``.

    Args:
        probs: ``(N, C)`` sigmoid outputs on all local samples.

    Returns:
        ``(C,)`` (the caller keeps the missing classes).
    """
    confident = (probs < L) | (probs > R)
    return confident.float().mean(0) if probs.shape[0] else torch.zeros(probs.shape[1])


def aggregate_learning_degree(
    degrees: torch.Tensor, site_sizes: torch.Tensor, missing: torch.Tensor, fallback: float = 1.0
) -> torch.Tensor:
    """Global learning degree (Eq. 10, right): ``d_c^G = sum_k |D_k| d_c^k / sum_k |D_k|`` over the sites k where
    class c is missing; ``fallback`` where no site misses c.

    Args:
        degrees: ``(K, C)``; site_sizes: ``(K,)``; missing: ``(K, C)`` bool.

    Returns:
        ``(C,)`` float64.
    """
    w = missing.to(torch.float64) * torch.as_tensor(site_sizes, dtype=torch.float64)[:, None]
    total = w.sum(0)
    d = (w * torch.nan_to_num(degrees.to(torch.float64))).sum(0) / total.clamp_min(1e-12)
    return torch.where(total > 0, d, torch.full_like(d, float(fallback)))


def selection_ratios(
    global_degree: torch.Tensor, T0: float, T1: float, adaptive: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-adaptive threshold (Sec. 2.3.3): ``tau0 = d_c^G * T0``, ``tau1 = d_c^G * T1``; fixed ``T0`` / ``T1``
    when ``adaptive`` is False (ablation without ST, and the released code)."""
    d = torch.as_tensor(global_degree, dtype=torch.float64)
    if not adaptive:
        d = torch.ones_like(d)
    return d * T0, d * T1
