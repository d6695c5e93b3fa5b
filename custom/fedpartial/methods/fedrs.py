"""FedRS (Li and Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID Data",
KDD 2021): at a site, the logits of the classes it does not hold are scaled by ``alpha`` before the softmax
cross-entropy, so the site pushes less on classes it never sees (``scaling: counts``: the released code's
count-proportional scales). Single-label only (a restricted softmax);
FedAvg on the server. ``fedrs_masked`` adds the class-masked classifier rows (as FedLSM's table pairs methods
with the task-dependent aggregation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..losses import labelled_rows, row_ce
from ..options import opt
from .base import ServerRule
from .baselines import MaskedRule, SupervisedOptions, SupervisedTrainer
from .common import label_table


def logit_scales(counts: torch.Tensor, alpha: float, scaling: str = "presence") -> torch.Tensor:
    """``(C,)`` per-class logit scales from the site's ``(C,)`` labelled counts: ``presence`` (the paper): 1 for a
    class the site holds, ``alpha`` otherwise; ``counts`` (the released code, lxcnju/FedRepo):
    ``alpha + (1 - alpha) * cnt_c / max_c cnt_c``."""
    counts = counts.double()
    if scaling == "counts":
        return (alpha + (1 - alpha) * counts / counts.max().clamp_min(1.0)).float()
    return torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, float(alpha))).float()


def restricted_softmax_ce(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy of the restricted softmax on the labelled rows (mean; 0 with a gradient when none).

    Args:
        logits: ``(B, C)``; labels: ``(B, C)`` one-hot where annotated; mask: ``(B, C)`` annotated entries.
        scales: ``(C,)`` logit scales (:func:`logit_scales`; all 1 = plain cross-entropy).
    """
    return row_ce(
        logits * scales.to(logits.device, logits.dtype, non_blocking=True),
        labels.argmax(dim=1),
        labelled_rows(labels, mask),
    )


@dataclass
class FedRSOptions(SupervisedOptions):
    alpha: float = opt(0.5, "scale of the logits of the classes the site does not hold (FedRS's alpha)")
    scaling: Literal["presence", "counts"] = opt(
        "presence",
        "per-class scale: 1 / alpha by presence (paper), or alpha + (1 - alpha) cnt_c / max cnt (released code)",
    )


class FedRSTrainer(SupervisedTrainer):
    """The restricted softmax is the label loss (``label_loss``; so ``missing`` does not apply)."""

    Options = FedRSOptions
    tasks = ("multiclass",)

    def start_round(self, round_num: int, global_meta: dict) -> None:
        labels, mask = label_table(self.ctx.data)
        self.scales = logit_scales((labels * mask.float()).sum(0), self.opts.alpha, self.opts.scaling)

    def label_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return restricted_softmax_ce(logits, batch["label"], batch["mask"], self.scales)


def register_all(register) -> None:
    register(
        "fedrs",
        FedRSTrainer,
        ServerRule,
        doc="FedRS (restricted softmax), FedAvg",
        job="fedrs_ham10000",
        comparison=True,
    )
    register("fedrs_masked", FedRSTrainer, MaskedRule, doc="FedRS with class-masked rows", job="fedrs_ham10000")
