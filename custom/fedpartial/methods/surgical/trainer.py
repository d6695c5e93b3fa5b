"""Surgical aggregation's local trainer: the local warm-up in the site's first round, then plain supervised
training on the site's own classes (partial BCE). Subclasses: PFL (``keep_local: ['classifier']`` only, same
class) and the individually trained baseline (:class:`IndividualTrainer`: the site keeps its whole model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ...losses import supervised_loss
from ...options import opt
from ...stat_checks import StatSpec
from ..base import RoundOutput
from ..baselines import SupervisedOptions, SupervisedTrainer
from .maths import estimate_norm_statistics, freeze_for_warmup, has_norm_layers, head_modules, local_bce

META_WARMUP = "surgical_warmup"  # site -> server: this update is the site's warm-up (epochs run, best epoch)
META_NORM_FROM_WARMUP = "surgical_norm_from_warmup"  # site -> server: its norm statistics were estimated in it


@dataclass
class SurgicalOptions(SupervisedOptions):
    """Options of the surgical-aggregation family's local trainer."""

    warmup_epochs: int = opt(15, "local warm-up epochs in the site's first round (0: none)")
    warmup_lr: float = opt(5e-3, "Adam learning rate of the warm-up (paper 5e-3; the released code 1e-3)")
    warmup_train: list[Literal["head", "classifier"]] = opt(
        ["head", "classifier"],
        "what the warm-up trains with the representation frozen: the fully connected head (the paper's task "
        "block, the released code) or only the last layer (['classifier'])",
    )


class SurgicalTrainer(SupervisedTrainer):
    """Round 0 (the site's first round) is the local warm-up; every later round is one pass of supervised
    training (``train.local_epochs`` / ``local_steps``) under the ``norm`` strategy.

    Warm-up: the representation (``encoder`` and ``norm`` parameters) frozen, ``warmup_train`` trained with a
    fresh Adam (``warmup_lr``) for ``warmup_epochs`` epochs on the partial BCE; after each epoch the local
    validation loss (:func:`~.maths.local_bce`, BCE over the site's own classes) is computed when the site has
    validation data, and the best epoch's weights are kept (else the last epoch's). Without pretrained weights
    (``model.pretrained`` empty) the BatchNorm statistics are first re-estimated over the site's training images
    (one pass, exact average): FedBN+ then freezes them (the server averages them once, see
    :class:`~.rule.SurgicalRule`); with pretrained weights they stay the pretrained ones (the paper's FedBN+).
    """

    Options = SurgicalOptions
    # the warm-up round's flag the server reads (norm statistics averaged once); [epochs run, best epoch]
    statistics = (StatSpec(META_NORM_FROM_WARMUP, (), "bool"), StatSpec(META_WARMUP, (2,), "int", 0.0))
    tasks = ("multilabel",)

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        self.warmed_up = False
        self.warmup_best_epoch = -1

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        if not self.warmed_up and self.opts.warmup_epochs > 0:
            out = self.warm_up(round_num)
            self.warmed_up = True
            return out
        self.warmed_up = True
        return super().train_round(round_num, num_rounds, global_meta)

    # -- the warm-up ------------------------------------------------------------------------------------
    def _has_val(self) -> bool:
        m = (getattr(self.ctx.data, "manifests", None) or {}).get("val")
        return m is not None and len(m) > 0 and bool((m.mask & self.ctx.annotated[None, :]).any())

    def warm_up(self, round_num: int) -> RoundOutput:
        model, device = self.ctx.model, self.ctx.device
        groups = model.parameter_groups()
        estimate = not getattr(model, "pretrained", None) and has_norm_layers(model)
        if estimate:
            loader = self.ctx.data.train_loader({"image": "eval"}, self.inference_batch_size, shuffle=False)
            estimate_norm_statistics(model, (b["image"].to(device) for b in loader))
        names = freeze_for_warmup(model, groups, self.opts.warmup_train)
        params = [p for n, p in model.named_parameters() if n in set(names)]
        optimizer = torch.optim.Adam(params, lr=self.opts.warmup_lr)
        loss_fn = self._loss_fn()
        has_val = self._has_val()
        val_loader = self.ctx.data.eval_loader("val", self.inference_batch_size) if has_val else None
        best_loss, best_epoch, best_state = math.inf, -1, None
        total, steps, val_losses = 0.0, 0, []
        try:
            for epoch in range(self.opts.warmup_epochs):
                model.eval()
                for m in head_modules(model):
                    m.train()
                for batch in self.loader({"image": self.opts.view}, round_num=round_num * 1000 + epoch):
                    logits = model(batch["image"].to(device))
                    loss = loss_fn(logits, batch["label"].to(device), batch["mask"].to(device))
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    total += float(loss.detach())
                    steps += 1
                if val_loader is not None:
                    v = local_bce(model, val_loader, self.ctx.annotated, device)
                    val_losses.append(v)
                    if v is not None and v < best_loss:
                        best_loss, best_epoch = v, epoch
                        best_state = {k: t.detach().clone() for k, t in model.state_dict().items() if k in set(names)}
            if best_state is not None:
                model.load_state_dict({**model.state_dict(), **best_state})
            else:
                best_epoch = self.opts.warmup_epochs - 1
        finally:
            for p in model.parameters():  # the later rounds' norm strategy decides again (train_mode)
                p.requires_grad_(True)
        self.warmup_best_epoch = best_epoch
        self.ctx.log.info(
            f"site {self.ctx.site}: warm-up {self.opts.warmup_epochs} epochs of {sorted(self.opts.warmup_train)}"
            f" (representation frozen), kept epoch {best_epoch + 1}"
            + (f" (local val BCE {best_loss:.4f})" if has_val else " (no val data: the last epoch)")
        )
        meta = {META_WARMUP: [self.opts.warmup_epochs, best_epoch + 1], META_NORM_FROM_WARMUP: bool(estimate)}
        if val_losses:
            meta["surgical_warmup_val_bce"] = [float("nan") if v is None else v for v in val_losses]
        return RoundOutput(steps=steps, loss=total / max(steps, 1), meta=meta)

    def _loss_fn(self):
        return supervised_loss(self.ctx.task, self.opts.missing)

    # -- persistence --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {**super().state_dict(), "warmed_up": self.warmed_up, "warmup_best_epoch": self.warmup_best_epoch}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.warmed_up = bool(state.get("warmed_up", False))
        self.warmup_best_epoch = int(state.get("warmup_best_epoch", -1))


class IndividualTrainer(SurgicalTrainer):
    """The individually trained baseline: each site trains its own model on its own classes and never takes
    anything from the server (every tensor is local once the site has trained; the first round starts from the
    common initial model). The server's average is recorded but used by nobody; each site's validation and test
    numbers are its own model's (read per class over the sites annotating the class: ``own_classes`` in
    ``results.json``). Registered with ``norm: average`` (BatchNorm trains after the warm-up, the paper's
    "standard deep learning"); ``norm: frozen`` freezes it as the released ``src/local.py``."""

    keeps_all_local = True
