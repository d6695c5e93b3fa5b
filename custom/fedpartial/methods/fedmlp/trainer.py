"""FedMLP's local trainer: two stages, prototypes and learning degrees to the server, pseudo labels kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ...data.views import ViewKind
from ...losses import masked_bce
from ...options import opt
from ...privacy import clip_rows
from ...stat_checks import StatSpec
from ..base import ClassStat, LocalTrainer, RoundOutput, SiteContext, TrainerOptions
from ..common import DeviceSums, frozen_copy, label_table, whole_set_pass
from .maths import (
    META_COUNTS,
    META_DEGREE,
    META_GLOBAL_DEGREE,
    META_GLOBAL_P0,
    META_GLOBAL_P1,
    META_GLOBAL_VALID,
    META_P0,
    META_P1,
    accumulate_pseudo_labels,
    candidate_counts,
    class_prototypes,
    class_rates,
    consistency_loss,
    learning_degree,
    prevalence_rates,
    prototype_scores,
    schedule_share,
    select_top,
    selection_counts,
    selection_ratios,
    summary_rates,
    wpc_loss,
)

Parity = Literal["paper", "code"]
PROTOTYPE_MAX_NORM = 1e4  # bound on the L2 norm of a prototype row the server accepts
STATE_PSEUDO_LABELS = (
    "fedmlp_pseudo_labels"  # site state: (N, C) int8 permanent pseudo labels (read by fedpartial.tools.tag_audit)
)
STATE_PSEUDO_LABEL_CARRY = "fedmlp_pseudo_label_carry"  # site state: (2, C) float64 fractional pseudo-label counts carried (pseudo_label_rounding)


@dataclass
class FedMLPOptions(TrainerOptions):
    """FedMLP's site options (method_args). ``la_tau`` is the logit-adjustment temperature; ``tau0`` / ``tau1``
    (the paper's selection ratios) are not options but computed each round from ``T0`` / ``T1`` and the learning
    degree."""

    RENAMED: ClassVar[dict[str, str]] = {"tau": "la_tau", "tag_rounding": "pseudo_label_rounding"}

    warmup_rounds: int = opt(
        50, "stage-1 rounds t1 (prototypes sent from warmup_rounds - 1, pseudo labels from warmup_rounds)"
    )
    L: float = opt(0.3, "lower confidence bound of the learning degree (Eq. 10)")
    R: float = opt(0.7, "upper confidence bound of the learning degree (Eq. 10)")
    T0: float = opt(0.005, "base share of negative candidates pseudo-labelled per round (Eq. 8)")
    T1: float = opt(0.01, "base share of positive candidates pseudo-labelled per round (Eq. 9)")
    la_tau: float = opt(1.0, "logit-adjustment temperature (Eq. 2-3); 0 disables it")
    mld: bool = opt(True, "missing-label detection (stage-2 pseudo labels)")
    wpc: bool = opt(
        True,
        "weighted-partial-class loss + logit adjustment; False = Eq. 1 BCE with missing entries without a pseudo label as 0 "
        "(either parity)",
    )
    cr: bool = opt(True, "consistency to the received global model on missing entries without a pseudo label")
    cr_warmup: bool | None = opt(
        None,
        "CR during the warm-up too; None: no for parity paper (Sec. 2.2: stage 1 is "
        "L_WPC alone), yes for parity code (released code)",
    )
    cr_weight: float = opt(1.0, "weight of the CR term")
    st: bool = opt(True, "self-adaptive threshold tau = d_c^G * T; False = fixed T0 / T1")
    pseudo_label_rounding: Literal["floor", "carry"] = opt(
        "floor",
        "tau * #candidates rounded down every round (the released code: no pseudo label where tau * "
        "#candidates < 1), or rounded down with the fractional part carried to the next round (a small site still "
        "pseudo-labels tau of its candidates on average; measured worse on small sites: jobs/fedmlp_ich/README.md)",
    )
    T_rounds: int | None = opt(
        None,
        "stage-2 rounds T0 / T1 are meant for (the paper: 450 = 500 - 50); a job "
        "with fewer rounds pseudo-labels the same total share: T' = 1 - (1 - T)^(T_rounds / its "
        "stage-2 rounds); None: T0 / T1 per round as given",
    )
    global_rates: bool = opt(False, "class rates of Eq. 3 from the data summary (all sites) instead of the site's")
    missing_rates: Literal["prevalence", "pseudo_labels"] = opt(
        "prevalence",
        "Eq. 3 rates of missing classes: prevalence (data summary, else (positive pseudo labels + 1) / "
        "(N + 2)) or positive / all pseudo labels (a ratio set by T1 / T0)",
    )
    loss_balance: Literal["eq4", "per_term"] = opt(
        "eq4",
        "eq4: WPC sums the labelled entries / C (Eq. 4, the paper), CR a mean over its entries; per_term: "
        "each term the mean over its own entries (released code). Measured: jobs/fedmlp_ich/README.md",
    )
    parity: Parity = opt("paper", "'code': the released code's loss, fixed T, no stage-2 CR, one stage-2 view")
    feature_view: ViewKind | None = opt(None, "view of the feature pass (None: eval, weak for parity code)")

    def __post_init__(self):
        if not 0.0 <= self.L <= self.R <= 1.0:
            raise ValueError(f"need 0 <= L <= R <= 1, got L={self.L}, R={self.R}")
        for name in ("T0", "T1"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a share in [0, 1], got {getattr(self, name)}")


class FedMLPTrainer(LocalTrainer):
    """FedMLP's local training (multi-label only).

    Options: :class:`FedMLPOptions`.
    """

    Options = FedMLPOptions
    per_class_metadata = (
        ClassStat(META_COUNTS, "count"),
        ClassStat(META_P0, "mean", META_COUNTS, 0),
        ClassStat(META_P1, "mean", META_COUNTS, 1),
    )
    # prototypes: means of pooled features (norm bound: far above any trained network's, below float overflow)
    statistics = (
        StatSpec(META_P0, ("C", "D"), max_row_norm=PROTOTYPE_MAX_NORM, needs=(META_P1, META_COUNTS, META_DEGREE)),
        StatSpec(META_P1, ("C", "D"), max_row_norm=PROTOTYPE_MAX_NORM, needs=(META_P0, META_COUNTS, META_DEGREE)),
        StatSpec(META_COUNTS, ("C", 2), "float", 0.0, "n_train"),
        StatSpec(META_DEGREE, ("C",), "float", 0.0, 1.0),
    )
    tasks = ("multilabel",)

    def __init__(self, ctx: SiteContext, **options):
        super().__init__(ctx, **options)
        self.feature_view = self.opts.feature_view or ("weak" if self.opts.parity == "code" else "eval")
        self.annotated = torch.as_tensor(np.asarray(ctx.annotated, dtype=bool))
        self.pseudo_labels: torch.Tensor | None = None  # (N, C) int8: -1 none, 0 / 1 permanent pseudo labels
        self.pseudo_label_carry: torch.Tensor | None = (
            None  # (2, C) float64: fractional pseudo-label counts carried (pseudo_label_rounding)
        )
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._warned_rates = False

    # -- pieces (public for tests) --------------------------------------------------------------------
    @property
    def adaptive(self) -> bool:
        return self.opts.st and self.opts.parity == "paper"

    @property
    def cr_warmup(self) -> bool:
        """CR in stage 1: the option, else the paper (no) or the released code (yes) by ``parity``."""
        return self.opts.parity == "code" if self.opts.cr_warmup is None else bool(self.opts.cr_warmup)

    def use_cr(self, stage2: bool) -> bool:
        if not self.opts.cr:
            return False
        return (self.opts.parity == "paper") if stage2 else self.cr_warmup

    def supervised_loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        label_mask: torch.Tensor,
        pi1: torch.Tensor | None,
        pi0: torch.Tensor | None,
    ) -> torch.Tensor:
        """The supervised term on (annotated + pseudo) labels for the configured variant.

        Args:
            logits, labels: ``(B, C)``; label_mask: ``(B, C)`` bool (annotated + pseudo-labelled entries);
            pi1, pi0: ``(C,)`` rates of Eq. 3 (unused by ``parity: code`` and ``wpc: false``).
        """
        if (
            not self.opts.wpc
        ):  # Eq. 1 (Table 3 without WPC): every class, missing entries without a pseudo label as negatives
            return F.binary_cross_entropy_with_logits(logits, labels * label_mask.to(labels.dtype))
        if self.opts.parity == "code":
            return masked_bce(logits, labels, label_mask)
        reduction = "classes" if self.opts.loss_balance == "eq4" else "entries"
        return wpc_loss(logits, labels, label_mask, pi1, pi0, self.opts.la_tau, reduction)

    def rates(self, labels: torch.Tensor, label_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pi1 (C,), pi0 (C,))`` for Eq. 3 ("the sample proportion of class c").

        Args:
            labels: ``(N, C)`` annotated labels with the pseudo labels written into the missing columns;
            label_mask: ``(N, C)`` bool, annotated or pseudo-labelled entries.

        Annotated classes: the share of positives among the site's annotated entries (or the data summary's
        global rate with ``global_rates``). Missing classes (``missing_rates: prevalence``): the data summary's
        global rate (positives / annotated entries over the sites annotating c), else the site's own estimate
        ``(positive pseudo labels + 1) / (N + 2)``; ``missing_rates: pseudo_labels``: positives among the
        pseudo-labelled entries.
        """
        C = self.ctx.num_classes
        summary = self.ctx.summary
        if (
            (self.opts.global_rates or self.opts.missing_rates == "prevalence")
            and not summary
            and not self._warned_rates
        ):
            self.ctx.log.warning(
                "fedmlp: no data summary received; Eq. 3 rates from the site's own labels / pseudo labels"
            )
            self._warned_rates = True
        if self.opts.global_rates and summary:
            return summary_rates(summary, C)
        pi1, _ = class_rates(labels, label_mask)
        if self.opts.missing_rates == "prevalence":
            missing = ~self.annotated.to(pi1.device)
            if summary:
                prev1, _ = summary_rates(summary, C)
            else:
                prev1, _ = prevalence_rates((labels * label_mask.to(labels.dtype)).sum(0), labels.shape[0])
            pi1 = torch.where(missing, prev1.to(pi1), pi1)
        return pi1, 1 - pi1

    # -- data helpers ---------------------------------------------------------------------------------
    def _label_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._table is None:
            self._table = label_table(self.ctx.data)
        return self._table

    def _ensure_pseudo_labels(self, n: int) -> None:
        C = self.ctx.num_classes
        if self.pseudo_labels is None or tuple(self.pseudo_labels.shape) != (n, C):
            if self.pseudo_labels is not None:
                self.ctx.log.warning(
                    f"fedmlp: stored pseudo labels have shape {tuple(self.pseudo_labels.shape)}, the "
                    f"training set is ({n}, {C}); starting from no pseudo labels"
                )
            self.pseudo_labels = torch.full((n, C), -1, dtype=torch.int8)

    def _features(self, model: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features (N, D), probs (N, C))`` of every training sample (row-index order), model in eval mode."""
        loader = self.loader({"image": self.feature_view}, shuffle=False, batch_size=self.inference_batch_size)
        return whole_set_pass(model, loader, n, "multilabel", self.ctx.device, features=True)

    # -- the round ------------------------------------------------------------------------------------
    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        model = self.ctx.model
        stage2 = round_num >= self.opts.warmup_rounds
        use_cr = self.use_cr(stage2)
        received_model = frozen_copy(model) if use_cr or (stage2 and self.opts.mld) else None  # frozen, as received
        labels, mask = self._label_table()
        n = labels.shape[0]
        self._ensure_pseudo_labels(n)
        meta: dict = {"fedmlp_stage": 2 if stage2 else 1}
        if stage2 and self.opts.mld:
            meta.update(
                self._pseudo_label_missing(received_model, global_meta or {}, n, num_rounds - self.opts.warmup_rounds)
            )

        has_pseudo = self.pseudo_labels >= 0
        eff_mask = mask | has_pseudo
        eff_labels = torch.where(
            mask, labels, torch.where(has_pseudo, self.pseudo_labels.float(), torch.zeros_like(labels))
        )
        pi1, pi0 = self.rates(eff_labels, eff_mask)
        pi1, pi0 = pi1.to(self.ctx.device), pi0.to(self.ctx.device)
        use_cr = use_cr and not bool(eff_mask.all())  # (host tables) some entry is neither annotated nor tagged
        one_view = stage2 and self.opts.parity == "code"
        views = {"image": "weak"} if one_view else {"image": "weak", "image_2": "weak"}

        self.train_mode()
        self.make_optimizer()
        sums, steps = DeviceSums(), 0  # read once, after the round
        pseudo_dev = self.pseudo_labels.to(self.ctx.device)
        for batch in self.batches(views, round_num):
            idx = batch["index"].long()
            m = batch["mask"].bool()
            t = pseudo_dev[idx]
            tg = (t >= 0) & ~m
            y = torch.where(
                m, batch["label"].float(), torch.where(tg, t.float(), torch.zeros_like(batch["label"].float()))
            )
            lab = m | tg
            cr_mask = ~lab
            targets = None
            if use_cr:  # the frozen received model (eval mode) on every view in one forward pass (an empty mask
                # gives a 0 term: asking the device whether it is empty would make the host wait every step)
                with torch.no_grad():
                    targets = torch.sigmoid(received_model(torch.cat([batch[k] for k in views]))).chunk(len(views))
            losses = []
            for i, key in enumerate(views):
                logits = model(batch[key])
                loss = self.supervised_loss(logits, y, lab, pi1, pi0)
                if targets is not None:
                    loss = loss + self.opts.cr_weight * consistency_loss(torch.sigmoid(logits), targets[i], cr_mask)
                losses.append(loss)
            loss = torch.stack(losses).mean()
            self.step(loss)
            sums.add(loss=loss)
            steps += 1
        del received_model

        if round_num >= self.opts.warmup_rounds - 1:
            meta.update(self._local_statistics(model, labels, mask, n))
        meta["fedmlp_pseudo_negatives"] = (self.pseudo_labels == 0).sum(0).tolist()
        meta["fedmlp_pseudo_positives"] = (self.pseudo_labels == 1).sum(0).tolist()
        return RoundOutput(steps=steps, loss=sums.read().get("loss", 0.0) / max(steps, 1), meta=meta)

    def _pseudo_label_missing(
        self, received_model: torch.nn.Module, global_meta: dict, n: int, stage2_rounds: int
    ) -> dict:
        """Stage-2 missing-label detection with the received global model's features (Eq. 7-9)."""
        if META_GLOBAL_P0 not in global_meta:
            self.ctx.log.warning("fedmlp: stage 2 but no global prototypes received; no pseudo labels this round")
            return {"fedmlp_new_pseudo": 0}
        p0 = torch.as_tensor(np.asarray(global_meta[META_GLOBAL_P0]), dtype=torch.float32)
        p1 = torch.as_tensor(np.asarray(global_meta[META_GLOBAL_P1]), dtype=torch.float32)
        valid = torch.as_tensor(
            np.asarray(global_meta.get(META_GLOBAL_VALID, np.ones((p0.shape[0], 2), bool)), dtype=bool)
        )
        degree = torch.as_tensor(
            np.asarray(global_meta.get(META_GLOBAL_DEGREE, np.ones(p0.shape[0])), dtype=np.float64)
        )
        usable = ~self.annotated & valid.all(dim=1)
        got = {"fedmlp_received_prototypes": int(valid.all(dim=1).sum())}  # classes with both P0 and P1
        if not bool(usable.any()):
            return {"fedmlp_new_pseudo": 0, **got}
        feats, _ = self._features(received_model, n)
        if feats.shape[1] != p0.shape[1]:
            raise ValueError(f"fedmlp: global prototypes have dimension {p0.shape[1]}, features {feats.shape[1]}")
        z = prototype_scores(feats, p0, p1)
        T0, T1 = (schedule_share(T, self.opts.T_rounds, stage2_rounds) for T in (self.opts.T0, self.opts.T1))
        tau0, tau1 = selection_ratios(degree, T0, T1, adaptive=self.adaptive)
        tau0, tau1 = tau0 * usable, tau1 * usable
        carry = None
        if self.opts.pseudo_label_rounding == "carry":
            old = self.pseudo_label_carry
            carry = (
                old
                if old is not None and old.shape == (2, z.shape[1])
                else torch.zeros(2, z.shape[1], dtype=torch.float64)
            )
        k0, k1, carry = selection_counts(*candidate_counts(z, self.pseudo_labels >= 0), tau0, tau1, carry)
        if self.opts.pseudo_label_rounding == "carry":
            self.pseudo_label_carry = carry
        neg, pos = select_top(z, self.pseudo_labels >= 0, k0, k1)
        before = int((self.pseudo_labels >= 0).sum())
        self.pseudo_labels = accumulate_pseudo_labels(self.pseudo_labels, neg & usable, pos & usable)
        return {
            "fedmlp_new_pseudo": int((self.pseudo_labels >= 0).sum()) - before,
            "fedmlp_tau0": tau0.tolist(),
            "fedmlp_tau1": tau1.tolist(),
            **got,
        }

    def _local_statistics(self, model: torch.nn.Module, labels: torch.Tensor, mask: torch.Tensor, n: int) -> dict:
        """Local prototypes of the active classes (Eq. 5) and learning degrees (Eq. 10) with the trained model."""
        feats, probs = self._features(model, n)
        feats = clip_rows(feats, self.ctx.privacy.get("feature_clip"))  # the site's DP bound (none by default)
        active_mask = mask & self.annotated[None, :]
        p0, p1, counts = class_prototypes(feats, labels, active_mask)
        degree = learning_degree(probs, self.opts.L, self.opts.R)
        return {
            META_P0: p0.numpy().astype(np.float32),
            META_P1: p1.numpy().astype(np.float32),
            META_COUNTS: counts.numpy().astype(np.int64),
            META_DEGREE: degree.numpy().astype(np.float64),
        }

    # -- persistence ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.pseudo_labels is not None:
            state[STATE_PSEUDO_LABELS] = self.pseudo_labels.clone().cpu()
        if self.pseudo_label_carry is not None:
            state[STATE_PSEUDO_LABEL_CARRY] = self.pseudo_label_carry.clone().cpu()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        pseudo = state.get(STATE_PSEUDO_LABELS)
        self.pseudo_labels = None if pseudo is None else torch.as_tensor(pseudo, dtype=torch.int8).clone()
        carry = state.get(STATE_PSEUDO_LABEL_CARRY)
        self.pseudo_label_carry = None if carry is None else torch.as_tensor(carry, dtype=torch.float64).clone()
