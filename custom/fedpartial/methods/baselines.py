"""The baselines every paper compares with (dataset-agnostic):

- ``fedavg``: missing labels treated as negatives (multi-label) / CE over all classes on labelled rows
  (single-label); FedAvg. The papers' lower bound.
- ``fedavg_pl``: the loss only over each site's annotated classes (partial loss); FedAvg.
- ``fedavg_masked``: partial loss + each classifier row averaged only over the sites that annotate its class
  (FPSL's task-dependent aggregation, FedLSM's FedAvg*, surgical aggregation's task-block rule).
- ``fedavg_full``: the same trainer on fully-labelled sites (the data protocol ``full``): the upper bound.
"""

from __future__ import annotations

import numpy as np

from ..aggregation import aggregate_states, masked_class_weights
from ..losses import supervised_loss
from .base import Contribution, LocalTrainer, RoundOutput, ServerRule


class SupervisedTrainer(LocalTrainer):
    """Plain supervised local training on the annotated labels.

    Options:
        missing: 'negatives' (unannotated = 0) or 'partial' (loss over annotated entries only).
        view: the training augmentation ('weak' by default).
    """

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        loss_fn = supervised_loss(self.ctx.task, self.options.get("missing", "partial"))
        model = self.ctx.model.train()
        self.make_optimizer()
        total, steps = 0.0, 0
        for batch in self.batches({"image": self.options.get("view", "weak")}, round_num):
            loss = loss_fn(model(batch["image"]), batch["label"], batch["mask"])
            self.step(loss)
            total += float(loss.detach())
            steps += 1
        return RoundOutput(steps=steps, loss=total / max(steps, 1))


class MaskedRule(ServerRule):
    """Classifier row c averaged over the sites annotating c (``row_weighting``: 'samples' = n_k, or
    'uniform' as surgical aggregation); other tensors FedAvg; a class no contributing site annotates keeps
    its previous global row."""

    def aggregate(self, previous, contributions: list[Contribution], classifier_keys, round_num, summary=None):
        annotated = np.stack([c.annotated for c in contributions])
        n = [c.n for c in contributions]
        cw = masked_class_weights(annotated, n, self.options.get("row_weighting", "samples"))
        weights = aggregate_states([c.weights for c in contributions], n, classifier_keys, cw, previous,
                                   zero_rows="previous")
        return weights, {}


def register_all(register) -> None:
    register("fedavg", SupervisedTrainer, ServerRule, missing="negatives")
    register("fedavg_pl", SupervisedTrainer, ServerRule, missing="partial")
    register("fedavg_masked", SupervisedTrainer, MaskedRule, missing="partial")
    register("fedavg_full", SupervisedTrainer, ServerRule, missing="partial")
