"""FPSL (Dong et al., "Federated Partially Supervised Learning with Limited Decentralized Medical Images", IEEE TMI
42(7), 2023; doi 10.1109/TMI.2022.3231017) as FedLSM's tables compare with it: FPSL's task-dependent model
aggregation (each classifier row averaged over the sites that annotate its class: :class:`~.baselines.MaskedRule`)
with FPSL's partial-label loss.

Local loss:

- multi-label: class-weighted BCE over the site's annotated entries, the positive term of class ``c`` weighted by
  ``w_c = negatives_c / positives_c`` (torch's ``pos_weight``), mean over the annotated entries of the batch::

      L = (1 / |A|) sum_{(i, c) in A} -(w_c y_ic log s(z_ic) + (1 - y_ic) log(1 - s(z_ic)))

  FedLSM (Sec. 4, "In task 1, we used the weighted binary cross-entropy as in FPSL") is our source for the loss;
  FPSL's own text was not available to us. The counts behind ``w_c`` follow FedLSM's released code
  (``src/fl/server.py::estimate_global_pos_weight``: the server counts the positives and negatives of every
  client and sends the same ratio to all): ``class_weights: global`` counts the annotated entries of every site
  from the server's data summary (the released code also counts missing entries, stored as 0, as negatives; here
  only annotated ones count, as FedLSM's paper reading in ``fedlsm``); ``site``: the site's own annotated
  entries; ``none``: unweighted (= ``fedavg_masked``). A class with no positive or no negative gets weight 1.
- single-label (FedLSM's Table 2, ISIC / HAM10000 has an FPSL row; FPSL itself is multi-label only): cross-entropy
  with the softmax restricted to the site's annotated classes, on the labelled rows
  (:func:`fedpartial.losses.ce_restricted`), unweighted (FedLSM weights only task 1); ``class_weights`` does not
  apply.

Left out: FPSL's second module (the abstract's "task-agnostic decoupling learning", which FedLSM describes as a
bi-level optimisation in the local training, "only effective when the data is very limited"); neither FedLSM nor
the abstract describe it well enough to implement, and FedLSM's comparison names FPSL by its task-dependent
aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..data.views import ViewKind
from ..losses import ce_restricted, masked_bce
from ..options import opt
from .base import TrainerOptions, summary_counts
from .baselines import MaskedRule, SupervisedTrainer
from .common import label_table
from .fedlsm.maths import negative_positive_ratio

META_POS_WEIGHT = "fpsl_pos_weight"  # (C,) the class weights w_c this round (multi-label)


def fpsl_class_weights(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(C,)`` ``w_c = negatives_c / positives_c`` over the annotated entries of ``labels`` / ``mask`` ``(N, C)``
    (1 where a class has no positive or no negative)."""
    m = mask.float()
    return negative_positive_ratio((labels * m).sum(0), ((1 - labels) * m).sum(0))


def fpsl_loss(
    logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, pos_weight: torch.Tensor | None
) -> torch.Tensor:
    """The class-weighted partial BCE (module docstring): ``logits``, ``labels``, ``mask`` ``(B, C)``,
    ``pos_weight`` ``(C,)`` or None (unweighted) -> scalar, mean over the annotated entries."""
    w = None if pos_weight is None else pos_weight.to(logits.device, logits.dtype)
    return masked_bce(logits, labels, mask, w)


@dataclass
class FPSLOptions(TrainerOptions):
    """FPSL's site options."""

    class_weights: Literal["global", "site", "none"] = opt(
        "global",
        "multi-label w_c = negatives / positives over the annotated entries of all sites (the data summary; "
        "FedLSM's released code), of this site only, or none",
    )
    view: ViewKind = opt("weak", "the training augmentation")


class FPSLTrainer(SupervisedTrainer):
    """The FPSL loss replaces the label loss (``label_loss``) (so there is no ``missing`` option: it is a partial loss)."""

    Options = FPSLOptions

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        self.pos_weight: torch.Tensor | None = None
        self._warned = False

    def class_weights(self) -> torch.Tensor | None:
        """``(C,)`` this round's ``w_c`` (None: single-label or ``class_weights: none``)."""
        if self.ctx.task == "multiclass" or self.opts.class_weights == "none":
            return None
        if self.opts.class_weights == "global":
            if self.ctx.summary:
                pos, neg = summary_counts(self.ctx.summary, self.ctx.num_classes)
                return negative_positive_ratio(pos, neg)
            if not self._warned:
                self.ctx.log.warning("fpsl: no data summary received; class weights from the site's own labels")
                self._warned = True
        return fpsl_class_weights(*label_table(self.ctx.data))

    def start_round(self, round_num: int, global_meta: dict) -> None:
        self.pos_weight = self.class_weights()
        if self.pos_weight is not None:
            self.pos_weight = self.pos_weight.to(self.ctx.device)

    def label_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        if self.ctx.task == "multiclass":
            return ce_restricted(logits, batch["label"], batch["mask"])
        return fpsl_loss(logits, batch["label"], batch["mask"], self.pos_weight)

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict):
        out = super().train_round(round_num, num_rounds, global_meta)
        if self.pos_weight is not None:
            out.meta[META_POS_WEIGHT] = self.pos_weight.cpu().double().numpy()
        return out


def register_all(register) -> None:
    register(
        "fpsl",
        FPSLTrainer,
        MaskedRule,
        doc="FPSL: class-weighted partial BCE + task-dependent aggregation",
        job="fpsl_ham10000",
        comparison=True,
    )
