"""FedNoRo's local trainer: LA loss in the warm-up and at clean sites, LA blended with distillation from the
received global model at noisy sites, and the per-class loss vector for the server's noisy-site detection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ...losses import masked_bce
from ...options import opt
from ...stat_checks import StatSpec
from ..base import ClassStat
from ..baselines import SupervisedOptions, SupervisedTrainer
from ..common import DeviceSums, frozen_copy, label_table, whole_set_pass
from .maths import (
    META_CLASS_COUNT,
    META_CLASS_LOSS,
    META_CLEAN_SITES,
    META_KD_WEIGHT,
    META_LOSS_KD,
    META_LOSS_LA,
    META_NOISY,
    META_NOISY_SITES,
    META_STAGE,
    class_mean_losses,
    class_sample_counts,
    kd_loss,
    kd_loss_code,
    kd_rampup,
    la_adjustment,
    la_loss,
)


@dataclass
class FedNoRoOptions(SupervisedOptions):
    """FedNoRo's site options (method_args); defaults of the released code (wnn2000/FedNoRo) for 100 rounds."""

    missing: Literal["negatives", "partial"] = opt(
        "negatives",
        "multi-label: unannotated entries are labels 0 (the noisy-label reading: FedMLP's 'missing "
        "positives mislabelled as negative') or left out of L_LA and of the detection losses",
    )
    all_noisy: bool = opt(False, "every site noisy from round 0, no warm-up and no detection (FedMLP's comparison)")
    warmup_rounds: int = opt(
        10,
        "stage-1 rounds (LA for every site); the detection uses the global model received in round warmup_rounds - 1",
    )
    tau: float = opt(1.0, "logit-adjustment temperature (0: plain CE / BCE)")
    kd_temperature: float = opt(0.8, "softening T of the teacher's outputs")
    kd_weight: float = opt(0.8, "maximum lambda of (1 - lambda) L_LA + lambda L_KD (the released code's 'a')")
    ramp_begin: int = opt(10, "round where lambda starts ramping up (before: kd_weight * e^-5)")
    ramp_end: int = opt(49, "round where lambda reaches kd_weight (FedMLP's runs: num_rounds - 1)")
    kd_entries: Literal["all", "missing"] = opt(
        "all", "multi-label entries distilled: every entry, or only the site's unannotated classes (FedMLP's code)"
    )
    parity: Literal["paper", "code"] = opt(
        "paper",
        "multi-label: 'code' = FedMLP's released adaptation (plain BCE on the annotated entries, no logit "
        "adjustment, KD = squared difference of sigmoid outputs on the unannotated entries); single-label: no effect",
    )

    def __post_init__(self):
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")
        if not self.all_noisy and self.warmup_rounds < 1:
            raise ValueError("warmup_rounds must be >= 1 for the noisy-site detection (or set all_noisy: true)")
        if self.ramp_end <= self.ramp_begin:
            raise ValueError(f"ramp_end ({self.ramp_end}) must be > ramp_begin ({self.ramp_begin})")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ValueError(f"kd_weight must lie in [0, 1], got {self.kd_weight}")
        if self.kd_temperature <= 0:
            raise ValueError(f"kd_temperature must be > 0, got {self.kd_temperature}")


class FedNoRoTrainer(SupervisedTrainer):
    """FedNoRo at a site (both task types).

    Each round: stage 1 (``round < warmup_rounds``) trains ``L_LA``; from round ``warmup_rounds - 1`` until the
    server's verdict arrives the site also sends :data:`~.maths.META_CLASS_LOSS`, the per-class mean loss of the
    received global model on its training set (eval view). Stage 2: a site the server lists as clean trains
    ``L_LA``; any other site (listed noisy, or no verdict received) trains ``(1 - lambda) L_LA + lambda L_KD``
    with the received model as a frozen teacher and ``lambda`` from :func:`~.maths.kd_rampup`. ``all_noisy``:
    stage 2 from round 0 with every site noisy.

    Options: :class:`FedNoRoOptions`. Counters per round: ``fednoro_stage``, ``fednoro_noisy``,
    ``fednoro_kd_weight``, ``fednoro_loss_la``, ``fednoro_loss_kd`` (and ``fednoro_class_loss`` with
    ``fednoro_class_count``, the samples behind each entry, when sent).
    """

    Options = FedNoRoOptions
    per_class_metadata = (
        ClassStat(META_CLASS_COUNT, "count"),
        ClassStat(META_CLASS_LOSS, "mean", META_CLASS_COUNT, dp=False, fill=float("nan")),
    )
    # the detection's input: mean losses (>= 0; NaN for a class without a sample), counts within the site's images
    statistics = (
        StatSpec(
            META_CLASS_LOSS, ("C",), "float", 0.0, 1e6, nan_where_zero=META_CLASS_COUNT, needs=(META_CLASS_COUNT,)
        ),
        StatSpec(META_CLASS_COUNT, ("C",), "float", 0.0, "n_train"),
    )

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.teacher: torch.nn.Module | None = None
        self.lam = 0.0
        self.adjustment: torch.Tensor | None = None

    # -- pieces (public for tests) --------------------------------------------------------------------
    @property
    def code_ml(self) -> bool:
        """FedMLP's released multi-label adaptation is in use."""
        return self.opts.parity == "code" and self.ctx.task == "multilabel"

    def role(self, round_num: int, global_meta: dict) -> tuple[int, bool]:
        """``(stage, noisy)`` of this site in the round, from the options and the server's verdict."""
        if self.opts.all_noisy:
            return 2, True
        if round_num < self.opts.warmup_rounds:
            return 1, False
        clean = global_meta.get(META_CLEAN_SITES)
        if clean is None:
            self.ctx.log.warning(
                f"fednoro: round {round_num} is in stage 2 but no noisy-site verdict was received; "
                "training as a noisy site"
            )
            return 2, True
        return 2, self.ctx.site not in set(clean)

    def should_detect(self, round_num: int, global_meta: dict) -> bool:
        """Send the per-class loss vector: from the last warm-up round until a verdict arrives."""
        if self.opts.all_noisy or round_num < self.opts.warmup_rounds - 1:
            return False
        return global_meta.get(META_CLEAN_SITES) is None and global_meta.get(META_NOISY_SITES) is None

    def class_losses(self) -> torch.Tensor:
        """``(C,)`` per-class mean loss of the model as it is now (the received one) on the training set."""
        labels, mask = self._label_table()
        n = labels.shape[0]
        loader = self.loader({"image": "eval"}, shuffle=False, batch_size=self.inference_batch_size)
        _, probs = whole_set_pass(self.ctx.model, loader, n, self.ctx.task, self.ctx.device)
        return class_mean_losses(probs, labels, mask, self.ctx.task, self.opts.missing)

    def label_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """``(1 - lambda) L_LA`` (``lambda`` = 0 unless the site distils this round)."""
        if self.code_ml:
            la = masked_bce(logits, batch["label"], batch["mask"])
        else:
            la = la_loss(logits, batch["label"], batch["mask"], self.adjustment, self.ctx.task, self.opts.missing)
        self._sums.add(la=la)
        return (1.0 - self.lam) * la

    def extra_loss(self, batch: dict, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor | None:
        """``lambda L_KD`` against the frozen received model (None when not distilling)."""
        if self.teacher is None or self.lam <= 0:
            return None
        with torch.no_grad():
            t = self.teacher(batch["image"])
        unannotated = ~batch["mask"].bool()
        if self.code_ml:
            kd = kd_loss_code(logits, t, unannotated, self.opts.kd_temperature)
        else:
            entries = unannotated if (self.ctx.task == "multilabel" and self.opts.kd_entries == "missing") else None
            kd = kd_loss(logits, t, self.adjustment, self.ctx.task, self.opts.kd_temperature, entries)
        self._sums.add(kd=kd)
        return self.lam * kd

    # -- the round ------------------------------------------------------------------------------------
    def _label_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._table is None:
            self._table = label_table(self.ctx.data)
        return self._table

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict):
        gm = global_meta or {}
        meta: dict = {}
        if self.should_detect(round_num, gm):  # the received global model, before any local step
            labels, mask = self._label_table()
            meta[META_CLASS_LOSS] = [float(v) for v in self.class_losses()]
            meta[META_CLASS_COUNT] = class_sample_counts(labels, mask, self.ctx.task, self.opts.missing).tolist()
        stage, noisy = self.role(round_num, gm)
        self.lam = kd_rampup(round_num, self.opts.ramp_begin, self.opts.ramp_end, self.opts.kd_weight) if noisy else 0.0
        labels, mask = self._label_table()
        tau = 0.0 if self.code_ml else self.opts.tau
        self.adjustment = la_adjustment(labels, mask, self.ctx.task, tau).to(self.ctx.device)
        self.teacher = frozen_copy(self.ctx.model) if self.lam > 0 else None
        self._sums = DeviceSums()  # L_LA and L_KD per step, on the device, read once after the round
        try:
            out = super().train_round(round_num, num_rounds, global_meta)
        finally:
            self.teacher = None
        steps, sums = max(out.steps, 1), self._sums.read()
        meta.update(
            {
                META_STAGE: stage,
                META_NOISY: int(noisy),
                META_KD_WEIGHT: self.lam,
                META_LOSS_LA: sums.get("la", 0.0) / steps,
                META_LOSS_KD: sums.get("kd", 0.0) / steps,
            }
        )
        out.meta.update(meta)
        return out
