"""The baselines every paper compares with (dataset-agnostic):

- ``fedavg``: missing labels treated as negatives (multi-label) / CE over all classes on labelled rows
  (single-label); FedAvg. The papers' lower bound.
- ``fedavg_pl``: the loss only over each site's annotated classes (partial loss); FedAvg.
- ``fedavg_masked``: partial loss + each classifier row averaged only over the sites that annotate its class
  (FPSL's task-dependent aggregation, FedLSM's FedAvg*, surgical aggregation's task-block rule).

The all-labels upper bound is not a method: it is ``fedavg_pl`` on the data protocol ``full`` (jobs
``fedavg_full_*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..aggregation import masked_class_weights
from ..data.views import ViewKind
from ..losses import supervised_loss
from ..options import opt
from .base import Contribution, LocalTrainer, RoundOutput, RuleOptions, ServerRule, TrainerOptions
from .common import DeviceSums


@dataclass
class SupervisedOptions(TrainerOptions):
    """Options of plain supervised local training."""

    missing: Literal["negatives", "partial"] = opt(
        "partial", "unannotated entries as negatives, or left out of the loss"
    )
    view: ViewKind = opt("weak", "the training augmentation")


class SupervisedTrainer(LocalTrainer):
    """Plain supervised local training on the annotated labels, with three hooks a small method overrides instead
    of writing its own :meth:`train_round` (each step: ``features = model.features(x)``, ``logits =
    model.head(features)``, ``loss = label_loss(logits, batch) + extra_loss(batch, logits, features)``):

    - :meth:`start_round`: once per round, the received global model already loaded (FedProx / MOON copy it,
      FedRS reads the site's class counts);
    - :meth:`label_loss`: the loss on the batch's labels (default: ``missing``, unannotated entries as negatives
      or left out); FedRS, FPSL, FedPU, FedNoRo and FedLC replace it;
    - :meth:`extra_loss`: a term added to each step's loss (FedProx's proximal term, MOON's contrastive term).

    The hook was called ``supervised`` before; a subclass that still defines that name is refused when it is
    declared, with a pointer to :meth:`label_loss`."""

    Options = SupervisedOptions

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "supervised" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__}: the hook 'supervised' is now called 'label_loss(logits, batch)' "
                "(docs/adding-a-method.md)"
            )

    def start_round(self, round_num: int, global_meta: dict) -> None:
        """Called once per round with the received global model loaded, before the first step; ``global_meta`` is
        the metadata the server's rule sent with the model."""

    def extra_loss(self, batch: dict, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor | None:
        """A term added to the loss of each step (None: nothing); ``features`` ``(B, D)`` are the pooled
        representation the logits ``(B, C)`` were computed from, ``batch`` holds ``image``, ``label`` and ``mask``
        ``(B, C)`` and ``index`` ``(B,)`` (the rows' positions in the site's training manifest)."""
        return None

    def label_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """The loss on a batch's labels: ``logits`` ``(B, C)``, ``batch["label"]`` / ``batch["mask"]`` ``(B, C)``
        -> scalar (``missing``: unannotated entries as negatives or left out, :func:`fedpartial.losses.supervised_loss`)."""
        return supervised_loss(self.ctx.task, self.opts.missing)(logits, batch["label"], batch["mask"])

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        self.start_round(round_num, global_meta)
        model = self.train_mode()
        self.make_optimizer()
        sums, steps = DeviceSums(), 0  # the losses stay on the device; read once, after the round
        for batch in self.batches({"image": self.opts.view}, round_num):
            features = model.features(batch["image"])
            logits = model.head(features)
            loss = self.label_loss(logits, batch)
            extra = self.extra_loss(batch, logits, features)
            if extra is not None:
                loss = loss + extra
            self.step(loss)
            sums.add(loss=loss)
            steps += 1
        return RoundOutput(steps=steps, loss=sums.read().get("loss", 0.0) / max(steps, 1))


@dataclass
class MaskedRuleOptions(RuleOptions):
    """Options of the class-masked rule."""

    row_weighting: Literal["samples", "uniform"] = opt(
        "samples", "classifier-row weights: n_k, or 1 (surgical aggregation)"
    )


class MaskedRule(ServerRule):
    """Classifier row c averaged over the sites annotating c (``row_weighting``: 'samples' = n_k, or
    'uniform' as surgical aggregation); other tensors FedAvg; a class no contributing site annotates keeps
    its previous global row."""

    Options = MaskedRuleOptions
    required_metadata = ("annotated",)

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        annotated = np.stack([c.annotated for c in contributions])
        n = [c.n * c.weight for c in contributions]
        cw = masked_class_weights(annotated, n, self.opts.row_weighting)
        return self.average(previous, contributions, groups, cw, zero_rows="previous"), {}


def register_all(register) -> None:
    register("fedavg", SupervisedTrainer, ServerRule, doc="FedAvg, missing labels as negatives", missing="negatives")
    register("fedavg_pl", SupervisedTrainer, ServerRule, doc="FedAvg with the partial loss", missing="partial")
    register(
        "fedavg_masked",
        SupervisedTrainer,
        MaskedRule,
        doc="partial loss + class-masked classifier rows",
        missing="partial",
    )
