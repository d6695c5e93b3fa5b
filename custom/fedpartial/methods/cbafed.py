"""CBAFed (Li, Li, Wang, "Class Balanced Adaptive Pseudo Labeling for Federated Semi-Supervised Learning", CVPR
2023; released code minglllli/CBAFed) for missing labels, as FedMLP (MICCAI 2024) compares with it: a site's
missing labels are its unlabelled part (FedMLP's released code has a multi-label version). Both task types.

The paper's three elements (its abstract) and how they are implemented here:

1. **Fixed pseudo labelling.** At the start of each round, after ``warmup_rounds`` supervised-only rounds, the
   received global model labels the site's unlabelled part once (one pass over the un-augmented images, eval
   mode) and the site trains on that fixed set all round. Single-label: an unlabelled row gets
   ``y^ = argmax_c p_c`` over the classes not known to be absent for that row (its unannotated classes) when
   ``p_y^ > tau_y^``. Multi-label (FedMLP's version): an unannotated entry (i, c) is a positive when
   ``p_ic > tau_c`` and a negative when ``p_ic < 1 - tau_c``.
2. **Class-balanced adaptive thresholds** from the empirical class distribution of all training data:
   every site sends its per-class counts ``n_c^k`` of labelled plus pseudo-labelled samples (single-label: rows of
   class c; multi-label: labelled and pseudo-labelled entries of class c, FedMLP's counts); the server sends back
   ``p_c = sum_k n_c^k / sum_{c', k} n_c'^k``; each site uses

       tau_c = min(max(p_c + tau_base - std(p), tau_min), tau_max)        (std with the unbiased 1/(C-1))

   (released code: ``tau_base`` 0.84, ``tau_max`` 0.95, 0.9 for its skin and SVHN runs; FedMLP's multi-label
   version: 0.45 and [0.55, 0.95], the defaults for multi-label tasks). A frequent class gets a stricter threshold.
   The round's thresholds are in the site's meta (``cbafed_tau``).
3. **Residual weight connection.** Global: every ``residual_every`` rounds (round r > 0, r % R == 0) the new
   aggregate is mixed with the residual model, ``w <- residual_weight * w + (1 - residual_weight) * w_res``, and
   becomes the new ``w_res`` (the code: R = 5, 0.5). ``w_res`` starts as the first aggregate (the released code
   starts from its supervised pre-trained model). FedMLP's version differs: during its warm-up it mixes 0.2 new /
   0.8 residual every 5 rounds, then resets ``w_res`` to the first aggregate after the warm-up and counts the
   5-round period from there; here one weight and the round number's period throughout. Local (the code's supervised training): after
   epoch ``e`` (0-based), ``w_res <- w`` when e = 0, and ``w <- local_residual_keep * w_res + (1 -
   local_residual_keep) * w; w_res <- w`` when e > 0 and e % ``local_residual_every`` == 0 (the code: every 5 of
   its 11 local epochs, 4:1). With one local epoch a round it never fires; with ``train.local_steps`` it is off.

Aggregation (``weighting: trained``, the released code): each site weighs by the samples it trained on this
round, ``sum_c n_c^k`` (labelled + pseudo-labelled rows, or entries for multi-label); ``samples``: n_k (FedAvg).
A site with nothing to train on (an unlabelled site in the warm-up, or without any pseudo label) sits the round
out (weight 0).

Losses: single-label, cross-entropy over all classes on the labelled and pseudo-labelled rows (mean); multi-label,
BCE over the annotated and pseudo-labelled entries (mean). Not reproduced: the code's "second class" pseudo labels
for classes below 3 % of the data and its ``C / 10`` scaling of ``p`` (neither is in the paper's description
available here), FedMLP's per-class positive weights and online (not fixed) multi-label pseudo labels, the
code's labelled-client up-weighting (``x 10`` on its skin runs) and its supervised pre-training (here the
``warmup_rounds``).

Counters in each round's site meta: ``cbafed_counts`` ``(C,)``, ``cbafed_trained``, ``cbafed_pseudo`` (pseudo
labels used), ``cbafed_pseudo_rate`` (of the unlabelled rows / unannotated entries), ``cbafed_pseudo_positives``
``(C,)`` (pseudo-label rows of each class / pseudo positives), ``cbafed_tau`` ``(C,)`` (the thresholds used; absent
in the warm-up), ``cbafed_local_residuals``; the server sends ``cbafed_class_share`` ``(C,)`` and
``cbafed_residual`` (1 in a round whose aggregate was mixed with the residual model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..data.views import ViewKind
from ..losses import labelled_rows, masked_bce, row_ce
from ..options import opt
from ..stat_checks import StatSpec
from .base import (
    ClassStat,
    Contribution,
    LocalTrainer,
    RoundOutput,
    RuleOptions,
    ServerRule,
    SiteContext,
    TrainerOptions,
)
from .common import DeviceSums, label_table, whole_set_pass

# site -> server
META_COUNTS = "cbafed_counts"  # (C,) labelled + pseudo-labelled rows (single-label) / entries (multi-label) per class
META_TRAINED = "cbafed_trained"  # sum of the counts: the samples trained on this round (aggregation weight)
META_PSEUDO = "cbafed_pseudo"  # pseudo labels used this round (rows / entries)
META_PSEUDO_RATE = "cbafed_pseudo_rate"  # pseudo / unlabelled rows (unannotated entries); 0 when there is none
META_PSEUDO_POSITIVES = "cbafed_pseudo_positives"  # (C,) pseudo-label rows per class / pseudo positives per class
META_TAU = "cbafed_tau"  # (C,) the class thresholds the site used this round
META_LOCAL_RESIDUALS = "cbafed_local_residuals"  # local residual connections applied this round
# server -> sites
META_SHARE = "cbafed_class_share"  # (C,) p_c, the federation's class distribution of the round's training data
META_RESIDUAL = "cbafed_residual"  # 1 when this round's aggregate was mixed with the residual model

DEFAULTS = {"multiclass": (0.84, 0.0), "multilabel": (0.45, 0.55)}  # (tau_base, tau_min) per task


# ------------------------------------------------------------------------------------------ maths


def class_thresholds(share: torch.Tensor, base: float, tau_min: float, tau_max: float) -> torch.Tensor:
    """``(C,)`` ``tau_c = clip(p_c + base - std(p), tau_min, tau_max)`` with the unbiased std (0 when C = 1)."""
    p = share.double()
    std = p.std(unbiased=True) if p.numel() > 1 else torch.zeros((), dtype=torch.float64)
    return (p + base - std).clamp(min=tau_min, max=tau_max).float()


def class_share(counts: torch.Tensor) -> torch.Tensor:
    """``(C,)`` ``p_c = n_c / sum n`` (uniform when every count is 0)."""
    counts = counts.double()
    total = float(counts.sum())
    return (counts / total if total > 0 else torch.full_like(counts, 1.0 / counts.numel())).float()


def multiclass_pseudo(
    probs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed single-label pseudo labels.

    Args:
        probs: ``(N, C)`` softmax of the received model; labels, mask: ``(N, C)``; tau: ``(C,)``.

    Returns:
        ``(targets (N, C) one-hot, known (N,))``: the labelled rows with their labels, the unlabelled rows whose
        best class among their unannotated ones has ``p > tau`` of that class with it; other rows zero / False.
    """
    lab = labelled_rows(labels, mask)
    candidates = ~mask.bool()
    q = probs.masked_fill(~candidates, -1.0)
    conf, y = q.max(1)
    pseudo = ~lab & candidates.any(1) & (conf > tau.to(probs.device)[y])
    y = torch.where(lab, (labels * mask.to(labels.dtype)).argmax(1), y)
    known = lab | pseudo
    return F.one_hot(y, probs.shape[1]).to(probs.dtype) * known[:, None].to(probs.dtype), known


def multilabel_pseudo(
    probs: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, tau: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed multi-label pseudo labels: an unannotated entry is 1 when ``p > tau_c``, 0 when ``p < 1 - tau_c``.

    Returns:
        ``(targets (N, C), known (N, C))``: the annotated entries with their labels plus the pseudo-labelled ones.
    """
    m = mask.bool()
    t = tau.to(probs.device)[None, :]
    pos, neg = ~m & (probs > t), ~m & (probs < 1 - t) & ~(probs > t)
    targets = torch.where(m, labels, pos.to(labels.dtype))
    return targets * (m | pos | neg).to(labels.dtype), m | pos | neg


def mix_states(
    new: dict[str, torch.Tensor], residual: dict[str, torch.Tensor], weight: float
) -> dict[str, torch.Tensor]:
    """``weight * new + (1 - weight) * residual`` for every floating-point entry; integer entries from ``new``."""
    return {
        k: (weight * v + (1.0 - weight) * residual[k].to(v.device, v.dtype))
        if torch.is_floating_point(v)
        else v.clone()
        for k, v in new.items()
    }


# ------------------------------------------------------------------------------------------ site


@dataclass
class CBAFedOptions(TrainerOptions):
    """CBAFed's site options (method_args)."""

    warmup_rounds: int = opt(5, "supervised-only rounds before pseudo labelling (the code pre-trains instead)")
    tau_base: float | None = opt(None, "threshold base (None: 0.84 single-label, the code; 0.45 multi-label, FedMLP's)")
    tau_min: float | None = opt(None, "threshold floor (None: 0 single-label; 0.55 multi-label, FedMLP's)")
    tau_max: float = opt(0.95, "threshold cap (code: 0.95; 0.9 for its skin / SVHN runs)")
    local_residual_every: int = opt(5, "local residual connection every this many epochs (0: off; code 5)")
    local_residual_keep: float = opt(0.8, "local residual: weight of the residual model (code 4:1 = 0.8)")
    view: ViewKind = opt("weak", "the training augmentation")

    def __post_init__(self):
        if self.warmup_rounds < 0 or self.local_residual_every < 0:
            raise ValueError("cbafed: warmup_rounds and local_residual_every must be >= 0")
        if not 0.0 <= self.local_residual_keep <= 1.0:
            raise ValueError(f"cbafed: local_residual_keep must lie in [0, 1], got {self.local_residual_keep}")


class CBAFedTrainer(LocalTrainer):
    """CBAFed at one site (module docstring). Options: :class:`CBAFedOptions`."""

    Options = CBAFedOptions
    per_class_metadata = (ClassStat(META_COUNTS, "count"), ClassStat(META_PSEUDO_POSITIVES, "count"))
    # the class share and the aggregation weights: rows (entries) per class within the site's images
    statistics = (
        StatSpec(META_COUNTS, ("C",), "float", 0.0, "n_train", required=True),
        StatSpec(META_PSEUDO_POSITIVES, ("C",), "float", 0.0, "n_train"),
        StatSpec(META_TRAINED, (), "float", 0.0, "C * n_train", required=True),
    )
    accepts_unlabelled = True

    def __init__(self, ctx: SiteContext, **options):
        super().__init__(ctx, **options)
        base, floor = DEFAULTS[ctx.task]
        self.tau_base = base if self.opts.tau_base is None else float(self.opts.tau_base)
        self.tau_min = floor if self.opts.tau_min is None else float(self.opts.tau_min)

    # -- pieces (public for tests) --------------------------------------------------------------------
    def thresholds(self, global_meta: dict, round_num: int) -> torch.Tensor | None:
        """``(C,)`` this round's thresholds from the server's class share, or None (warm-up, or no share yet)."""
        if round_num < self.opts.warmup_rounds or META_SHARE not in global_meta:
            return None
        share = torch.as_tensor(np.asarray(global_meta[META_SHARE], dtype=np.float64))
        if share.shape != (self.ctx.num_classes,):
            raise ValueError(
                f"cbafed: received a class share of shape {tuple(share.shape)}, expected ({self.ctx.num_classes},)"
            )
        return class_thresholds(share, self.tau_base, self.tau_min, float(self.opts.tau_max))

    def targets(
        self, labels: torch.Tensor, mask: torch.Tensor, probs: torch.Tensor | None, tau: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(targets (N, C), known)``: labels plus the fixed pseudo labels (none without ``tau``); ``known`` is
        ``(N,)`` rows (single-label) or ``(N, C)`` entries (multi-label)."""
        if self.ctx.task == "multiclass":
            if tau is None:
                lab = labelled_rows(labels, mask)
                return labels * mask.to(labels.dtype) * lab[:, None].to(labels.dtype), lab
            return multiclass_pseudo(probs, labels, mask, tau)
        if tau is None:
            return labels * mask.to(labels.dtype), mask.bool()
        return multilabel_pseudo(probs, labels, mask, tau)

    def class_counts(self, targets: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """``(C,)`` n_c: labelled + pseudo-labelled rows of class c (single-label) or entries of class c,
        positive or negative (multi-label)."""
        if self.ctx.task == "multiclass":
            return (targets * known[:, None].to(targets.dtype)).sum(0)
        return known.to(targets.dtype).sum(0)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """CE over the known rows (single-label) / BCE over the known entries (multi-label), mean."""
        if self.ctx.task == "multiclass":
            return row_ce(logits, targets.argmax(1), known.bool())
        return masked_bce(logits, targets, known)

    # -- the round ------------------------------------------------------------------------------------
    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        ctx = self.ctx
        labels, mask = label_table(ctx.data)
        n = labels.shape[0]
        tau = self.thresholds(global_meta, round_num)
        probs = None
        if tau is not None:  # fixed pseudo labels from the received model, once per round
            loader = self.loader({"image": "eval"}, shuffle=False, batch_size=self.inference_batch_size)
            probs = whole_set_pass(ctx.model, loader, n, ctx.task, ctx.device)[1]
        targets, known = self.targets(labels, mask, probs, tau)
        counts = self.class_counts(targets, known)
        base_known = labelled_rows(labels, mask) if ctx.task == "multiclass" else mask.bool()
        pseudo = known & ~base_known
        pseudo_cells = (pseudo[:, None] if pseudo.dim() == 1 else pseudo).to(targets.dtype)
        rate = float(pseudo.sum()) / max(int((~base_known).sum()), 1)
        meta = {
            META_COUNTS: counts.double().numpy(),
            META_TRAINED: float(counts.sum()),
            META_PSEUDO: int(pseudo.sum()),
            META_PSEUDO_RATE: rate,
            META_PSEUDO_POSITIVES: (targets * pseudo_cells).sum(0).double().numpy(),
            META_LOCAL_RESIDUALS: 0,
        }
        if tau is not None:
            meta[META_TAU] = tau.double().numpy()
        if float(counts.sum()) == 0:  # nothing to train on: sit the round out
            return RoundOutput(steps=0, loss=0.0, meta=meta, weight=0.0)

        model = self.train_mode()
        self.make_optimizer()
        dev = ctx.device
        targets, known = targets.to(dev), known.to(dev)
        views = {"image": self.opts.view}
        sums, steps, residuals = DeviceSums(), 0, 0  # the losses read once, after the round

        def train_on(batch) -> None:
            nonlocal steps
            idx = batch["index"].to(dev).long()
            loss = self.loss(model(batch["image"].to(dev)), targets[idx], known[idx])
            self.step(loss)
            sums.add(loss=loss)
            steps += 1

        if ctx.train.local_steps is not None:  # a fixed number of steps: no epochs, no local residual
            for batch in self.batches(views, round_num):
                train_on(batch)
        else:
            every, residual = int(self.opts.local_residual_every), None
            for epoch in range(max(ctx.train.local_epochs, 1)):
                for batch in self.loader(views, round_num=round_num * 1000 + epoch):
                    train_on(batch)
                if every > 0:
                    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    if epoch == 0:
                        residual = state
                    elif epoch % every == 0:
                        residual = mix_states(state, residual, 1.0 - float(self.opts.local_residual_keep))
                        model.load_state_dict(residual)
                        residuals += 1
        meta[META_LOCAL_RESIDUALS] = residuals
        return RoundOutput(steps=steps, loss=sums.read().get("loss", 0.0) / max(steps, 1), meta=meta)


# ------------------------------------------------------------------------------------------ server


@dataclass
class CBAFedRuleOptions(RuleOptions):
    """CBAFed's server options (method_args)."""

    weighting: Literal["trained", "samples"] = opt(
        "trained", "site weights: samples trained on this round (labelled + pseudo-labelled, the code) or n_k"
    )
    residual_every: int = opt(5, "global residual connection every this many rounds (0: off; code 5)")
    residual_weight: float = opt(0.5, "weight of the new aggregate in the residual mix (code 0.5)")

    def __post_init__(self):
        if self.residual_every < 0:
            raise ValueError(f"cbafed: residual_every must be >= 0, got {self.residual_every}")
        if not 0.0 <= self.residual_weight <= 1.0:
            raise ValueError(f"cbafed: residual_weight must lie in [0, 1], got {self.residual_weight}")


class CBAFedRule(ServerRule):
    """Class share of the round's training data (sent to the sites for their thresholds), FedAvg with the
    trained-sample weights, and the global residual weight connection (module docstring). The residual model is
    rule state (it survives a restart of the rule)."""

    Options = CBAFedRuleOptions

    def __init__(self, **options):
        super().__init__(**options)
        self.residual: dict[str, torch.Tensor] | None = None

    def site_weights(self, contributions: list[Contribution]) -> np.ndarray:
        if self.opts.weighting == "trained":
            trained = np.asarray([float(c.meta.get(META_TRAINED, 0.0)) for c in contributions])
            w = trained * np.asarray([c.weight for c in contributions], dtype=np.float64)
            if w.sum() > 0:
                return w
        return super().site_weights(contributions)

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        lacking = [c.site for c in contributions if META_COUNTS not in c.meta]
        if lacking:
            raise ValueError(f"cbafed: site(s) {lacking} sent no class counts '{META_COUNTS}' (not CBAFed trainers?)")
        counts = torch.as_tensor(np.sum([np.asarray(c.meta[META_COUNTS], np.float64) for c in contributions], 0))
        out = self.average(previous, contributions, groups)
        new = {k: torch.as_tensor(np.asarray(v)) for k, v in out.items()}
        mixed = 0
        if self.residual is None:
            self.residual = {k: v.clone() for k, v in new.items()}
        elif self.opts.residual_every > 0 and round_num > 0 and round_num % self.opts.residual_every == 0:
            new = mix_states(new, self.residual, float(self.opts.residual_weight))
            self.residual = {k: v.clone() for k, v in new.items()}
            out = {k: v.numpy().astype(np.asarray(out[k]).dtype) for k, v in new.items()}
            mixed = 1
        return out, {META_SHARE: class_share(counts).double().numpy(), META_RESIDUAL: mixed}

    def state_dict(self) -> dict:
        return {} if self.residual is None else {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        self.residual = state.get("residual")


def register_all(register) -> None:
    register(
        "cbafed",
        CBAFedTrainer,
        CBAFedRule,
        doc="CBAFed (Li et al., CVPR 2023): fixed pseudo labels, class-balanced thresholds, residual weights",
        job="cbafed_ich",
        comparison=True,
    )
