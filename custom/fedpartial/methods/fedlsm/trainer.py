"""FedLSM's local trainer: uncertainty pools, EMA-teacher pseudo labels, MixUp of confident and uncertain data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ...data.views import ViewKind
from ...evaluation import probabilities
from ...losses import ce_labelled, labelled_rows
from ...options import opt
from ...stat_checks import StatSpec
from ..base import ClassStat, LocalTrainer, RoundOutput, SiteContext, TrainerOptions, summary_counts
from ..common import DeviceSums, ema_update, frozen_copy, label_table, whole_set_pass
from .maths import (
    META_POOLS,
    META_PSEUDO,
    META_Q,
    META_UDE_PAIRS,
    mixup,
    multiclass_targets,
    multilabel_entropy,
    multilabel_targets,
    negative_positive_ratio,
    pool_sizes,
    pseudo_ce,
    soft_ce,
    softmax_entropy,
    split_pools,
    weighted_bce,
)


def _share(name: str, v: float) -> None:
    if not 0.0 <= float(v) <= 1.0:
        raise ValueError(f"fedlsm: {name} must lie in [0, 1], got {v}")


@dataclass
class FedLSMOptions(TrainerOptions):
    """FedLSM's site options (method_args; the paper's Table 4 defaults)."""

    tau: float = opt(0.95, "single-label threshold of the pseudo-label pool")
    tau_l: float = opt(0.85, "single-label threshold of the uncertain pool")
    tau_p: float = opt(0.85, "multi-label positive threshold (pseudo-label pool)")
    tau_n: float = opt(0.005, "multi-label negative threshold (pseudo-label pool; released code 0.01)")
    tau_lp: float = opt(0.7, "multi-label positive threshold (uncertain pool)")
    tau_ln: float = opt(0.01, "multi-label negative threshold (uncertain pool; released code 0.005)")
    n_uncertain: float = opt(0.05, "uncertain pool size: fraction (< 1) or count (>= 1)")
    n_confident: float = opt(0.2, "confident pool size: fraction (< 1) or count (>= 1)")
    n_mix: int = opt(4, "mixed samples per step (the batch holds batch_size - n_mix pseudo-pool samples)")
    alpha: float = opt(0.2, "MixUp Beta parameter")
    lam_ude: float = opt(0.1, "UDE loss weight")
    ema: float = opt(0.999, "teacher EMA decay")
    ue: bool = opt(True, "uncertainty estimation (False: pools drawn at random, same sizes)")
    ude: bool = opt(True, "uncertain data enhancing (False: no mixed samples)")
    restrict_unknown: bool = opt(True, "single-label pseudo labels only for classes in U_k (False: released code)")
    entropy: Literal["binary", "plogp"] = opt("binary", "multi-label uncertainty (plogp: released code)")
    class_weighting: Literal["positive", "entry", "none"] = opt(
        "positive",
        "FPSL class weights (negatives / positives over the annotated entries of all sites) on the "
        "positive term; 'entry': the released code, the whole entry weighted and every 0 counted as a negative "
        "(missing entries included); or none",
    )
    ude_weighting: Literal["none", "class"] = opt(
        "none",
        "L_UDE: BCE with the joint-confidence mask only (paper: 'cross-entropy'; released code), or "
        "class-weighted as L_I + L_U",
    )
    weak_view: ViewKind = opt(
        "flip",
        "the teacher's weak view: horizontal flip (paper Sec. 3, released code) or FedMLP's flip + "
        "rotation + translation",
    )
    q_counts: Literal["dataset", "seen"] = opt("dataset", "q_c^k over the whole local set or the batches seen (code)")

    def __post_init__(self):
        for name in ("tau", "tau_l", "tau_p", "tau_n", "tau_lp", "tau_ln", "ema"):
            _share(name, getattr(self, name))
        if self.alpha <= 0:
            raise ValueError(f"fedlsm: alpha must be > 0, got {self.alpha}")


class FedLSMTrainer(LocalTrainer):
    """FedLSM's local training (both tasks).

    Options: :class:`FedLSMOptions` (paper Table 4 defaults).
    The optimiser state persists across rounds (``train.keep_optimizer_state`` defaults to true here).
    Steps per round: ``train.local_steps`` if set, else ``local_epochs`` passes over the pseudo-label pool.
    """

    Options = FedLSMOptions
    per_class_metadata = (ClassStat(META_Q, "count"),)
    statistics = (StatSpec(META_Q, ("C",), "float", 0.0, "n_train", required=True),)  # AWPA's weights: q_c^k <= n_k

    @classmethod
    def declared_statistics(cls, opts) -> tuple[StatSpec, ...]:
        """``q_counts: seen`` counts over the batches trained (a class may be counted more often than the site has
        images): q is then only finite and non-negative."""
        if opts.q_counts == "seen":
            return (StatSpec(META_Q, ("C",), "float", 0.0, required=True),)
        return cls.statistics

    keep_optimizer_state = True

    def __init__(self, ctx: SiteContext, **options):
        super().__init__(ctx, **options)
        self.unknown = ~torch.as_tensor(np.asarray(ctx.annotated, dtype=bool))
        self._warned_summary = False

    # -- pieces (public for tests) --------------------------------------------------------------------
    def uncertainty(self, probs: torch.Tensor) -> torch.Tensor:
        """``(N,)`` UE scores of the received model's probabilities (Eq. 3 / the multi-label reading)."""
        if self.ctx.task == "multiclass":
            return softmax_entropy(probs)
        return multilabel_entropy(probs, self.unknown, self.opts.entropy)

    def targets(
        self, labels: torch.Tensor, mask: torch.Tensor, teacher_probs: torch.Tensor, uncertain: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(targets, known, pseudo)`` with the pseudo-pool thresholds or (``uncertain``) the lower ones;
        ``known`` / ``pseudo`` are ``(B,)`` rows for single-label, ``(B, C)`` entries for multi-label."""
        if self.ctx.task == "multiclass":
            unknown = self.unknown.to(teacher_probs.device) if self.opts.restrict_unknown else None
            t, lab, pseudo = multiclass_targets(
                labels, mask, teacher_probs, self.opts.tau_l if uncertain else self.opts.tau, unknown
            )
            return t, lab | pseudo, pseudo
        return multilabel_targets(
            labels,
            mask,
            teacher_probs,
            self.opts.tau_lp if uncertain else self.opts.tau_p,
            self.opts.tau_ln if uncertain else self.opts.tau_n,
        )

    def class_weights(self, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """``(C,)`` FPSL's negative / positive ratio per class from the server's data summary (all sites' labels);
        the site's own labels when no summary came (with a warning). None for single-label.

        ``class_weighting: positive`` counts the annotated negatives; ``entry`` (released code, which stores
        missing labels as 0) counts every 0 as a negative: ``(sum_k n_k - positives_c) / positives_c``, about
        ``K / |S_c|`` times larger for a class annotated at ``|S_c|`` of ``K`` sites.

        Args:
            labels, mask: ``(N, C)`` the site's labels and annotation mask (used without a summary).
        """
        if self.ctx.task == "multiclass" or self.opts.class_weighting == "none":
            return None
        every_zero = self.opts.class_weighting == "entry"
        if self.ctx.summary:
            pos, neg = summary_counts(self.ctx.summary, self.ctx.num_classes)
            if every_zero:
                sites = self.ctx.summary["sites"].values()
                if any("n_train" not in info for info in sites):
                    raise ValueError("fedlsm: class_weighting 'entry' needs every site's n_train in the data summary")
                neg = sum(float(info["n_train"]) for info in sites) - pos
        else:
            if not self._warned_summary:
                self.ctx.log.warning("fedlsm: no data summary received; class weights from the local labels")
                self._warned_summary = True
            m = torch.ones_like(mask, dtype=torch.float32) if every_zero else mask.float()
            pos, neg = (labels * m).sum(0), ((1 - labels) * m).sum(0)
        return negative_positive_ratio(pos, neg)

    def supervised_loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor,
        targets: torch.Tensor,
        known: torch.Tensor,
        pseudo: torch.Tensor,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """``L_I + L_U`` on the pseudo-pool batch."""
        if self.ctx.task == "multiclass":
            n_unlabelled = int((~labelled_rows(labels, mask)).sum())
            return ce_labelled(logits, labels, mask) + pseudo_ce(logits, targets, pseudo, n_unlabelled)
        return weighted_bce(logits, targets, known, weights, self.opts.class_weighting)

    def ude_loss(
        self, logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """``L_UDE`` on the mixed samples (cross-entropy with the soft labels): ``logits``, ``targets`` ``(M, C)``,
        ``known`` ``(M,)`` rows / ``(M, C)`` entries labelled on both sides (joint confidence); multi-label
        class weights ``(C,)`` only with ``ude_weighting: class``."""
        if self.ctx.task == "multiclass":
            return soft_ce(logits, targets, known)
        if self.opts.ude_weighting == "none":
            return weighted_bce(logits, targets, known, None, "none")
        return weighted_bce(logits, targets, known, weights, self.opts.class_weighting)

    def ude_batch(
        self,
        confident: dict,
        uncertain: dict,
        teacher_confident: torch.Tensor,
        teacher_uncertain: torch.Tensor,
        lam: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The mixed samples of Eq. 6 from a confident and an uncertain batch.

        The confident samples get their (pseudo) labels with the pseudo-pool thresholds, the uncertain ones with
        the lower thresholds (``tau_l`` / ``tau_lp``, ``tau_ln``); ``x~ = lam x_l + (1 - lam) x_h`` on the weak views,
        same for the labels; an entry (multi-label) or a row (single-label) counts where both sides have a label.

        Args:
            confident, uncertain: batches with ``"weak"`` ``(M, ...)``, ``"label"`` and ``"mask"`` ``(M, C)``;
            teacher_confident, teacher_uncertain: ``(M, C)`` teacher probabilities on those weak views; lam in [0, 1].

        Returns:
            ``(x~ (m, ...), y~ (m, C), known (m, C) or (m,))`` with ``m`` the smaller batch size.
        """
        yl, kl, _ = self.targets(confident["label"], confident["mask"], teacher_confident)
        yh, kh, _ = self.targets(uncertain["label"], uncertain["mask"], teacher_uncertain, uncertain=True)
        m = min(len(yl), len(yh))
        x_mix, y_mix = mixup(confident["weak"][:m], yl[:m], uncertain["weak"][:m], yh[:m], lam)
        return x_mix, y_mix, kl[:m] & kh[:m]

    def estimated_counts(
        self, labels: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, known: torch.Tensor
    ) -> torch.Tensor:
        """``q_c`` contribution of some samples: labelled positives plus pseudo-label positives, ``(C,)``."""
        pos = labels * mask.to(labels.dtype)
        if self.ctx.task == "multiclass":
            return (pos + targets * (known & ~labelled_rows(labels, mask))[:, None]).sum(0)
        return (pos + targets * (known & ~mask.bool())).sum(0)

    def teacher_rows(self, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B,)`` bool: the rows whose targets read the teacher's probabilities. Single-label: the unlabelled rows
        (a labelled row keeps its label, Eq. 4); multi-label: the rows with an entry the site does not annotate
        (an annotated entry keeps its label, Eq. 5). The teacher's outputs on the other rows are never read."""
        if self.ctx.task == "multiclass":
            return ~labelled_rows(labels, mask)
        return ~mask.bool().all(1)

    def teacher_probs(self, teacher: torch.nn.Module, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``(N, C)`` float32 probabilities of the teacher on the weak views ``x`` ``(N, ...)`` in the ``rows`` that
        read them (:meth:`teacher_rows`; ``(N,)`` bool on the host, from the site's label table: no wait on the
        device), zeros in the others (never read).

        The teacher runs in eval mode: a row's output does not depend on the other rows of its batch, so only the
        rows read go through it (no pass when none does; at a single-label site most rows are labelled). A batch
        of one runs other kernels than a larger batch (last-bit differences), so a lone row goes with a second."""
        if bool(rows.all()):
            return probabilities(teacher(x), self.ctx.task).float()
        out = torch.zeros(x.shape[0], self.ctx.num_classes, device=x.device)
        read = rows.nonzero().squeeze(1)
        if len(read) == 0:
            return out
        run = read if len(read) > 1 else torch.cat([read, (~rows).nonzero()[:1, 0]])
        run = run.to(x.device, non_blocking=True)
        p = probabilities(teacher(x.index_select(0, run)), self.ctx.task).float()
        return out.index_copy_(0, run[: len(read)], p[: len(read)])

    # -- the round ------------------------------------------------------------------------------------
    def _received_probs(self, n: int) -> torch.Tensor:
        """``(N, C)`` probabilities of the received global model on every local image (eval view, eval mode)."""
        loader = self.loader({"image": "eval"}, shuffle=False, batch_size=self.inference_batch_size)
        return whole_set_pass(self.ctx.model, loader, n, self.ctx.task, self.ctx.device)[1]

    def _num_steps(self, pool: int, per_step: int) -> int:
        steps = self.ctx.train.local_steps
        if steps is not None:
            return int(steps)
        return max(1, self.ctx.train.local_epochs) * max(1, math.ceil(pool / max(per_step, 1)))

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        ctx, model, dev = self.ctx, self.ctx.model, self.ctx.device
        labels, mask = label_table(ctx.data)
        n = labels.shape[0]
        gen = torch.Generator().manual_seed(ctx.seed * 100003 + round_num)

        # UE with the received global model over all local images
        probs = self._received_probs(n)
        scores = self.uncertainty(probs) if self.opts.ue else torch.rand(n, generator=gen)
        n_h, n_l = pool_sizes(n, self.opts.n_uncertain, self.opts.n_confident)
        confident, medium, uncertain = split_pools(scores, n_h, n_l)
        pseudo_pool = torch.cat([confident, medium])
        use_ude = self.opts.ude and self.opts.n_mix > 0 and len(confident) > 0 and len(uncertain) > 0
        n_mix = self.opts.n_mix if use_ude else 0
        per_step = max(1, ctx.train.batch_size - n_mix)
        weights = self.class_weights(labels, mask)
        weights = None if weights is None else weights.to(dev)

        q = torch.zeros(ctx.num_classes)
        if self.opts.q_counts == "dataset":  # q_c^k over all n_k images, pseudo labels of the round's teacher (Eq. 7)
            t, known, _ = self.targets(labels, mask, probs)
            q = self.estimated_counts(labels, mask, t, known)

        teacher = frozen_copy(model)
        fetch = self.fetcher(
            {"weak": self.opts.weak_view, "strong": "strong"}, int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        )

        self.train_mode()
        self.make_optimizer()
        order, pos = pseudo_pool[torch.randperm(len(pseudo_pool), generator=gen)], 0
        beta = torch.distributions.Beta(self.opts.alpha, self.opts.alpha)  # MixUp's lambda, one draw per step
        sums, steps = DeviceSums(), 0  # loss, counts and q on the device, read once after the round
        q_seen = None
        for _ in range(self._num_steps(len(pseudo_pool), per_step) if len(pseudo_pool) else 0):
            if pos >= len(order):  # a fresh permutation of the pool (never the same replay every round)
                order, pos = pseudo_pool[torch.randperm(len(pseudo_pool), generator=gen)], 0
            idx = order[pos : pos + per_step]
            pos += per_step
            b = fetch(idx)
            weak = [b["weak"]]
            rows = [idx]
            if n_mix:  # the mixed samples need the weak view only (their strong views: drawn, never made)
                rows += [
                    confident[torch.randperm(len(confident), generator=gen)[:n_mix]],
                    uncertain[torch.randperm(len(uncertain), generator=gen)[:n_mix]],
                ]
                bl, bh = fetch(rows[1], keys=("weak",)), fetch(rows[2], keys=("weak",))
                weak += [bl["weak"], bh["weak"]]
            read = torch.cat(rows)  # the rows of the teacher's batch, in the site's (host) label table
            with torch.no_grad():
                tp = self.teacher_probs(teacher, torch.cat(weak), self.teacher_rows(labels[read], mask[read]))
            B = len(idx)
            y, known, pseudo = self.targets(b["label"], b["mask"], tp[:B])
            inputs = [b["strong"]]
            if n_mix:
                m = min(len(bl["weak"]), len(bh["weak"]))
                lam = float(beta.sample()) if m else 0.0
                x_mix, y_mix, k_mix = self.ude_batch(
                    bl, bh, tp[B : B + len(bl["weak"])], tp[B + len(bl["weak"]) :], lam
                )
                inputs.append(x_mix)
                sums.add(pairs=k_mix.any(1) if k_mix.dim() == 2 else k_mix)
            out = model(torch.cat(inputs))
            loss = self.supervised_loss(out[:B], b["label"], b["mask"], y, known, pseudo, weights)
            if n_mix:
                loss = loss + self.opts.lam_ude * self.ude_loss(out[B:], y_mix, k_mix, weights)
            self.step(loss)
            ema_update(teacher, model, self.opts.ema)
            sums.add(loss=loss)
            steps += 1
            sums.add(pseudo=pseudo)
            if self.opts.q_counts == "seen":
                q_seen = self.estimated_counts(b["label"], b["mask"], y, known) + (0 if q_seen is None else q_seen)
        del teacher
        if q_seen is not None:
            q = q + q_seen.cpu()
        read = sums.read()
        meta = {
            META_Q: q.numpy().astype(np.float64),
            META_POOLS: [len(confident), len(medium), len(uncertain)],
            META_PSEUDO: int(read.get("pseudo", 0)),
            META_UDE_PAIRS: int(read.get("pairs", 0)),
        }
        return RoundOutput(steps=steps, loss=read.get("loss", 0.0) / max(steps, 1), meta=meta)
