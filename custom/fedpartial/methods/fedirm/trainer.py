"""FedIRM's local trainer (labelled and unlabelled sites), and the switches that turn it into the paper's
baselines (labelled-only FedAvg, Fed-Consistency, Fed-SelfTraining)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ...data.views import ViewKind
from ...evaluation import probabilities
from ...losses import labelled_rows
from ...options import opt
from ...stat_checks import StatSpec
from ..base import ClassStat, LocalTrainer, RoundOutput, SiteContext, TrainerOptions
from ..common import DeviceSums, MeanTeacher, WithMeanTeacher, decay_dominated, frozen_copy, mc_dropout_probs
from .maths import (
    LN2,
    META_CONSISTENCY,
    META_DECAY,
    META_DISTANCE,
    META_GLOBAL_RELATION,
    META_GLOBAL_VALID,
    META_IRM,
    META_PSEUDO,
    META_RAMP,
    META_RECEIVED,
    META_RELATION,
    META_RELATION_VALID,
    META_SELECTED,
    Kind,
    average_relations,
    consistency_loss,
    rampup,
    relation_matrix,
    self_training_targets,
    supervised_loss,
    symmetric_kl,
    uncertainty_filter,
)

UnlabelledMode = Literal["mean_teacher", "self_training", "skip"]


@dataclass
class FedIRMOptions(TrainerOptions):
    """FedIRM's site options (method_args; paper defaults, the released code's values in the docs).

    Released code (liuquande/FedIRM at HEAD) behind the options below:

    - ``warm_rounds: 21``: ``train_main.py`` trains the unlabelled clients only when ``com_round * local_ep > 20``,
      i.e. from round 21 on (rounds 0-20, 21 rounds, are labelled-only).
    - learning rates per role: ``train_main.py`` sets the labelled clients' ``base_lr`` to 3e-4 when
      ``com_round * local_ep > 20`` (2e-4 before, ``options.py`` ``--base_lr``); ``local_unsupervised.py`` fixes the
      unlabelled clients' ``base_lr = 2e-4``: ``train.lr: 2e-4, labelled_lr_after_warm: 3e-4, warm_rounds: 21``.
      The paper gives no learning rate; the default is ``train.lr`` for both roles in every round.
    - the optimiser: ``train_main.py`` keeps each client's Adam state across rounds (``optim_locals``, passed to and
      returned by ``local.train``); the paper describes plain FedAvg local training, the default here builds a
      fresh Adam every round; ``train.keep_optimizer_state: true`` is the code's.
    - the pseudo label: the paper (``y^u = argmax(p^u)``, p^u the mini-batch's predicted probability) and
      ``local_unsupervised.py`` (``argmax(softmax(outputs))`` of the training pass) both take it from the training
      forward pass (the default, ``pseudo_label: forward``); ``pseudo_label: mc_mean`` takes it from the mean of the
      Monte-Carlo dropout passes.
    """

    unlabelled: UnlabelledMode = opt(
        "mean_teacher", "unlabelled sites: mean teacher (FedIRM, Fed-Consistency), self_training, or skip (sit out)"
    )
    irm: bool = opt(True, "inter-client relation matching at unlabelled sites (False: Fed-Consistency)")
    consistency: bool = opt(True, "the mean-teacher consistency loss L_c at unlabelled sites")
    warm_rounds: int = opt(0, "rounds in which only labelled sites train (released code: 21, rounds 0-20)")
    tau: float = opt(2.0, "temperature of the relation matrix (Eq. 3)")
    relation_average: Literal["batches", "code"] = opt(
        "batches", "labelled matrix: row c over the batches holding c, or all batches (code)"
    )
    unlabelled_rows: Literal["logits", "probs"] = opt(
        "logits", "unlabelled matrix from pre-softmax outputs (Eq. 2, code) or probabilities (Eq. 5 as printed)"
    )
    mc_passes: int = opt(8, "Monte-Carlo dropout passes T (code: 11)")
    entropy_threshold: float | None = opt(None, "h in nats; None: ln 2 (paper); code 2.0")
    ml_entropy_threshold: float = opt(0.5, "multi-label h per entry in nats (0.5 ~ binary entropy of 0.8)")
    min_confidence: float = opt(0.0, "also need max prob >= this (code: 0.3)")
    kl: Literal["paper", "code"] = opt("paper", "Eq. 6, or half of it (code's kd_loss)")
    loss_weight: float = opt(1.0, "factor of lambda(omega) (code: 15)")
    rampup_rounds: int = opt(30, "Omega of the Gaussian ramp-up (rounds)")
    ema_max_decay: float = opt(0.99, "mean teacher: decay min(1 - 1/(step + 1), this)")
    label_smoothing: float = opt(0.0, "labelled cross-entropy label smoothing (code: 0.1)")
    label_mode: Literal["auto", "argmax"] = opt(
        "auto", "multi-label data: sigmoid generalisation, or single-label softmax on argmax of the row (code's ICH)"
    )
    pseudo_threshold: float = opt(0.95, "Fed-SelfTraining: confidence of the received model's pseudo labels")
    view: ViewKind = opt("weak", "the two augmented views")
    pseudo_label: Literal["forward", "mc_mean"] = opt(
        "forward",
        "unlabelled pseudo label: argmax of the training forward pass (paper, code) or of the MC-dropout mean",
    )
    labelled_lr: float | None = opt(None, "labelled sites' learning rate in rounds < warm_rounds (None: train.lr)")
    labelled_lr_after_warm: float | None = opt(
        None, "labelled sites' learning rate from round warm_rounds on (None: labelled_lr; code: 3e-4)"
    )
    unlabelled_lr: float | None = opt(None, "unlabelled sites' learning rate (None: train.lr; code: 2e-4)")

    def __post_init__(self):
        if self.tau <= 0:
            raise ValueError(f"fedirm: tau must be > 0, got {self.tau}")
        if self.mc_passes < 1:
            raise ValueError(f"fedirm: mc_passes must be >= 1, got {self.mc_passes}")
        if not 0.0 <= self.ema_max_decay <= 1.0:
            raise ValueError(f"fedirm: ema_max_decay must lie in [0, 1], got {self.ema_max_decay}")
        if self.warm_rounds < 0 or self.rampup_rounds < 0:
            raise ValueError("fedirm: warm_rounds and rampup_rounds must be >= 0")
        for name in ("labelled_lr", "labelled_lr_after_warm", "unlabelled_lr"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"fedirm: {name} must be > 0, got {v}")


@torch.no_grad()
def teacher_forward(teacher: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(B, C)`` outputs of the mean teacher in training mode (dropout, batch statistics: Tarvainen & Valpola)
    without touching its running statistics, so the teacher stays the pure EMA of the student."""
    buffers = {k: b.clone() for k, b in teacher.named_buffers()}
    teacher.train()
    try:
        return teacher(x)
    finally:
        for k, b in teacher.named_buffers():
            b.copy_(buffers[k])


def _has_dropout(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


class FedIRMTrainer(WithMeanTeacher, LocalTrainer):
    """FedIRM at one site; labelled (annotates every class) or unlabelled (annotates none).

    - Labelled: ``L_ce`` on two augmented views (the model's dropout as a further perturbation); the relation
      matrix of the round (Eq. 2-3) from the first view's outputs, averaged over the round's batches, goes to
      the server in the round's meta.
    - Unlabelled (``unlabelled: mean_teacher``): a mean teacher kept across rounds as site state (initialised
      from the model the site first trains, EMA decay ``min(1 - 1/(step+1), 0.99)``, steps counted across rounds);
      ``L_u = w * lambda(omega) * (L_c + L_IRM)``: consistency between the student on view 1 and the teacher on
      view 2, and the symmetric KL between the received global matrix and the batch's matrix built from the
      student's outputs on the samples that pass the MC-dropout uncertainty filter (pseudo label = argmax of the
      training forward pass; ``pseudo_label: mc_mean``: of the MC mean).
      Before the first global matrix arrives, L_IRM is 0. In rounds ``< warm_rounds`` the site sits out (weight 0).
    - ``unlabelled: self_training``: cross-entropy on the received model's confident pseudo labels (weighted
      like L_u); ``skip``: unlabelled sites never train (labelled-only FedAvg).

    Options: :class:`FedIRMOptions`.
    """

    Options = FedIRMOptions
    per_class_metadata = (ClassStat(META_RELATION, "mean", "support", valid=META_RELATION_VALID, dp=False),)
    statistics = (
        StatSpec(META_RELATION, ("C", "C"), "float", 0.0, 1.0, needs=(META_RELATION_VALID,)),  # softmax / sigmoid rows
        StatSpec(META_RELATION_VALID, ("C",), "bool", needs=(META_RELATION,)),
    )
    accepts_unlabelled = True

    def __init__(self, ctx: SiteContext, **options):
        super().__init__(ctx, **options)
        annotated = np.asarray(ctx.annotated, dtype=bool)
        if annotated.any() and not annotated.all():
            missing = [c for c, a in zip(ctx.classes, annotated) if not a]
            raise ValueError(
                f"fedirm: site '{ctx.site}' annotates some classes but not {missing}; FedIRM's sites are "
                "either fully labelled or unlabelled (data protocol labeled_unlabeled)"
            )
        self.is_labelled = bool(annotated.any())
        self.kind: Kind = "softmax" if (ctx.task == "multiclass" or self.opts.label_mode == "argmax") else "sigmoid"
        self.method_task = "multiclass" if self.kind == "softmax" else "multilabel"
        self.mean_teacher = MeanTeacher("fedirm")  # kept across rounds as site state
        if (
            not self.is_labelled
            and self.opts.unlabelled == "mean_teacher"
            and self.opts.irm
            and self.opts.mc_passes > 1
            and not _has_dropout(ctx.model)
        ):
            raise ValueError(
                f"fedirm: site '{ctx.site}': the uncertainty filter needs dropout in the model "
                '(the paper: 0.2 on the pooled feature, model option "dropout": 0.2)'
            )

    # -- pieces (public for tests) --------------------------------------------------------------------
    @property
    def threshold(self) -> float:
        if self.kind == "sigmoid":
            return float(self.opts.ml_entropy_threshold)
        return LN2 if self.opts.entropy_threshold is None else float(self.opts.entropy_threshold)

    def learning_rate(self, round_num: int) -> float:
        """The site's learning rate this round: ``train.lr`` unless the role's option sets one."""
        base = float(self.ctx.train.lr)
        if not self.is_labelled:
            return base if self.opts.unlabelled_lr is None else float(self.opts.unlabelled_lr)
        lr = base if self.opts.labelled_lr is None else float(self.opts.labelled_lr)
        if round_num >= self.opts.warm_rounds and self.opts.labelled_lr_after_warm is not None:
            lr = float(self.opts.labelled_lr_after_warm)
        return lr

    def round_optimizer(self, round_num: int) -> torch.optim.Optimizer:
        """The round's optimiser (fresh, or the kept state with ``train.keep_optimizer_state``) at this round's
        learning rate (the released code also overrides a restored state's rate: ``param_group['lr'] = base_lr``)."""
        optimizer = self.make_optimizer()
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rate(round_num)
        return optimizer

    def loss_weight(self, round_num: int) -> float:
        """``loss_weight * lambda(omega)`` of the unlabelled loss."""
        return float(self.opts.loss_weight) * rampup(round_num, self.opts.rampup_rounds)

    def targets(self, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(targets (B, C), known)`` of a labelled batch: one-hot rows (argmax of the row under
        ``label_mode: argmax``; rows without a positive are not known) or multi-hot entries."""
        if self.kind == "softmax":
            known = labelled_rows(labels, mask)
            t = torch.nn.functional.one_hot(labels.argmax(1), labels.shape[1]).to(labels.dtype)
            return t * known[:, None].to(labels.dtype), known
        return labels * mask.to(labels.dtype), mask.bool()

    def received_relation(self, global_meta: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(M (C, C), valid (C,) bool)`` of the server, or None before the first one."""
        if META_GLOBAL_RELATION not in global_meta:
            return None
        m = torch.as_tensor(np.asarray(global_meta[META_GLOBAL_RELATION], dtype=np.float32))
        c = self.ctx.num_classes
        valid = torch.as_tensor(np.asarray(global_meta.get(META_GLOBAL_VALID, [1] * c), dtype=bool))
        if m.shape != (c, c):
            raise ValueError(f"fedirm: received a relation matrix of shape {tuple(m.shape)}, expected ({c}, {c})")
        return m.to(self.ctx.device), valid.to(self.ctx.device)

    def unlabelled_relation(
        self, x: torch.Tensor, outputs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's local matrix (Eq. 4-5): MC-dropout passes of the student, the uncertainty filter, then
        the relation matrix of the kept samples' outputs. Returns ``(M (C, C), counts (C,), kept)``."""
        passes = mc_dropout_probs(self.ctx.model, x, self.opts.mc_passes, self.method_task)
        conf = probabilities(outputs.detach(), self.method_task)
        source = conf if self.opts.pseudo_label == "forward" else None
        pseudo, kept, _ = uncertainty_filter(passes, self.threshold, self.kind, conf, self.opts.min_confidence, source)
        rows = outputs if self.opts.unlabelled_rows == "logits" else probabilities(outputs, self.method_task)
        m, counts = relation_matrix(rows, pseudo, self.opts.tau, self.kind)
        return m, counts, kept

    # -- the round ------------------------------------------------------------------------------------
    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        if self.is_labelled:
            return self._labelled_round(round_num)
        if self.opts.unlabelled == "skip" or round_num < self.opts.warm_rounds:
            return RoundOutput(steps=0, loss=0.0, weight=0.0)
        if self.opts.unlabelled == "self_training":
            return self._self_training_round(round_num)
        return self._mean_teacher_round(round_num, global_meta)

    def _views(self) -> dict[str, str]:
        return {"image": self.opts.view, "image_2": self.opts.view}

    def _labelled_round(self, round_num: int) -> RoundOutput:
        model = self.train_mode()
        self.round_optimizer(round_num)
        mats, counts = [], []  # per-batch matrices, kept on the device until the round ends
        sums, steps = DeviceSums(), 0
        for b in self.batches(self._views(), round_num):
            t, known = self.targets(b["label"], b["mask"])
            o1, o2 = model(b["image"]), model(b["image_2"])
            loss = supervised_loss(o1, t, known, self.kind, self.opts.label_smoothing) + supervised_loss(
                o2, t, known, self.kind, self.opts.label_smoothing
            )
            self.step(loss)
            with torch.no_grad():
                m, n = relation_matrix(o1.detach().float(), t.float(), self.opts.tau, self.kind)
            mats.append(m)
            counts.append(n)
            sums.add(loss=loss)
            steps += 1
        meta = {}
        if mats:
            m, valid = average_relations(mats, counts, self.opts.relation_average, self.kind)
            meta = {
                META_RELATION: m.cpu().numpy().astype(np.float64),
                META_RELATION_VALID: [int(v) for v in valid.cpu()],
            }
        return RoundOutput(steps=steps, loss=sums.read().get("loss", 0.0) / max(steps, 1), meta=meta)

    def _mean_teacher_round(self, round_num: int, global_meta: dict) -> RoundOutput:
        model = self.train_mode()
        teacher = self.ensure_teacher()
        self.round_optimizer(round_num)
        received = self.received_relation(global_meta) if self.opts.irm else None
        w = self.loss_weight(round_num)
        sums, steps = DeviceSums(), 0  # read once, after the round
        for b in self.batches(self._views(), round_num):
            out = model(b["image"])
            loss = out.sum() * 0.0
            if self.opts.consistency:
                t_out = teacher_forward(teacher, b["image_2"])
                c_loss = consistency_loss(out, t_out, self.kind)
                loss = loss + c_loss
                sums.add(consistency=c_loss)
            if received is not None:
                m, counts, kept = self.unlabelled_relation(b["image"], out)
                rows = (counts > 0) & received[1]
                i_loss = symmetric_kl(received[0], m, rows, self.kind, self.opts.kl)
                loss = loss + i_loss
                with torch.no_grad():
                    sums.add(irm=i_loss, distance=symmetric_kl(received[0], m.detach(), rows, self.kind), selected=kept)
            loss = w * loss
            if steps == 0:  # the round's first step, read before it is taken: how much of it is weight decay
                dominated = self.step(loss, decay_dominated)
            else:
                self.step(loss)
            self.mean_teacher.update(model, self.opts.ema_max_decay)
            sums.add(loss=loss)
            steps += 1
        got, s = sums.read(), max(steps, 1)
        meta = {
            META_RAMP: w,
            META_CONSISTENCY: got.get("consistency", 0.0) / s,
            META_RECEIVED: int(received is not None),
        }
        if steps:
            meta[META_DECAY] = dominated
        if received is not None:
            meta.update(
                {
                    META_SELECTED: int(got.get("selected", 0)),
                    META_IRM: got.get("irm", 0.0) / s,
                    META_DISTANCE: got.get("distance", 0.0) / s,
                }
            )
        return RoundOutput(steps=steps, loss=got.get("loss", 0.0) / s, meta=meta)

    def _self_training_round(self, round_num: int) -> RoundOutput:
        model = self.train_mode()
        reference = frozen_copy(model)  # the received global model labels the data
        self.round_optimizer(round_num)
        w = self.loss_weight(round_num)
        sums, steps = DeviceSums(), 0  # read once, after the round
        for b in self.batches(self._views(), round_num):
            with torch.no_grad():
                p = probabilities(reference(b["image"]), self.method_task)
            t, known = self_training_targets(p, self.opts.pseudo_threshold, self.kind)
            loss = w * supervised_loss(model(b["image_2"]), t, known, self.kind)
            self.step(loss)
            sums.add(loss=loss, used=known)
            steps += 1
        got = sums.read()
        return RoundOutput(
            steps=steps,
            loss=got.get("loss", 0.0) / max(steps, 1),
            meta={META_PSEUDO: int(got.get("used", 0)), META_RAMP: w},
        )
