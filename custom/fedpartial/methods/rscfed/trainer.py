"""RSCFed's local trainer: supervised loss on the annotated labels, mean-teacher distillation on the rest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...data.views import ViewKind
from ...evaluation import probabilities
from ...losses import ce_labelled, labelled_rows, masked_bce
from ...options import opt
from ..base import LocalTrainer, RoundOutput, SiteContext, TrainerOptions
from ..common import DeviceSums, MeanTeacher, WithMeanTeacher
from .maths import (
    CONFIDENT,
    META_CONFIDENT,
    META_CONSISTENCY,
    META_SUPERVISED,
    META_UNLABELLED,
    Kind,
    consistency_loss,
    sharpen,
)


@dataclass
class RSCFedOptions(TrainerOptions):
    """RSCFed's site options (method_args; FedMLP's multi-label version by default, the RSCFed code's values in
    the docs)."""

    consistency_weight: float = opt(
        1.0,
        "weight of the mean-teacher distillation (FedMLP's version 1; RSCFed code "
        "lambda_u 0.02 on its fully unlabelled clients)",
    )
    sharpen: float = opt(
        1.0, "temperature T sharpening the teacher's probabilities (1: none, FedMLP's version; RSCFed code 0.5)"
    )
    ema_decay: float = opt(0.999, "mean teacher: decay min(1 - 1/(step + 1), this), steps counted across rounds")
    max_grad_norm: float = opt(0.0, "clip the gradient norm (0: off; RSCFed code 5)")
    view: ViewKind = opt("weak", "the augmentation of both views (student, teacher)")

    def __post_init__(self):
        if not 0.0 <= self.ema_decay <= 1.0:
            raise ValueError(f"rscfed: ema_decay must lie in [0, 1], got {self.ema_decay}")
        if self.sharpen <= 0:
            raise ValueError(f"rscfed: sharpen must be > 0, got {self.sharpen}")
        if self.consistency_weight < 0 or self.max_grad_norm < 0:
            raise ValueError("rscfed: consistency_weight and max_grad_norm must be >= 0")


class RSCFedTrainer(WithMeanTeacher, LocalTrainer):
    """RSCFed at one site (both task types).

    Each step: the student (the model, starting from the received global model) sees view 1, the mean teacher
    view 2 (eval mode, no gradient). Loss = supervised + ``consistency_weight`` * distillation:

    - multi-label: masked BCE over the annotated entries + ``mean (sigmoid(s) - t)^2`` over the unannotated ones
      (FedMLP's multi-label RSCFed);
    - single-label: cross-entropy over all classes on the labelled rows + ``mean_rows sum_c (softmax(s) - t)^2``
      over the unlabelled rows (RSCFed's unlabelled clients; its labelled clients train the cross-entropy).

    ``t`` is the teacher's (sharpened, option ``sharpen``) probability. After every step the teacher moves to
    the student (EMA, decay ``min(1 - 1/(step+1), ema_decay)``). The teacher is site state kept across rounds
    (created from the first model the site trains, saved every round, restored by a fresh process), as the
    released code's ``ema_model``. A site annotating everything has no distillation term; a site annotating
    nothing (RSCFed's unlabelled clients) has no supervised term.

    Options: :class:`RSCFedOptions`.
    """

    Options = RSCFedOptions
    accepts_unlabelled = True

    def __init__(self, ctx: SiteContext, **options):
        super().__init__(ctx, **options)
        self.kind: Kind = "softmax" if ctx.task == "multiclass" else "sigmoid"
        self.mean_teacher = MeanTeacher("rscfed")  # kept across rounds as site state

    # -- pieces (public for tests) --------------------------------------------------------------------
    def unknown(self, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The unlabelled part of a batch: ``(B,)`` rows (single-label) or ``(B, C)`` entries (multi-label)."""
        return ~labelled_rows(labels, mask) if self.kind == "softmax" else ~mask.bool()

    def label_loss(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ce_labelled(logits, labels, mask) if self.kind == "softmax" else masked_bce(logits, labels, mask)

    def teacher_probs(self, x: torch.Tensor) -> torch.Tensor:
        """``(probabilities, sharpened)`` of the mean teacher on ``x`` (eval mode)."""
        with torch.no_grad():
            p = probabilities(self.ensure_teacher()(x), self.ctx.task).float()
        return p, sharpen(p, float(self.opts.sharpen), self.kind)

    def step(self, loss: torch.Tensor, read=None):
        """The step with the gradients clipped to ``max_grad_norm`` first (then ``read``, as the base's)."""
        if self.opts.max_grad_norm <= 0:
            return super().step(loss, read)

        def clip_then_read(optimizer):
            torch.nn.utils.clip_grad_norm_(
                [p for p in self.ctx.model.parameters() if p.requires_grad], max_norm=float(self.opts.max_grad_norm)
            )
            return read(optimizer) if read is not None else None

        return super().step(loss, clip_then_read)

    # -- the round ------------------------------------------------------------------------------------
    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        model = self.train_mode()
        self.ensure_teacher()
        self.make_optimizer()
        sums, steps = DeviceSums(), 0  # read once, after the round
        for b in self.batches({"image": self.opts.view, "image_2": self.opts.view}, round_num):
            out = model(b["image"])
            sup = self.label_loss(out, b["label"], b["mask"])
            p, t = self.teacher_probs(b["image_2"])
            unknown = self.unknown(b["label"], b["mask"])
            cons = consistency_loss(out, t, unknown, self.kind)
            loss = sup + self.opts.consistency_weight * cons
            self.step(loss)
            self.mean_teacher.update(model, self.opts.ema_decay)
            with torch.no_grad():
                if self.kind == "softmax":
                    confident = p.max(1).values >= CONFIDENT
                else:
                    confident = (p >= CONFIDENT) | (p <= 1 - CONFIDENT)
                sums.add(loss=loss, sup=sup, cons=cons, unknown=unknown, confident=confident & unknown)
            steps += 1
        got, s = sums.read(), max(steps, 1)
        n_unknown = int(got.get("unknown", 0))
        total = got.get("loss", 0.0)
        meta = {
            META_SUPERVISED: got.get("sup", 0.0) / s,
            META_CONSISTENCY: got.get("cons", 0.0) / s,
            META_UNLABELLED: n_unknown,
            META_CONFIDENT: int(got.get("confident", 0)) / max(n_unknown, 1),
        }
        return RoundOutput(steps=steps, loss=total / s, meta=meta)
