"""Losses shared by the methods. Shapes: logits ``(B, C)``, labels ``(B, C)`` float 0/1, mask ``(B, C)`` bool
(True where the entry is annotated at this site).

Multi-label:
- ``bce_missing_as_negative``: missing labels counted as 0 (the papers' FedAvg lower bound).
- ``masked_bce``: BCE over annotated entries only (FedAvg-PL, "partial loss"), mean over annotated entries;
  optional per-class weights ``w_c`` (FPSL / FedLSM's negative/positive ratio) on the positive term.

Single-label (one-hot rows, a row is labelled when it has a 1 among its annotated entries):
- ``ce_labelled``: cross-entropy over all classes on labelled rows (missing classes act as negatives).
- ``ce_restricted``: cross-entropy with the softmax restricted to the site's annotated classes
  (logits of other classes set to -inf), labelled rows only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bce_missing_as_negative(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean BCE over all ``B*C`` entries with unannotated entries as negatives."""
    target = labels if mask is None else labels * mask.float()
    return F.binary_cross_entropy_with_logits(logits, target)


def masked_bce(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, pos_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean BCE over annotated entries only; 0 (with gradient) when nothing is annotated.

    ``pos_weight``: optional ``(C,)`` weight of the positive term per class (as torch's BCE ``pos_weight``).
    """
    m = mask.float()
    per = F.binary_cross_entropy_with_logits(logits, labels, reduction="none", pos_weight=pos_weight)
    return (per * m).sum() / m.sum().clamp_min(1.0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` (same shape, bool) is True; 0 (with a gradient) where it selects nothing.

    Computed on the whole tensor (unselected values must be finite): no row count is read back to the host,
    so a GPU is not waited on."""
    kept = torch.where(mask, values, torch.zeros_like(values))
    return kept.sum() / mask.sum().clamp_min(1).to(values.dtype)


def row_ce(
    logits: torch.Tensor, target: torch.Tensor, rows: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Cross-entropy ``(B, C)`` logits vs class indices ``(B,)``, averaged over ``rows`` ``(B,)`` bool (as
    ``F.cross_entropy(logits[rows], target[rows])``); 0 with a gradient when no row is selected."""
    per = F.cross_entropy(logits, target, reduction="none", label_smoothing=float(label_smoothing))
    return masked_mean(per, rows)


def labelled_rows(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` bool: single-label rows whose class is known here (a 1 among the annotated entries)."""
    return (labels * mask.float()).sum(dim=1) > 0


def ce_labelled(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over all classes on labelled rows (mean); 0 when no row is labelled."""
    return row_ce(logits, labels.argmax(dim=1), labelled_rows(labels, mask))


def ce_restricted(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with the softmax over the site's annotated classes only, on labelled rows."""
    rows = labelled_rows(labels, mask)
    # -inf on the classes not annotated here, in labelled rows only (an unlabelled row keeps finite logits: its
    # term is dropped, and a row of -inf would give NaN gradients)
    restricted = logits.masked_fill(~mask.bool() & rows[:, None], float("-inf"))
    return row_ce(restricted, labels.argmax(dim=1), rows)


SUPERVISED_LOSSES = {
    ("multilabel", "negatives"): bce_missing_as_negative,
    ("multilabel", "partial"): masked_bce,
    ("multiclass", "negatives"): ce_labelled,
    ("multiclass", "partial"): ce_restricted,
}


def supervised_loss(task: str, kind: str):
    """The supervised loss for a task ('multilabel' / 'multiclass') and a missing-label policy
    ('negatives' / 'partial')."""
    try:
        return SUPERVISED_LOSSES[(task, kind)]
    except KeyError:
        raise ValueError(
            f"no supervised loss for task={task!r}, kind={kind!r}; choose from {sorted(SUPERVISED_LOSSES)}"
        ) from None
