"""FedMLP (Sun et al., "FedMLP: Federated Multi-Label Medical Image Classification under Task Heterogeneity",
MICCAI 2024) as a (LocalTrainer, ServerRule) pair.

Two stages at every site k (active classes AC_k = annotated, negative classes NC_k = missing):

- Stage 1 (rounds ``< warmup_rounds``): weighted-partial-class loss (Eq. 4) on logit-adjusted outputs (Eq. 3)
  over the active classes, on two weak views, plus (``cr``) the MSE between the local and the frozen received
  global model's sigmoid outputs on the missing entries (consistency regularisation, Sec. 2.4).
- End of the warm-up and of every later round: local dual prototypes of the active classes (Eq. 5) and the
  learning degree of the missing classes (Eq. 10, left) go to the server in the round's meta.
- Server: FedAvg of the weights (n_k), global prototypes over the sites that annotate each class (Eq. 6),
  global learning degree over the sites where the class is missing (Eq. 10, right); both travel back.
- Stage 2: with the received global model's features, Z = cos(P0, F) - cos(P1, F) (Eq. 7) for every missing
  class; among the samples not yet tagged for that class, the top ``tau0`` share of the negative candidates
  (Z >= 0, largest Z) are tagged 0 and the top ``tau1`` share of the positive candidates (Z < 0, smallest Z)
  are tagged 1 (Eq. 8-9) with ``tau = d_c^G * T`` (self-adaptive threshold, Sec. 2.3.3). Tags are permanent
  and accumulate in the trainer state. Training: WPC over active + pseudo-labelled entries, MSE to the
  global model on missing entries without a pseudo label.

``parity="code"`` reproduces the released code (szbonaldo/FedMLP) where it departs from the paper: plain
masked BCE (mean over labelled entries, no logit adjustment), fixed selection fractions T0 / T1 (no learning
degree), no consistency term in stage 2 and one view in stage 2, features on a weak view, and (server, if the
rule also gets ``parity: code``) n_k-weighted prototype averaging.

Readings of the paper (see also the docstrings of each function):

- Eq. 3 is the binary form of logit adjustment: ``sigmoid(l)*pi1 / (sigmoid(l)*pi1 + (1-sigmoid(l))*pi0)
  == sigmoid(l + log pi1 - log pi0)``; the temperature generalises it as ``l + tau*(log pi1 - log pi0)``.
- Eq. 4 sums over the labelled entries of a sample and divides by C (all classes), then averages the samples.
- Eq. 8-9: the shares are of the *residual* candidates (samples not yet tagged for the class), rounded down.
- Eq. 10: ``d_c^k`` is defined for missing classes, so ``d_c^G`` averages (|D_k|-weighted) over the sites where
  c is missing (the printed ``k in S_c`` would be the annotating sites, where d_c^k is undefined; the released
  code averages over the missing sites too); 1 where no site misses c.
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..aggregation import aggregate_states
from ..losses import masked_bce
from .base import Contribution, LocalTrainer, RoundOutput, ServerRule, SiteContext, summary_counts

# site -> server
META_P0 = "fedmlp_p0"  # (C, D) float32: local negative prototypes (rows of missing classes are 0)
META_P1 = "fedmlp_p1"  # (C, D) float32: local positive prototypes
META_COUNTS = "fedmlp_proto_counts"  # (C, 2) int64: samples behind P0 / P1
META_DEGREE = "fedmlp_degree"  # (C,) float64: local learning degree d_c^k (meaningful for missing classes)
# server -> sites
META_GLOBAL_P0 = "fedmlp_global_p0"  # (C, D) float32
META_GLOBAL_P1 = "fedmlp_global_p1"  # (C, D) float32
META_GLOBAL_VALID = "fedmlp_global_valid"  # list of C [bool, bool]: P0 / P1 of class c are defined
META_GLOBAL_DEGREE = "fedmlp_global_degree"  # list of C floats: d_c^G

PARITIES = ("paper", "code")
_RATE_EPS = 1e-4


# ------------------------------------------------------------------------------------------ pure functions

def class_rates(labels: torch.Tensor, label_mask: torch.Tensor, eps: float = _RATE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Class positive / negative rates ``pi_{c,1}``, ``pi_{c,0} = 1 - pi_{c,1}`` used by Eq. 3.

    Args:
        labels: ``(N, C)`` 0/1 targets.
        label_mask: ``(N, C)`` bool, entries that carry a label (annotated or pseudo).

    Returns:
        ``(pi1 (C,), pi0 (C,))``: share of positives among the labelled entries of each class, 0.5 (no
        adjustment) for a class without labelled entries, clamped to ``[eps, 1 - eps]``.
    """
    m = label_mask.float()
    n = m.sum(0)
    pos = (labels.float() * m).sum(0)
    pi1 = torch.where(n > 0, pos / n.clamp_min(1.0), torch.full_like(n, 0.5)).clamp(eps, 1 - eps)
    return pi1, 1 - pi1


def summary_rates(summary: dict, num_classes: int, eps: float = _RATE_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Global class rates from the server's data summary (``{"sites": {site: {"positives", "negatives"}}}``):
    ``pi_{c,1} = sum_k pos_{k,c} / sum_k (pos_{k,c} + neg_{k,c})`` over the sites' annotated entries."""
    pos, neg = summary_counts(summary, num_classes)
    n = pos + neg
    pi1 = torch.where(n > 0, pos / n.clamp_min(1.0), torch.full_like(n, 0.5)).clamp(eps, 1 - eps).float()
    return pi1, 1 - pi1


def logit_adjust(logits: torch.Tensor, pi1: torch.Tensor, pi0: torch.Tensor | None = None,
                 tau: float = 1.0) -> torch.Tensor:
    """Multi-label logit adjustment (Eq. 3, generalising Eq. 2).

    Eq. 3 ``y' = y*pi1 / (y*pi1 + (1-y)*pi0)`` with ``y = sigmoid(l)`` equals ``sigmoid(l + log pi1 - log pi0)``;
    with a temperature: ``l' = l + tau * (log pi1 - log pi0)`` (``tau = 1`` is Eq. 3 exactly, 0 disables it).

    Args:
        logits: ``(B, C)``; pi1, pi0: ``(C,)`` positive / negative rates (``pi0`` defaults to ``1 - pi1``).

    Returns:
        ``(B, C)`` adjusted logits (use them in the training loss only; predictions use the raw logits).
    """
    pi1 = torch.as_tensor(pi1, dtype=logits.dtype, device=logits.device)
    pi0 = 1 - pi1 if pi0 is None else torch.as_tensor(pi0, dtype=logits.dtype, device=logits.device)
    return logits + tau * (torch.log(pi1) - torch.log(pi0))


def wpc_loss(logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor,
             pi1: torch.Tensor | None = None, pi0: torch.Tensor | None = None, tau: float = 1.0) -> torch.Tensor:
    """Weighted-partial-class loss (Eq. 4) on logit-adjusted outputs (Eq. 3).

    ``L_i = -(1/C) sum_{j labelled} [y_ij log y'_ij + (1 - y_ij) log(1 - y'_ij)]``, averaged over the batch.
    "Labelled" = the active classes (Eq. 4) plus, in stage 2, the pseudo-labelled entries (Sec. 2.4). The
    division by C (not by the number of labelled classes) is the "weight" of the partial-class loss.

    Args:
        logits: ``(B, C)`` raw logits; labels: ``(B, C)`` 0/1; label_mask: ``(B, C)`` bool.
        pi1, pi0: ``(C,)`` class rates for Eq. 3; None = no adjustment.

    Returns:
        scalar loss.
    """
    z = logits if pi1 is None else logit_adjust(logits, pi1, pi0, tau)
    per = F.binary_cross_entropy_with_logits(z, labels.to(z.dtype), reduction="none")
    return (per * label_mask.to(z.dtype)).sum(dim=1).div(logits.shape[1]).mean()


def consistency_loss(p_local: torch.Tensor, p_global: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Consistency regularisation (Sec. 2.4): mean squared difference between the local and the global model's
    probabilities over the masked entries (missing classes without a pseudo label); 0 (with gradient) if none.

    Args:
        p_local, p_global: ``(B, C)`` sigmoid outputs (``p_global`` is a constant target); mask: ``(B, C)`` bool.
    """
    m = mask.to(p_local.dtype)
    return ((p_local - p_global.detach()) ** 2 * m).sum() / m.sum().clamp_min(1.0)


def class_prototypes(features: torch.Tensor, labels: torch.Tensor,
                     label_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local dual prototypes (Eq. 5): ``P_n^c = mean of F_i over the samples with y_ic = n`` (n in {0, 1}).

    Args:
        features: ``(N, D)``; labels: ``(N, C)`` 0/1; label_mask: ``(N, C)`` bool, the entries to use (the
            site's annotated entries of its active classes).

    Returns:
        ``(P0 (C, D), P1 (C, D), counts (C, 2) int64)``; a prototype with no sample is a zero row (count 0).
    """
    f = features.float()
    m = label_mask.float()
    y = labels.float()
    w1 = y * m  # (N, C)
    w0 = (1 - y) * m
    c1, c0 = w1.sum(0), w0.sum(0)
    p1 = (w1.t() @ f) / c1.clamp_min(1.0)[:, None]
    p0 = (w0.t() @ f) / c0.clamp_min(1.0)[:, None]
    counts = torch.stack([c0, c1], dim=1).round().long()
    return p0, p1, counts


def aggregate_prototypes(p0: torch.Tensor, p1: torch.Tensor, counts: torch.Tensor, annotated: torch.Tensor,
                         site_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global prototypes (Eq. 6): ``P_n^c = sum_{i in S_c} a_i P_n^{i,c} / sum_{i in S_c} a_i``.

    S_c = the sites that annotate class c; a site whose prototype ``P_n^{i,c}`` has no sample (count 0) is left
    out of that prototype (it is undefined there). ``a_i = 1`` is the paper (``1/|S_c|``);
    ``site_weights = n_k`` is the released code.

    Args:
        p0, p1: ``(K, C, D)`` local prototypes; counts: ``(K, C, 2)``; annotated: ``(K, C)`` bool;
        site_weights: ``(K,)`` or None (uniform).

    Returns:
        ``(P0 (C, D), P1 (C, D), valid (C, 2) bool)``; rows with no contributing site are 0 and not valid.
    """
    K = p0.shape[0]
    a = torch.ones(K, dtype=torch.float64) if site_weights is None else torch.as_tensor(site_weights, dtype=torch.float64)
    out, valid = [], []
    for n, p in enumerate((p0, p1)):
        w = annotated.to(torch.float64) * (counts[..., n] > 0).to(torch.float64) * a[:, None]  # (K, C)
        total = w.sum(0)
        agg = torch.einsum("kc,kcd->cd", w, p.to(torch.float64)) / total.clamp_min(1e-12)[:, None]
        out.append(torch.where(total[:, None] > 0, agg, torch.zeros_like(agg)).to(p.dtype))
        valid.append(total > 0)
    return out[0], out[1], torch.stack(valid, dim=1)


def prototype_scores(features: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """Prototype confidence (Eq. 7): ``Z_ic = cos(P0^c, F_i) - cos(P1^c, F_i)``; Z < 0 leans positive.

    Args:
        features: ``(N, D)``; p0, p1: ``(C, D)`` global prototypes.

    Returns:
        ``(N, C)`` scores in [-2, 2].
    """
    f = F.normalize(features.float(), dim=1, eps=1e-12)
    return f @ F.normalize(p0.float(), dim=1, eps=1e-12).t() - f @ F.normalize(p1.float(), dim=1, eps=1e-12).t()


def select_pseudo_labels(scores: torch.Tensor, already_tagged: torch.Tensor, tau0: float | torch.Tensor,
                         tau1: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Missing-label detection (Eq. 8-9) on the residual pool of each class.

    For column c, among the samples not yet tagged: the negative candidates (``Z >= 0``) and the positive
    candidates (``Z < 0``); ``floor(tau0_c * #negative candidates)`` of the largest Z become negatives and
    ``floor(tau1_c * #positive candidates)`` of the smallest Z become positives. Ties keep the lower index.

    Args:
        scores: ``(N,)`` or ``(N, C)`` Z scores (NaN = never selected).
        already_tagged: same shape, bool: samples tagged in earlier rounds (excluded, "residual samples").
        tau0, tau1: shares in [0, 1], scalars or ``(C,)`` (a 0 share selects nothing for that class).

    Returns:
        ``(new_negatives, new_positives)``: bool masks of the shape of ``scores``.
    """
    z = scores if scores.dim() == 2 else scores[:, None]
    tagged = (already_tagged if already_tagged.dim() == 2 else already_tagged[:, None]).bool()
    C = z.shape[1]
    t0 = torch.as_tensor(tau0, dtype=torch.float64).expand(C)
    t1 = torch.as_tensor(tau1, dtype=torch.float64).expand(C)
    neg = torch.zeros_like(tagged)
    pos = torch.zeros_like(tagged)
    for c in range(C):
        zc, free = z[:, c], ~tagged[:, c]
        for sel, cand, share, descending in ((neg, free & (zc >= 0), float(t0[c]), True),
                                             (pos, free & (zc < 0), float(t1[c]), False)):
            idx = torch.nonzero(cand, as_tuple=False).flatten()
            k = int(math.floor(share * idx.numel() + 1e-9))
            if k <= 0:
                continue
            order = torch.sort(zc[idx], descending=descending, stable=True).indices[:k]
            sel[idx[order], c] = True
    if scores.dim() == 1:
        return neg[:, 0], pos[:, 0]
    return neg, pos


def accumulate_tags(tags: torch.Tensor, new_negatives: torch.Tensor, new_positives: torch.Tensor) -> torch.Tensor:
    """Permanent tags (Sec. 2.3.2): ``tags`` is ``(N, C)`` int8 with -1 = untagged, 0 / 1 = pseudo label; new
    selections are written only where the entry is still untagged (earlier tags are never revised)."""
    free = tags < 0
    out = tags.clone()
    out[free & new_negatives.bool()] = 0
    out[free & new_positives.bool()] = 1
    return out


def learning_degree(probs: torch.Tensor, L: float = 0.3, R: float = 0.7) -> torch.Tensor:
    """Local learning degree (Eq. 10, left): ``d_c^k = #{i: p_ic < L or p_ic > R} / N_k``.

    Args:
        probs: ``(N, C)`` sigmoid outputs on all local samples.

    Returns:
        ``(C,)`` (the caller keeps the missing classes).
    """
    confident = (probs < L) | (probs > R)
    return confident.float().mean(0) if probs.shape[0] else torch.zeros(probs.shape[1])


def aggregate_learning_degree(degrees: torch.Tensor, site_sizes: torch.Tensor, missing: torch.Tensor,
                              fallback: float = 1.0) -> torch.Tensor:
    """Global learning degree (Eq. 10, right): ``d_c^G = sum_k |D_k| d_c^k / sum_k |D_k|`` over the sites k where
    class c is missing; ``fallback`` where no site misses c.

    Args:
        degrees: ``(K, C)``; site_sizes: ``(K,)``; missing: ``(K, C)`` bool.

    Returns:
        ``(C,)`` float64.
    """
    w = missing.to(torch.float64) * torch.as_tensor(site_sizes, dtype=torch.float64)[:, None]
    total = w.sum(0)
    d = (w * torch.nan_to_num(degrees.to(torch.float64))).sum(0) / total.clamp_min(1e-12)
    return torch.where(total > 0, d, torch.full_like(d, float(fallback)))


def selection_ratios(global_degree: torch.Tensor, T0: float, T1: float,
                     adaptive: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Self-adaptive threshold (Sec. 2.3.3): ``tau0 = d_c^G * T0``, ``tau1 = d_c^G * T1``; fixed ``T0`` / ``T1``
    when ``adaptive`` is False (ablation without ST, and the released code)."""
    d = torch.as_tensor(global_degree, dtype=torch.float64)
    if not adaptive:
        d = torch.ones_like(d)
    return d * T0, d * T1


# ------------------------------------------------------------------------------------------ local trainer

class FedMLPTrainer(LocalTrainer):
    """FedMLP's local training (multi-label only).

    Options (method_args):
        warmup_rounds (50): stage-1 rounds t1; prototypes and learning degrees are sent from round
            ``warmup_rounds - 1`` on, pseudo labelling starts at round ``warmup_rounds``.
        L (0.3), R (0.7): confidence bounds of the learning degree (Eq. 10).
        T0 (0.005), T1 (0.01): base shares of negative / positive candidates tagged per round (Eq. 8-9).
        tau (1.0): logit-adjustment temperature (Eq. 2-3); 0 disables the adjustment.
        mld (True): missing-label detection (stage-2 pseudo labels).
        wpc (True): weighted-partial-class loss + logit adjustment; False = Eq. 1 BCE over all classes with
            untagged missing entries as negatives (the FedAvg term of Table 3).
        cr (True): consistency regularisation to the received global model on missing entries without a pseudo
            label.
        cr_warmup (True): apply CR during the warm-up too (as the released code; Sec. 2.2 states stage 1's
            objective as L_WPC alone, Sec. 2.4 motivates CR for every missing class without a pseudo label —
            set False for the first reading).
        cr_weight (1.0): weight of the CR term (the paper adds it unweighted).
        st (True): self-adaptive threshold (tau = d_c^G * T); False = fixed T0 / T1.
        global_rates (False): class rates of Eq. 3 from the server's data summary (all sites' annotated
            entries) instead of the site's own labelled entries.
        parity ("paper"): "code" = the released code: masked BCE (mean over labelled entries) without logit
            adjustment, fixed T0 / T1, no stage-2 CR and one view in stage 2, weak-view features.
        feature_view (None): view for features / prototypes / learning degrees ("eval" for the paper, "weak"
            for ``parity: code``).
    """

    tasks = ("multilabel",)

    def __init__(self, ctx: SiteContext, warmup_rounds: int = 50, L: float = 0.3, R: float = 0.7,
                 T0: float = 0.005, T1: float = 0.01, tau: float = 1.0, mld: bool = True, wpc: bool = True,
                 cr: bool = True, cr_warmup: bool = True, cr_weight: float = 1.0, st: bool = True,
                 global_rates: bool = False, parity: str = "paper", feature_view: str | None = None, **options):
        super().__init__(ctx, **options)
        if parity not in PARITIES:
            raise ValueError(f"parity must be one of {PARITIES}, got {parity!r}")
        if not 0.0 <= L <= R <= 1.0:
            raise ValueError(f"need 0 <= L <= R <= 1, got L={L}, R={R}")
        for name, v in (("T0", T0), ("T1", T1)):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be a share in [0, 1], got {v}")
        self.warmup_rounds, self.L, self.R, self.T0, self.T1 = int(warmup_rounds), float(L), float(R), float(T0), float(T1)
        self.tau, self.mld, self.wpc, self.cr, self.cr_warmup = float(tau), bool(mld), bool(wpc), bool(cr), bool(cr_warmup)
        self.cr_weight, self.st, self.global_rates, self.parity = float(cr_weight), bool(st), bool(global_rates), parity
        self.feature_view = feature_view or ("weak" if parity == "code" else "eval")
        self.annotated = torch.as_tensor(np.asarray(ctx.annotated, dtype=bool))
        self.tags: torch.Tensor | None = None  # (N, C) int8: -1 untagged, 0 / 1 permanent pseudo labels
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._warned_rates = False

    # -- pieces (public for tests) --------------------------------------------------------------------
    @property
    def adaptive(self) -> bool:
        return self.st and self.parity == "paper"

    def use_cr(self, stage2: bool) -> bool:
        if not self.cr:
            return False
        return (self.parity == "paper") if stage2 else self.cr_warmup

    def supervised_loss(self, logits: torch.Tensor, labels: torch.Tensor, label_mask: torch.Tensor,
                        pi1: torch.Tensor | None, pi0: torch.Tensor | None) -> torch.Tensor:
        """The supervised term on (annotated + pseudo) labels for the configured variant."""
        if self.parity == "code":
            return masked_bce(logits, labels, label_mask)
        if not self.wpc:  # Eq. 1: every class, missing (untagged) entries as negatives
            return F.binary_cross_entropy_with_logits(logits, labels * label_mask.to(labels.dtype))
        return wpc_loss(logits, labels, label_mask, pi1, pi0, self.tau)

    def rates(self, labels: torch.Tensor, label_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pi1, pi0)`` for Eq. 3: the site's labelled entries, or the data summary with ``global_rates``."""
        if self.global_rates:
            if self.ctx.summary:
                return summary_rates(self.ctx.summary, self.ctx.num_classes)
            if not self._warned_rates:
                self.ctx.log.warning("fedmlp: global_rates set but no data summary received; using local rates")
                self._warned_rates = True
        return class_rates(labels, label_mask)

    # -- data helpers ---------------------------------------------------------------------------------
    def _label_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(labels (N, C) float, mask (N, C) bool)`` of the training set, in row-index order."""
        if self._table is None:
            ds = self.ctx.data.dataset("train", {"image": "eval"})
            if hasattr(ds, "labels") and hasattr(ds, "mask"):
                labels, mask = torch.as_tensor(ds.labels).float(), torch.as_tensor(ds.mask).bool()
            else:
                n, C = len(ds), self.ctx.num_classes
                labels, mask = torch.zeros(n, C), torch.zeros(n, C, dtype=torch.bool)
                for b in self.loader({"image": "eval"}, shuffle=False):
                    labels[b["index"]], mask[b["index"]] = b["label"].float(), b["mask"].bool()
            self._table = (labels.cpu(), mask.cpu())
        return self._table

    def _ensure_tags(self, n: int) -> None:
        C = self.ctx.num_classes
        if self.tags is None or tuple(self.tags.shape) != (n, C):
            if self.tags is not None:
                self.ctx.log.warning(f"fedmlp: stored pseudo labels have shape {tuple(self.tags.shape)}, the "
                                     f"training set is ({n}, {C}); starting from no pseudo labels")
            self.tags = torch.full((n, C), -1, dtype=torch.int8)

    @torch.no_grad()
    def _features(self, model: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features (N, D), probs (N, C))`` of every training sample (row-index order), model in eval mode."""
        was_training = model.training
        model.eval()
        feats: torch.Tensor | None = None
        probs = torch.zeros(n, self.ctx.num_classes)
        bs = int(self.ctx.train.get("batch_size", 32)) * 4
        try:
            for b in self.loader({"image": self.feature_view}, shuffle=False, batch_size=bs):
                f = model.features(b["image"].to(self.ctx.device))
                p = torch.sigmoid(model.head(f))
                if feats is None:
                    feats = torch.zeros(n, f.shape[1])
                idx = b["index"].cpu().long()
                feats[idx], probs[idx] = f.float().cpu(), p.float().cpu()
        finally:
            model.train(was_training)
        return (feats if feats is not None else torch.zeros(n, 0)), probs

    # -- the round ------------------------------------------------------------------------------------
    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        model = self.ctx.model
        stage2 = round_num >= self.warmup_rounds
        use_cr = self.use_cr(stage2)
        teacher = None
        if use_cr or (stage2 and self.mld):
            teacher = copy.deepcopy(model).eval()  # the received global model, frozen
            for p in teacher.parameters():
                p.requires_grad_(False)
        labels, mask = self._label_table()
        n = labels.shape[0]
        self._ensure_tags(n)
        meta: dict = {"fedmlp_stage": 2 if stage2 else 1}
        if stage2 and self.mld:
            meta.update(self._tag_missing_labels(teacher, global_meta or {}, n))

        tagged = self.tags >= 0
        eff_mask = mask | tagged
        eff_labels = torch.where(mask, labels, torch.where(tagged, self.tags.float(), torch.zeros_like(labels)))
        pi1, pi0 = self.rates(eff_labels, eff_mask)
        pi1, pi0 = pi1.to(self.ctx.device), pi0.to(self.ctx.device)
        one_view = stage2 and self.parity == "code"
        views = {"image": "weak"} if one_view else {"image": "weak", "image_2": "weak"}

        model.train()
        self.make_optimizer()
        total, steps = 0.0, 0
        tags_dev = self.tags.to(self.ctx.device)
        for batch in self.batches(views, round_num):
            idx = batch["index"].long()
            m = batch["mask"].bool()
            t = tags_dev[idx]
            tg = (t >= 0) & ~m
            y = torch.where(m, batch["label"].float(), torch.where(tg, t.float(), torch.zeros_like(batch["label"].float())))
            lab = m | tg
            cr_mask = ~lab
            losses = []
            for key in views:
                x = batch[key]
                logits = model(x)
                loss = self.supervised_loss(logits, y, lab, pi1, pi0)
                if use_cr and cr_mask.any():
                    with torch.no_grad():
                        pg = torch.sigmoid(teacher(x))
                    loss = loss + self.cr_weight * consistency_loss(torch.sigmoid(logits), pg, cr_mask)
                losses.append(loss)
            loss = torch.stack(losses).mean()
            self.step(loss)
            total += float(loss.detach())
            steps += 1
        del teacher

        if round_num >= self.warmup_rounds - 1:
            meta.update(self._local_statistics(model, labels, mask, n))
        meta["fedmlp_pseudo_negatives"] = (self.tags == 0).sum(0).tolist()
        meta["fedmlp_pseudo_positives"] = (self.tags == 1).sum(0).tolist()
        return RoundOutput(steps=steps, loss=total / max(steps, 1), meta=meta)

    def _tag_missing_labels(self, teacher: torch.nn.Module, global_meta: dict, n: int) -> dict:
        """Stage-2 missing-label detection with the received global model's features (Eq. 7-9)."""
        if META_GLOBAL_P0 not in global_meta:
            self.ctx.log.warning("fedmlp: stage 2 but no global prototypes received; no pseudo labels this round")
            return {"fedmlp_new_pseudo": 0}
        p0 = torch.as_tensor(np.asarray(global_meta[META_GLOBAL_P0]), dtype=torch.float32)
        p1 = torch.as_tensor(np.asarray(global_meta[META_GLOBAL_P1]), dtype=torch.float32)
        valid = torch.as_tensor(np.asarray(global_meta.get(META_GLOBAL_VALID, np.ones((p0.shape[0], 2), bool)), dtype=bool))
        degree = torch.as_tensor(np.asarray(global_meta.get(META_GLOBAL_DEGREE, np.ones(p0.shape[0])), dtype=np.float64))
        usable = ~self.annotated & valid.all(dim=1)
        received = {"fedmlp_received_prototypes": int(valid.all(dim=1).sum())}  # classes with both P0 and P1
        if not bool(usable.any()):
            return {"fedmlp_new_pseudo": 0, **received}
        feats, _ = self._features(teacher, n)
        if feats.shape[1] != p0.shape[1]:
            raise ValueError(f"fedmlp: global prototypes have dimension {p0.shape[1]}, features {feats.shape[1]}")
        z = prototype_scores(feats, p0, p1)
        tau0, tau1 = selection_ratios(degree, self.T0, self.T1, adaptive=self.adaptive)
        tau0, tau1 = tau0 * usable, tau1 * usable
        neg, pos = select_pseudo_labels(z, self.tags >= 0, tau0, tau1)
        before = int((self.tags >= 0).sum())
        self.tags = accumulate_tags(self.tags, neg & usable, pos & usable)
        return {"fedmlp_new_pseudo": int((self.tags >= 0).sum()) - before, "fedmlp_tau0": tau0.tolist(),
                "fedmlp_tau1": tau1.tolist(), **received}

    def _local_statistics(self, model: torch.nn.Module, labels: torch.Tensor, mask: torch.Tensor, n: int) -> dict:
        """Local prototypes of the active classes (Eq. 5) and learning degrees (Eq. 10) with the trained model."""
        feats, probs = self._features(model, n)
        active_mask = mask & self.annotated[None, :]
        p0, p1, counts = class_prototypes(feats, labels, active_mask)
        degree = learning_degree(probs, self.L, self.R)
        return {META_P0: p0.numpy().astype(np.float32), META_P1: p1.numpy().astype(np.float32),
                META_COUNTS: counts.numpy().astype(np.int64), META_DEGREE: degree.numpy().astype(np.float64)}

    # -- persistence ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.tags is not None:
            state["fedmlp_tags"] = self.tags.clone().cpu()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        tags = state.get("fedmlp_tags")
        self.tags = None if tags is None else torch.as_tensor(tags, dtype=torch.int8).clone()


# ------------------------------------------------------------------------------------------ server rule

class FedMLPRule(ServerRule):
    """FedAvg (n_k) of the weights; global prototypes (Eq. 6) over the sites annotating each class and the
    global learning degree (Eq. 10) over the sites missing it, sent to the sites as the next round's meta.

    Options:
        parity ("paper"): "code" averages prototypes with n_k weights (the released code).
        proto_weighting (None): "uniform" (Eq. 6, 1/|S_c|) or "samples" (n_k); overrides ``parity``.

    A class no contributing site annotates this round keeps its previous global prototypes; a class no
    contributing site misses keeps its previous degree (1 if none yet).
    """

    def __init__(self, parity: str = "paper", proto_weighting: str | None = None, **options):
        super().__init__(parity=parity, proto_weighting=proto_weighting, **options)
        if parity not in PARITIES:
            raise ValueError(f"parity must be one of {PARITIES}, got {parity!r}")
        self.proto_weighting = proto_weighting or ("samples" if parity == "code" else "uniform")
        if self.proto_weighting not in ("uniform", "samples"):
            raise ValueError(f"proto_weighting must be 'uniform' or 'samples', got {self.proto_weighting!r}")
        self.p0: torch.Tensor | None = None
        self.p1: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.degree: torch.Tensor | None = None

    def aggregate(self, previous, contributions: list[Contribution], classifier_keys, round_num, summary=None):
        n = [c.n for c in contributions]
        weights = aggregate_states([c.weights for c in contributions], n)
        with_stats = [c for c in contributions if META_P0 in c.meta]
        if with_stats:
            self._update(with_stats)
        if self.p0 is None:
            return weights, {}
        return weights, {
            META_GLOBAL_P0: self.p0.numpy().astype(np.float32), META_GLOBAL_P1: self.p1.numpy().astype(np.float32),
            META_GLOBAL_VALID: self.valid.tolist(), META_GLOBAL_DEGREE: [float(v) for v in self.degree],
        }

    def _update(self, contributions: Sequence[Contribution]) -> None:
        p0 = torch.stack([torch.as_tensor(np.asarray(c.meta[META_P0]), dtype=torch.float32) for c in contributions])
        p1 = torch.stack([torch.as_tensor(np.asarray(c.meta[META_P1]), dtype=torch.float32) for c in contributions])
        counts = torch.stack([torch.as_tensor(np.asarray(c.meta[META_COUNTS]), dtype=torch.int64) for c in contributions])
        annotated = torch.stack([torch.as_tensor(c.annotated, dtype=torch.bool) for c in contributions])
        sizes = torch.as_tensor([c.n for c in contributions], dtype=torch.float64)
        g0, g1, valid = aggregate_prototypes(p0, p1, counts, annotated,
                                             sizes if self.proto_weighting == "samples" else None)
        if self.p0 is None or self.p0.shape != g0.shape:
            self.p0, self.p1, self.valid = g0, g1, valid
        else:  # keep the previous prototype where nobody contributed one this round
            self.p0 = torch.where(valid[:, :1], g0, self.p0)
            self.p1 = torch.where(valid[:, 1:], g1, self.p1)
            self.valid = self.valid | valid
        degrees = torch.stack([torch.as_tensor(np.asarray(c.meta[META_DEGREE]), dtype=torch.float64) for c in contributions])
        missing = ~annotated
        d = aggregate_learning_degree(degrees, sizes, missing)
        if self.degree is not None and self.degree.shape == d.shape:
            d = torch.where(missing.any(0), d, self.degree)
        self.degree = d


def register_all(register) -> None:
    register("fedmlp", FedMLPTrainer, FedMLPRule)
