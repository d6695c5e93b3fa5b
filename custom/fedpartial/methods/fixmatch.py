"""FedAvg + FixMatch (Sohn et al., "FixMatch: Simplifying Semi-Supervised Learning with Consistency and
Confidence", NeurIPS 2020) for missing labels, as the papers compare with it: ``fixmatch`` is FedMLP's FedFixMatch
(FedAvg aggregation), ``fixmatch_masked`` FedLSM's "FedAvg* + FixMatch" (class-masked classifier rows, FPSL's
task-dependent aggregation: :class:`~.baselines.MaskedRule`).

Each step draws a weak and a strong view of the same images (``train.views``: per batch or per sample) and runs
the model once on both (train mode; FixMatch's reference code also forwards both in one batch):

- supervised: the partial loss on the annotated entries of the weak view (multi-label: BCE over annotated
  entries, mean over them; single-label: cross-entropy restricted to the annotated classes on the labelled rows).
- pseudo labels from the same forward pass on the weak view, without gradient. Single-label: a row that is not
  labelled gets ``argmax_c p_ic`` when ``max_c p_ic >= tau`` (softmax). Multi-label: an unannotated entry gets
  1 when ``p_ic >= tau``, 0 when ``p_ic <= 1 - tau`` (sigmoid), none otherwise.
- unsupervised: on the strong view, FixMatch's ``l_u`` normalised by all candidates, not only the confident ones::

      single-label: l_u = (1 / N_U) sum_{pseudo rows i} CE(z^s_i, y^_i)        N_U = unlabelled rows of the batch
      multi-label:  l_u = (1 / N_U) sum_{pseudo entries (i, c)} BCE(z^s_ic, y^_ic)   N_U = unannotated entries

- ``loss = l_s + lambda_u * l_u`` (``tau`` 0.95, ``lambda_u`` 1: FixMatch's defaults).

A site that annotates no class takes part (every entry / row is a candidate). Per round the site reports (meta,
also in the site log line): ``fixmatch_candidates`` (unannotated entries / unlabelled rows seen), ``fixmatch_pseudo``
(those given a pseudo label), ``fixmatch_pseudo_rate`` (their ratio), and per class ``fixmatch_pseudo_positives``
(``(C,)``: pseudo positives / pseudo-label rows of each class) and, multi-label, ``fixmatch_pseudo_negatives``.

Left out: FixMatch's RandAugment + Cutout strong view (this project's ``strong`` view kind stands in,
:mod:`fedpartial.data.batch_views`), the ratio ``mu`` of unlabelled to labelled batch sizes (here the labelled
and unlabelled entries share the images of one batch), the EMA model for evaluation, and the cosine schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..data.views import ViewKind
from ..evaluation import probabilities
from ..losses import labelled_rows, supervised_loss
from ..options import opt
from .base import LocalTrainer, RoundOutput, ServerRule, TrainerOptions
from .baselines import MaskedRule
from .common import DeviceSums

META_CANDIDATES = "fixmatch_candidates"  # unannotated entries (multi-label) / unlabelled rows (single-label) seen
META_PSEUDO = "fixmatch_pseudo"  # of those, the ones given a pseudo label (summed over the round's steps)
META_RATE = "fixmatch_pseudo_rate"  # pseudo / candidates (0 when there is no candidate)
META_POSITIVES = "fixmatch_pseudo_positives"  # (C,) pseudo positives (multi-label) / pseudo-label rows per class
META_NEGATIVES = "fixmatch_pseudo_negatives"  # (C,) pseudo negatives per class (multi-label)


def pseudo_labels(
    probs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, task: str, tau: float, unannotated_only: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FixMatch's confidence-masked hard pseudo labels from the weak view's probabilities.

    Args:
        probs: ``(B, C)`` softmax (single-label) or sigmoid (multi-label) probabilities of the weak view.
        labels, mask: ``(B, C)`` the batch's labels and annotated entries.
        task: 'multiclass' or 'multilabel'; tau: the confidence threshold.
        unannotated_only: single-label: an unlabelled row is known not to be any class the site annotates, so its
            pseudo label is the most probable of the other classes (confidence: that class's probability);
            False: the argmax over all classes (FedLSM's released FixMatch).

    Returns:
        ``(targets (B, C), pseudo, candidates)``. Single-label: ``targets`` one-hot of the argmax, ``pseudo`` /
        ``candidates`` ``(B,)`` bool (rows with a pseudo label / rows that are not labelled). Multi-label:
        ``targets`` 0 / 1, ``pseudo`` / ``candidates`` ``(B, C)`` bool (entries with a pseudo label /
        unannotated entries).
    """
    probs = probs.detach()
    if task == "multiclass":
        candidates = ~labelled_rows(labels, mask)
        conf, arg = (probs.masked_fill(mask.bool(), 0.0) if unannotated_only else probs).max(dim=1)
        return F.one_hot(arg, probs.shape[1]).to(probs.dtype), candidates & (conf >= tau), candidates
    candidates = ~mask.bool()
    pos = candidates & (probs >= tau)
    neg = candidates & (probs <= 1 - tau) & ~pos
    return pos.to(probs.dtype), pos | neg, candidates


def unsupervised_loss(
    logits_s: torch.Tensor, targets: torch.Tensor, pseudo: torch.Tensor, candidates: torch.Tensor, task: str
) -> torch.Tensor:
    """FixMatch's ``l_u`` on the strong view (module docstring): ``logits_s``, ``targets`` ``(B, C)``; ``pseudo`` /
    ``candidates`` as returned by :func:`pseudo_labels`. 0 (with a gradient) when nothing has a pseudo label.
    Nothing is read back to the host (no wait on a GPU)."""
    if task == "multiclass":
        per = -(targets * torch.log_softmax(logits_s, dim=1)).sum(1)
    else:
        per = F.binary_cross_entropy_with_logits(logits_s, targets.to(logits_s.dtype), reduction="none")
    n = candidates.sum().clamp_min(1).to(per.dtype)  # no candidates: no pseudo labels either, the sum is 0
    return torch.where(pseudo, per, torch.zeros_like(per)).sum() / n


@dataclass
class FixMatchOptions(TrainerOptions):
    """FixMatch's site options (FixMatch's defaults)."""

    tau: float = opt(0.95, "confidence threshold (multi-label: p >= tau -> 1, p <= 1 - tau -> 0)")
    lambda_u: float = opt(1.0, "weight of the unsupervised term")
    pseudo_classes: Literal["all", "unannotated"] = opt(
        "all",
        "single-label pseudo labels: argmax over all classes (FedLSM's released FixMatch) or over the classes "
        "the site does not annotate (an unlabelled row is known to be one of them)",
    )
    weak_view: ViewKind = opt(
        "weak",
        "the weak view: flip + small rotation / translation (the 'weak' kind; FixMatch's is flip + "
        "translation), or a horizontal flip only",
    )

    def __post_init__(self):
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"fixmatch: tau must lie in [0, 1], got {self.tau}")
        if self.lambda_u < 0:
            raise ValueError(f"fixmatch: lambda_u must be >= 0, got {self.lambda_u}")


class FixMatchTrainer(LocalTrainer):
    """FixMatch's local training for missing labels (both tasks; module docstring)."""

    Options = FixMatchOptions
    accepts_unlabelled = True

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        if ctx.task == "multilabel" and self.opts.tau < 0.5:
            raise ValueError(
                f"fixmatch: multi-label tau must be >= 0.5 (p >= tau -> 1, p <= 1 - tau -> 0), got {self.opts.tau}"
            )
        self.partial_loss = supervised_loss(ctx.task, "partial")

    def step_loss(
        self, logits_w: torch.Tensor, logits_s: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, targets, pseudo, candidates)`` of one step from the weak and strong views' logits ``(B, C)``."""
        task = self.ctx.task
        targets, pseudo, candidates = pseudo_labels(
            probabilities(logits_w.detach(), task).float(),
            labels,
            mask,
            task,
            self.opts.tau,
            self.opts.pseudo_classes == "unannotated",
        )
        loss = self.partial_loss(logits_w, labels, mask)
        if self.opts.lambda_u > 0:
            loss = loss + self.opts.lambda_u * unsupervised_loss(logits_s, targets, pseudo, candidates, task)
        return loss, targets, pseudo, candidates

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        model = self.train_mode()
        self.make_optimizer()
        sums, steps = DeviceSums(), 0  # read once, after the round
        for batch in self.batches({"image": self.opts.weak_view, "image_s": "strong"}, round_num):
            B = batch["image"].shape[0]
            logits = model(torch.cat([batch["image"], batch["image_s"]]))
            labels, mask = batch["label"].float(), batch["mask"].bool()
            loss, targets, pseudo, candidates = self.step_loss(logits[:B], logits[B:], labels, mask)
            self.step(loss)
            steps += 1
            sums.add(loss=loss, candidates=candidates, pseudo=pseudo)
            if self.ctx.task == "multiclass":
                sums.add_each(positives=(targets * pseudo[:, None]).sum(0))
            else:
                sums.add_each(positives=(targets * pseudo).sum(0), negatives=((1 - targets) * pseudo).sum(0))
        got = sums.read()
        C = self.ctx.num_classes
        n_cand, n_pseudo = int(got.get("candidates", 0)), int(got.get("pseudo", 0))
        meta = {
            META_CANDIDATES: n_cand,
            META_PSEUDO: n_pseudo,
            META_RATE: n_pseudo / n_cand if n_cand else 0.0,
            META_POSITIVES: got.get("positives", np.zeros(C)),
        }
        if self.ctx.task == "multilabel":
            meta[META_NEGATIVES] = got.get("negatives", np.zeros(C))
        return RoundOutput(steps=steps, loss=got.get("loss", 0.0) / max(steps, 1), meta=meta)


def register_all(register) -> None:
    register(
        "fixmatch",
        FixMatchTrainer,
        ServerRule,
        doc="FedAvg + FixMatch (FedMLP's FedFixMatch)",
        job="fixmatch_ich",
        comparison=True,
    )
    register(
        "fixmatch_masked",
        FixMatchTrainer,
        MaskedRule,
        doc="FedAvg* + FixMatch (FedLSM's: class-masked classifier rows)",
        job="fixmatch_masked_ham10000",
        comparison=True,
    )
