"""FedLC (Zhang, Li, Li, Xu, Lin, "Federated Learning with Label Distribution Skew via Logits Calibration",
ICML 2022): each site calibrates its logits by its own label counts before the softmax cross-entropy,

    l_c' = l_c - tau * n_c^(-1/4)          loss = CE(l', y)

with ``n_c`` the site's number of labelled training images of class ``c``: a class the site holds rarely has
its logit lowered more, so the site's pull towards its frequent classes is reduced. A class the site holds no
image of (``n_c = 0``, where ``n_c^(-1/4)`` is infinite) leaves the softmax (its calibrated logit is -inf) for
``tau > 0``; ``tau = 0`` is plain cross-entropy. Single-label only; FedAvg on the server. Only the site's
labelled rows (a 1 among the annotated entries) enter the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..losses import labelled_rows, row_ce
from ..options import opt
from .base import ServerRule
from .baselines import SupervisedOptions, SupervisedTrainer
from .common import label_table


def calibration(counts: torch.Tensor, tau: float) -> torch.Tensor:
    """``(C,)`` offsets ``tau * n_c^(-1/4)`` subtracted from the logits; +inf where ``n_c = 0`` (for ``tau > 0``)."""
    counts = counts.double()
    if tau == 0:
        return torch.zeros_like(counts).float()
    return torch.where(
        counts > 0, tau * counts.clamp_min(1.0).pow(-0.25), torch.full_like(counts, float("inf"))
    ).float()


def calibrated_ce(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy of the calibrated logits ``logits - offsets`` over the labelled rows (mean; 0 with a gradient
    when there is none).

    Args:
        logits: ``(B, C)``; labels: ``(B, C)`` one-hot where annotated; mask: ``(B, C)`` annotated entries.
        offsets: ``(C,)`` from :func:`calibration`.
    """
    return row_ce(
        logits - offsets.to(logits.device, logits.dtype, non_blocking=True),
        labels.argmax(dim=1),
        labelled_rows(labels, mask),
    )


@dataclass
class FedLCOptions(SupervisedOptions):
    tau: float = opt(1.0, "tau, the strength of the logit calibration tau * n_c^(-1/4) (0: plain cross-entropy)")


class FedLCTrainer(SupervisedTrainer):
    """The calibrated cross-entropy is the label loss (so ``missing`` does not apply)."""

    Options = FedLCOptions
    tasks = ("multiclass",)

    def start_round(self, round_num: int, global_meta: dict) -> None:
        labels, mask = label_table(self.ctx.data)
        self.offsets = calibration((labels * mask.float()).sum(0), self.opts.tau)

    def label_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        return calibrated_ce(logits, batch["label"], batch["mask"], self.offsets)


def register_all(register) -> None:
    register(
        "fedlc",
        FedLCTrainer,
        ServerRule,
        doc="FedLC (Zhang et al., ICML 2022): logits calibrated by tau n_c^(-1/4)",
        job="fedlc_ham10000",
        comparison=True,
    )
