"""FedRS (Li and Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data",
KDD 2021): at a site, the logits of the classes it does not hold are scaled by ``alpha`` before the softmax
cross-entropy, so the site pushes less on classes it never sees. Single-label only (a restricted softmax);
FedAvg on the server. ``fedrs_masked`` adds the class-masked classifier rows (as FedLSM's table pairs methods
with the task-dependent aggregation)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..losses import labelled_rows
from .base import ServerRule
from .baselines import MaskedRule, SupervisedOptions, SupervisedTrainer
from .options import opt


def restricted_softmax_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, owned: torch.Tensor,
                          alpha: float) -> torch.Tensor:
    """Cross-entropy of the restricted softmax on the labelled rows (mean; 0 with a gradient when none).

    Args:
        logits: ``(B, C)``; labels: ``(B, C)`` one-hot where annotated; mask: ``(B, C)`` annotated entries.
        owned: ``(C,)`` bool, the classes this site holds (its annotated classes).
        alpha: the scale of the other classes' logits (``s_c = alpha * w_c^T h``; 1 = plain cross-entropy).
    """
    rows = labelled_rows(labels, mask)
    if not rows.any():
        return logits.sum() * 0.0
    scale = torch.where(owned.to(logits.device), torch.ones((), device=logits.device),
                        torch.full((), float(alpha), device=logits.device))
    return F.cross_entropy(logits[rows] * scale, labels[rows].argmax(dim=1))


@dataclass
class FedRSOptions(SupervisedOptions):
    alpha: float = opt(0.5, "scale of the logits of the classes the site does not hold (FedRS's alpha)")


class FedRSTrainer(SupervisedTrainer):
    Options = FedRSOptions
    tasks = ("multiclass",)

    def supervised(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        owned = torch.as_tensor(self.ctx.annotated, dtype=torch.bool)
        return restricted_softmax_ce(logits, batch["label"], batch["mask"], owned, self.opts.alpha)


def register_all(register) -> None:
    register("fedrs", FedRSTrainer, ServerRule, doc="FedRS (restricted softmax), FedAvg")
    register("fedrs_masked", FedRSTrainer, MaskedRule, doc="FedRS with class-masked rows")
