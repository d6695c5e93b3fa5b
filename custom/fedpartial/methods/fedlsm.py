"""FedLSM (Deng, Luo, Chen, "Scale Federated Learning for Label Set Mismatch in Medical Image Classification",
MICCAI 2023) as a (LocalTrainer, ServerRule) pair, for single-label (``multiclass``) and multi-label tasks.

Every round at site k (I_k = annotated classes, U_k = the others):

- Uncertainty estimation (UE, Sec. 2.3): the received global model scores every local image (eval view):
  softmax entropy (Eq. 3) for single-label; for multi-label the entropy over U_k only, normalised to [0, 1]
  (mean binary entropy / ln 2). The ``n_uncertain`` highest form the uncertain pool D^h, the ``n_confident``
  lowest the confident pool D^l, the rest D^m (sizes as counts or fractions, :func:`pool_sizes`).
- Pseudo labelling on D^l + D^m with an EMA teacher initialised from the global model every round (weak view
  to the teacher, strong view to the student). Single-label (Eq. 4): an unlabelled row gets
  ``argmax`` of the teacher's softmax when its probability is ``>= tau`` and (paper) the class is in U_k;
  ``L_U = -(1/N_U) sum pseudo rows log p_student(y^)``, N_U = unlabelled rows of the batch; ``L_I`` = CE on the
  labelled rows. Multi-label (Eq. 5): an unannotated entry is a positive pseudo label when ``q >= tau_p``,
  a negative one when ``q <= tau_n``; ``L_I + L_U = (1/B) sum_i sum_{c labelled or pseudo} w-BCE_ic`` with
  FPSL's class weights: the global negative / positive ratio of each class from the server's data summary
  (every site's labels), applied as the positive-term weight (``class_weighting``).
- Uncertain data enhancing (UDE, Eq. 6): ``n_mix`` confident and ``n_mix`` uncertain samples per step are mixed
  with ``lambda ~ Beta(alpha, alpha)``: ``x~ = lambda x_l + (1 - lambda) x_h``, same for the (pseudo) labels;
  uncertain samples get pseudo labels with the lower thresholds (``tau_l`` / ``tau_lp``, ``tau_ln``). A pair
  (single-label) or an entry (multi-label) counts only where both sides have a label. Loss weight ``lam_ude``.
  ``L = L_I + L_U + lam_ude * L_UDE``.
- The site sends ``q_c^k`` (Sec. 2.4): labelled positives of c plus pseudo-label positives of c.
- Server (AWPA, Eq. 7): feature extractor by n_k; classifier row and bias of class c by ``q_c^k / sum_j q_c^j``;
  when no site reports class c, the row falls back to n_k weights (the released code divides by zero).

Ablations (method options): ``ue: false`` (pools drawn at random, same sizes), ``ude: false`` (no mixed samples),
``awpa: adaptive | masked | fedavg`` (masked: rows over the annotating sites only = the paper's "Ours*").

Released code (dzp2095/FedLSM) behaviours offered as options: ``restrict_unknown: false`` (single-label pseudo
labels of any class, not only U_k), ``entropy: plogp`` (multi-label uncertainty as sum of -p ln p over U_k),
``class_weighting: entry`` (the whole BCE entry weighted by the ratio), ``q_counts: seen`` (q counted over the
batches trained this round instead of over the whole local set), ``tau_n: 0.01`` (the code's negative
threshold; the paper's Table 4 says 5e-3, the default here). Not reproduced: the code's samplers, rebuilt with
the same seed every round (a site replays the same images each round), and its ISIC MixUp bug (the mixed
samples never receive pseudo labels); here every round draws a fresh permutation and the mixed samples get
their pseudo labels.
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..aggregation import aggregate_states, masked_class_weights
from ..evaluation import predict, probabilities
from ..losses import ce_labelled, labelled_rows
from .base import Contribution, LocalTrainer, RoundOutput, ServerRule, SiteContext, summary_counts

# site -> server
META_Q = "fedlsm_q"  # (C,) float: estimated class counts q_c^k (labelled + pseudo positives)
META_POOLS = "fedlsm_pools"  # [confident, medium, uncertain] pool sizes this round
META_PSEUDO = "fedlsm_pseudo"  # pseudo labels used in training this round (entries / rows)
META_UDE_PAIRS = "fedlsm_ude_pairs"  # mixed samples (pairs with a label on both sides) used this round

AWPA_MODES = ("adaptive", "masked", "fedavg")
ENTROPIES = ("binary", "plogp")
WEIGHTINGS = ("positive", "entry", "none")
Q_COUNTS = ("dataset", "seen")
_EPS = 1e-12


# ------------------------------------------------------------------------------------------ uncertainty

def softmax_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Eq. 3: ``H(x_i) = -sum_c p_ic log p_ic`` (natural log, ``0 log 0 = 0``).

    Args:
        probs: ``(N, C)`` softmax probabilities.

    Returns:
        ``(N,)``.
    """
    p = probs.double()
    return -(torch.where(p > 0, p * torch.log(p.clamp_min(_EPS)), torch.zeros_like(p))).sum(1).to(probs.dtype)


def multilabel_entropy(probs: torch.Tensor, unknown: torch.Tensor, kind: str = "binary") -> torch.Tensor:
    """Multi-label uncertainty over the locally unknown classes U_k, normalised to [0, 1].

    ``kind="binary"`` (the paper: "similar to single-label ... only consider U_k and normalize to [0, 1]"):
    ``H_i = mean_{c in U_k} h(p_ic) / ln 2`` with the binary entropy ``h(p) = -p ln p - (1-p) ln(1-p)``.
    ``kind="plogp"`` (released code): ``sum_{c in U_k} -p_ic ln p_ic``, divided by its maximum ``|U_k| / e`` (the
    ranking is the code's).

    Args:
        probs: ``(N, C)`` sigmoid outputs; unknown: ``(C,)`` bool, U_k.

    Returns:
        ``(N,)`` in [0, 1]; zeros when U_k is empty.
    """
    if kind not in ENTROPIES:
        raise ValueError(f"entropy must be one of {ENTROPIES}, got {kind!r}")
    u = torch.as_tensor(unknown, dtype=torch.bool)
    if not bool(u.any()):
        return torch.zeros(probs.shape[0], dtype=probs.dtype)
    p = probs[:, u].double()

    def plogp(x):
        return torch.where(x > 0, x * torch.log(x.clamp_min(_EPS)), torch.zeros_like(x))

    if kind == "binary":
        h = -(plogp(p) + plogp(1 - p)) / math.log(2.0)
        return h.mean(1).to(probs.dtype)
    return (-plogp(p).sum(1) / (p.shape[1] / math.e)).to(probs.dtype)


def pool_sizes(n: int, n_uncertain: float, n_confident: float) -> tuple[int, int]:
    """Pool sizes from counts or fractions: a value in [0, 1) is a fraction of ``n`` (rounded), a value >= 1 a
    count. The uncertain pool is served first; the confident pool gets at most what is left.

    Returns:
        ``(n_h, n_l)`` with ``n_h + n_l <= n``.
    """
    def size(v: float) -> int:
        v = float(v)
        if v < 0:
            raise ValueError(f"pool sizes must be >= 0, got {v}")
        return int(round(v * n)) if v < 1 else int(v)

    n_h = min(size(n_uncertain), n)
    return n_h, min(size(n_confident), n - n_h)


def split_pools(scores: torch.Tensor, n_uncertain: int, n_confident: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split sample indices by uncertainty (Sec. 2.3, UE).

    Args:
        scores: ``(N,)`` uncertainty (entropy); ties keep the lower index first in the ascending order.
        n_uncertain, n_confident: pool sizes (``n_uncertain + n_confident <= N``).

    Returns:
        ``(confident, medium, uncertain)`` index tensors: the ``n_confident`` lowest scores, the rest, and the
        ``n_uncertain`` highest scores (each in ascending score order).
    """
    n = scores.shape[0]
    if n_uncertain + n_confident > n:
        raise ValueError(f"pools of {n_uncertain} + {n_confident} samples exceed the {n} samples")
    order = torch.sort(scores, stable=True).indices
    return order[:n_confident], order[n_confident:n - n_uncertain], order[n - n_uncertain:]


# ------------------------------------------------------------------------------------------ pseudo labels

def multiclass_targets(labels: torch.Tensor, mask: torch.Tensor, teacher_probs: torch.Tensor, tau: float,
                       unknown: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-label targets: the label where the row is labelled, else the teacher's pseudo label (Eq. 4).

    Args:
        labels, mask: ``(B, C)`` one-hot labels and annotation mask (a row is labelled when it has a 1 among
            its annotated entries); teacher_probs: ``(B, C)`` softmax of the teacher on the weak view.
        tau: confidence threshold (``max_c q_c >= tau``).
        unknown: ``(C,)`` bool U_k: pseudo labels only for classes in U_k (the paper's ``sum_{c in U_k}``);
            None = any class (released code).

    Returns:
        ``(targets (B, C) one-hot or zero rows, labelled (B,) bool, pseudo (B,) bool)``.
    """
    lab = labelled_rows(labels, mask)
    conf, cls = teacher_probs.max(dim=1)
    pseudo = ~lab & (conf >= tau)
    if unknown is not None:
        pseudo &= torch.as_tensor(unknown, dtype=torch.bool, device=cls.device)[cls]
    targets = torch.zeros_like(teacher_probs)
    targets[lab] = (labels * mask.to(labels.dtype))[lab]
    targets[pseudo, cls[pseudo]] = 1.0
    return targets, lab, pseudo


def multilabel_targets(labels: torch.Tensor, mask: torch.Tensor, teacher_probs: torch.Tensor, tau_p: float,
                       tau_n: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-label targets (Eq. 5): annotated entries keep their label; an unannotated entry becomes 1 when the
    teacher's probability is ``>= tau_p``, 0 when ``<= tau_n``, and stays unlabelled otherwise.

    Args:
        labels, mask: ``(B, C)``; teacher_probs: ``(B, C)`` sigmoid outputs of the teacher on the weak view.

    Returns:
        ``(targets (B, C), known (B, C) bool = annotated or pseudo-labelled, pseudo (B, C) bool)``.
    """
    m = mask.bool()
    pos = ~m & (teacher_probs >= tau_p)
    neg = ~m & (teacher_probs <= tau_n)
    targets = torch.where(m, labels.to(teacher_probs.dtype), pos.to(teacher_probs.dtype))
    return targets, m | pos | neg, pos | neg


def pseudo_ce(logits: torch.Tensor, targets: torch.Tensor, pseudo: torch.Tensor, n_unlabelled: int) -> torch.Tensor:
    """Eq. 4: ``L_U = -(1/N_U) sum_{i pseudo} log softmax(z_i)[y^_i]``; 0 (with gradient) when N_U = 0.

    Args:
        logits: ``(B, C)`` student logits (strong view); targets: ``(B, C)`` one-hot; pseudo: ``(B,)`` bool rows
        with a pseudo label; n_unlabelled: N_U, the unlabelled rows of the batch.
    """
    if n_unlabelled <= 0 or not bool(pseudo.any()):
        return logits.sum() * 0.0
    logp = torch.log_softmax(logits[pseudo], dim=1)
    return -(targets[pseudo] * logp).sum() / n_unlabelled


def negative_positive_ratio(positives: torch.Tensor, negatives: torch.Tensor) -> torch.Tensor:
    """FPSL's class weights: ``w_c = negatives_c / positives_c`` over every site's labels; 1 where a class has
    no positive or no negative (no information to weight with).

    Args:
        positives, negatives: ``(C,)`` counts.
    """
    pos, neg = torch.as_tensor(positives, dtype=torch.float64), torch.as_tensor(negatives, dtype=torch.float64)
    ok = (pos > 0) & (neg > 0)
    return torch.where(ok, neg / pos.clamp_min(1.0), torch.ones_like(pos)).float()


def weighted_bce(logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor,
                 class_weights: torch.Tensor | None = None, weighting: str = "positive") -> torch.Tensor:
    """Eq. 5's form: ``(1/B) sum_i sum_{c known} w-BCE(z_ic, y_ic)`` (soft targets allowed, for UDE).

    ``weighting="positive"``: ``-(w_c y log s + (1 - y) log(1 - s))`` (torch's ``pos_weight``: positives of class c
    weigh as much as its negatives); ``"entry"``: ``-w_c (y log s + (1 - y) log(1 - s))`` (released code);
    ``"none"`` or ``class_weights=None``: unweighted.

    Args:
        logits, targets: ``(B, C)``; known: ``(B, C)`` bool; class_weights: ``(C,)``.

    Returns:
        scalar; 0 (with gradient) for an empty batch.
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"class_weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    w = None if class_weights is None or weighting == "none" else class_weights.to(logits)
    per = F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="none",
                                             pos_weight=w if weighting == "positive" else None)
    if w is not None and weighting == "entry":
        per = per * w
    return (per * known.to(per.dtype)).sum() / logits.shape[0]


# ------------------------------------------------------------------------------------------ teacher, mixup

@torch.no_grad()
def ema_update(teacher: torch.nn.Module, student: torch.nn.Module, decay: float) -> None:
    """Mean-teacher update, in place: ``t <- decay * t + (1 - decay) * s`` for every floating-point entry of the
    state dict (parameters and BatchNorm statistics); integer buffers (``num_batches_tracked``) are copied."""
    s_state = student.state_dict()
    for key, t in teacher.state_dict().items():
        s = s_state[key]
        if torch.is_floating_point(t):
            t.mul_(decay).add_(s.to(t.dtype), alpha=1.0 - decay)
        else:
            t.copy_(s)


def mixup(x_l: torch.Tensor, y_l: torch.Tensor, x_h: torch.Tensor, y_h: torch.Tensor,
          lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 6: ``x~ = lam x_l + (1 - lam) x_h``, ``y~ = lam y_l + (1 - lam) y_h`` (l = confident, h = uncertain).

    Args:
        x_l, x_h: ``(B, ...)`` images; y_l, y_h: ``(B, C)`` (pseudo) labels; lam: in [0, 1].
    """
    return lam * x_l + (1 - lam) * x_h, lam * y_l + (1 - lam) * y_h


def soft_ce(logits: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """UDE loss for single-label: ``-(1/|rows|) sum_{i in rows} sum_c y~_ic log softmax(z_i)_c``; 0 if no row."""
    if not bool(rows.any()):
        return logits.sum() * 0.0
    return -(targets[rows] * torch.log_softmax(logits[rows], dim=1)).sum(1).mean()


# ------------------------------------------------------------------------------------------ AWPA

def awpa_weights(q: np.ndarray, n: Sequence[float]) -> np.ndarray:
    """AWPA (Eq. 7) weights of each site for each class row: ``q_c^k / sum_j q_c^j``; a class no site reports
    (``sum_j q_c^j = 0``) falls back to ``n_k / sum_j n_j``.

    Args:
        q: ``(K, C)`` non-negative estimated class counts; n: ``(K,)`` sample counts.

    Returns:
        ``(K, C)``, every column sums to 1.
    """
    q = np.asarray(q, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    if q.ndim != 2 or q.shape[0] != len(n):
        raise ValueError(f"q must be (K, C) with K = {len(n)} sites, got {q.shape}")
    if not np.all(np.isfinite(q)) or np.any(q < 0):
        raise ValueError("class counts q must be finite and non-negative")
    total = q.sum(axis=0)
    by_n = np.repeat((n / n.sum())[:, None], q.shape[1], axis=1)
    return np.where(total > 0, q / np.where(total > 0, total, 1.0), by_n)


# ------------------------------------------------------------------------------------------ local trainer

class FedLSMTrainer(LocalTrainer):
    """FedLSM's local training (both tasks).

    Options (method_args; paper Table 4 defaults):
        tau (0.95), tau_l (0.85): single-label thresholds for the pseudo-label pool / the uncertain pool.
        tau_p (0.85), tau_n (0.005), tau_lp (0.7), tau_ln (0.01): multi-label positive / negative thresholds
            (pseudo-label pool / uncertain pool). The released code uses tau_n 0.01 and tau_ln 0.005.
        n_uncertain (0.05), n_confident (0.2): pool sizes, fractions (< 1) or counts (>= 1); the released code
            uses 500 / 2000 (CXR, ~9.5k images per client) and 50 / 200 (ISIC, ~1.4k).
        n_mix (4): mixed samples per step (the batch holds ``batch_size - n_mix`` pseudo-pool samples).
        alpha (0.2): MixUp Beta parameter; lam_ude (0.1): UDE loss weight; ema (0.999): teacher decay.
        ue (True), ude (True): ablation switches; ``awpa`` is read by the server rule.
        restrict_unknown (True), entropy ("binary"), class_weighting ("positive"), q_counts ("dataset"): the
            paper's reading; the released code's behaviour with False / "plogp" / "entry" / "seen".
    The optimiser state persists across rounds (``train.keep_optimizer_state`` defaults to true here).
    Steps per round: ``train.local_steps`` if set, else ``local_epochs`` passes over the pseudo-label pool.
    """

    def __init__(self, ctx: SiteContext, tau: float = 0.95, tau_l: float = 0.85, tau_p: float = 0.85,
                 tau_n: float = 0.005, tau_lp: float = 0.7, tau_ln: float = 0.01, n_uncertain: float = 0.05,
                 n_confident: float = 0.2, n_mix: int = 4, alpha: float = 0.2, lam_ude: float = 0.1,
                 ema: float = 0.999, ue: bool = True, ude: bool = True, restrict_unknown: bool = True,
                 entropy: str = "binary", class_weighting: str = "positive", q_counts: str = "dataset", **options):
        super().__init__(ctx, **options)
        for name, v, allowed in (("entropy", entropy, ENTROPIES), ("class_weighting", class_weighting, WEIGHTINGS),
                                 ("q_counts", q_counts, Q_COUNTS)):
            if v not in allowed:
                raise ValueError(f"fedlsm: {name} must be one of {allowed}, got {v!r}")
        for name, v in (("tau", tau), ("tau_l", tau_l), ("tau_p", tau_p), ("tau_n", tau_n), ("tau_lp", tau_lp),
                        ("tau_ln", tau_ln), ("ema", ema)):
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"fedlsm: {name} must lie in [0, 1], got {v}")
        if alpha <= 0:
            raise ValueError(f"fedlsm: alpha must be > 0, got {alpha}")
        self.tau, self.tau_l, self.tau_p, self.tau_n = float(tau), float(tau_l), float(tau_p), float(tau_n)
        self.tau_lp, self.tau_ln = float(tau_lp), float(tau_ln)
        self.n_uncertain, self.n_confident, self.n_mix = n_uncertain, n_confident, int(n_mix)
        self.alpha, self.lam_ude, self.ema = float(alpha), float(lam_ude), float(ema)
        self.ue, self.ude, self.restrict_unknown = bool(ue), bool(ude), bool(restrict_unknown)
        self.entropy, self.class_weighting, self.q_counts = entropy, class_weighting, q_counts
        ctx.train = {"keep_optimizer_state": True, **ctx.train}
        self.unknown = ~torch.as_tensor(np.asarray(ctx.annotated, dtype=bool))
        self._warned_summary = False

    # -- pieces (public for tests) --------------------------------------------------------------------
    def uncertainty(self, probs: torch.Tensor) -> torch.Tensor:
        """``(N,)`` UE scores of the received model's probabilities (Eq. 3 / the multi-label reading)."""
        if self.ctx.task == "multiclass":
            return softmax_entropy(probs)
        return multilabel_entropy(probs, self.unknown, self.entropy)

    def targets(self, labels: torch.Tensor, mask: torch.Tensor, teacher_probs: torch.Tensor,
                uncertain: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(targets, known, pseudo)`` with the pseudo-pool thresholds or (``uncertain``) the lower ones;
        ``known`` / ``pseudo`` are ``(B,)`` rows for single-label, ``(B, C)`` entries for multi-label."""
        if self.ctx.task == "multiclass":
            unknown = self.unknown.to(teacher_probs.device) if self.restrict_unknown else None
            t, lab, pseudo = multiclass_targets(labels, mask, teacher_probs, self.tau_l if uncertain else self.tau,
                                                unknown)
            return t, lab | pseudo, pseudo
        return multilabel_targets(labels, mask, teacher_probs, self.tau_lp if uncertain else self.tau_p,
                                  self.tau_ln if uncertain else self.tau_n)

    def class_weights(self, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """FPSL's negative / positive ratio per class from the server's data summary (all sites' labels); the
        site's own labels when no summary came (with a warning). None for single-label."""
        if self.ctx.task == "multiclass" or self.class_weighting == "none":
            return None
        if self.ctx.summary:
            pos, neg = summary_counts(self.ctx.summary, self.ctx.num_classes)
        else:
            if not self._warned_summary:
                self.ctx.log.warning("fedlsm: no data summary received; class weights from the local labels")
                self._warned_summary = True
            m = mask.float()
            pos, neg = (labels * m).sum(0), ((1 - labels) * m).sum(0)
        return negative_positive_ratio(pos, neg)

    def supervised_loss(self, logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                        targets: torch.Tensor, known: torch.Tensor, pseudo: torch.Tensor,
                        weights: torch.Tensor | None) -> torch.Tensor:
        """``L_I + L_U`` on the pseudo-pool batch."""
        if self.ctx.task == "multiclass":
            n_unlabelled = int((~labelled_rows(labels, mask)).sum())
            return ce_labelled(logits, labels, mask) + pseudo_ce(logits, targets, pseudo, n_unlabelled)
        return weighted_bce(logits, targets, known, weights, self.class_weighting)

    def ude_loss(self, logits: torch.Tensor, targets: torch.Tensor, known: torch.Tensor,
                 weights: torch.Tensor | None) -> torch.Tensor:
        """``L_UDE`` on the mixed samples (cross-entropy with the soft labels)."""
        if self.ctx.task == "multiclass":
            return soft_ce(logits, targets, known)
        return weighted_bce(logits, targets, known, weights, self.class_weighting)

    def estimated_counts(self, labels: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor,
                         known: torch.Tensor) -> torch.Tensor:
        """``q_c`` contribution of some samples: labelled positives plus pseudo-label positives, ``(C,)``."""
        pos = labels * mask.to(labels.dtype)
        if self.ctx.task == "multiclass":
            return (pos + targets * (known & ~labelled_rows(labels, mask))[:, None]).sum(0)
        return (pos + targets * (known & ~mask.bool())).sum(0)

    # -- the round ------------------------------------------------------------------------------------
    def _label_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        ds = self.ctx.data.dataset("train", {"image": "eval"})
        return torch.as_tensor(ds.labels).float(), torch.as_tensor(ds.mask).bool()

    def _received_probs(self, n: int) -> torch.Tensor:
        """``(N, C)`` probabilities of the received global model on every local image (eval view, eval mode)."""
        bs = int(self.ctx.train.get("batch_size", 32)) * 4
        out = predict(self.ctx.model, self.loader({"image": "eval"}, shuffle=False, batch_size=bs), self.ctx.task,
                      self.ctx.device)
        probs = torch.zeros(n, self.ctx.num_classes)
        probs[torch.as_tensor(out["index"]).long()] = torch.as_tensor(out["probs"]).float()
        return probs

    def _num_steps(self, pool: int, per_step: int) -> int:
        steps = self.ctx.train.get("local_steps")
        if steps is not None:
            return int(steps)
        return max(1, int(self.ctx.train.get("local_epochs", 1))) * max(1, math.ceil(pool / max(per_step, 1)))

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        ctx, model, dev = self.ctx, self.ctx.model, self.ctx.device
        labels, mask = self._label_table()
        n = labels.shape[0]
        gen = torch.Generator().manual_seed(ctx.seed * 100003 + round_num)

        # UE with the received global model over all local images
        probs = self._received_probs(n)
        scores = self.uncertainty(probs) if self.ue else torch.rand(n, generator=gen)
        n_h, n_l = pool_sizes(n, self.n_uncertain, self.n_confident)
        confident, medium, uncertain = split_pools(scores, n_h, n_l)
        pseudo_pool = torch.cat([confident, medium])
        use_ude = self.ude and self.n_mix > 0 and len(confident) > 0 and len(uncertain) > 0
        n_mix = self.n_mix if use_ude else 0
        per_step = max(1, int(ctx.train.get("batch_size", 32)) - n_mix)
        weights = self.class_weights(labels, mask)
        weights = None if weights is None else weights.to(dev)

        q = torch.zeros(ctx.num_classes)
        if self.q_counts == "dataset":  # q_c^k over all n_k images, pseudo labels of the round's teacher (Eq. 7)
            t, known, _ = self.targets(labels, mask, probs)
            q = self.estimated_counts(labels, mask, t, known)

        teacher = copy.deepcopy(model).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        ds = ctx.data.dataset("train", {"weak": "weak", "strong": "strong"})
        if hasattr(ds, "set_random_state"):
            ds.set_random_state(seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))

        def fetch(idx: torch.Tensor) -> dict:
            batch = torch.utils.data.default_collate([ds[int(i)] for i in idx])
            return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}

        model.train()
        self.make_optimizer()
        order, pos = pseudo_pool[torch.randperm(len(pseudo_pool), generator=gen)], 0
        total, steps, n_pseudo, n_pairs = 0.0, 0, 0, 0
        for _ in range(self._num_steps(len(pseudo_pool), per_step) if len(pseudo_pool) else 0):
            if pos >= len(order):  # a fresh permutation of the pool (never the same replay every round)
                order, pos = pseudo_pool[torch.randperm(len(pseudo_pool), generator=gen)], 0
            idx = order[pos:pos + per_step]
            pos += per_step
            b = fetch(idx)
            weak = [b["weak"]]
            if n_mix:
                bl = fetch(confident[torch.randperm(len(confident), generator=gen)[:n_mix]])
                bh = fetch(uncertain[torch.randperm(len(uncertain), generator=gen)[:n_mix]])
                weak += [bl["weak"], bh["weak"]]
            with torch.no_grad():
                tp = probabilities(teacher(torch.cat(weak)), ctx.task).float()
            B = len(idx)
            y, known, pseudo = self.targets(b["label"], b["mask"], tp[:B])
            inputs = [b["strong"]]
            if n_mix:
                yl, kl, _ = self.targets(bl["label"], bl["mask"], tp[B:B + len(bl["weak"])])
                yh, kh, _ = self.targets(bh["label"], bh["mask"], tp[B + len(bl["weak"]):], uncertain=True)
                m = min(len(yl), len(yh))
                lam = float(torch.distributions.Beta(self.alpha, self.alpha).sample()) if m else 0.0
                x_mix, y_mix = mixup(bl["weak"][:m], yl[:m], bh["weak"][:m], yh[:m], lam)
                k_mix = kl[:m] & kh[:m]
                inputs.append(x_mix)
                n_pairs += int(k_mix.any(1).sum()) if k_mix.dim() == 2 else int(k_mix.sum())
            out = model(torch.cat(inputs))
            loss = self.supervised_loss(out[:B], b["label"], b["mask"], y, known, pseudo, weights)
            if n_mix:
                loss = loss + self.lam_ude * self.ude_loss(out[B:], y_mix, k_mix, weights)
            self.step(loss)
            ema_update(teacher, model, self.ema)
            total += float(loss.detach())
            steps += 1
            n_pseudo += int(pseudo.sum())
            if self.q_counts == "seen":
                q += self.estimated_counts(b["label"], b["mask"], y, known).cpu()
        del teacher
        meta = {META_Q: q.numpy().astype(np.float64), META_POOLS: [len(confident), len(medium), len(uncertain)],
                META_PSEUDO: n_pseudo, META_UDE_PAIRS: n_pairs}
        return RoundOutput(steps=steps, loss=total / max(steps, 1), meta=meta)


# ------------------------------------------------------------------------------------------ server rule

class FedLSMRule(ServerRule):
    """FedAvg (n_k) of the feature extractor; classifier rows by AWPA (Eq. 7) from the sites' ``q_c^k``.

    Options:
        awpa ("adaptive"): "masked" = rows averaged (n_k) over the sites annotating the class, a class nobody
            annotates keeps its previous row (the paper's "Ours*" / FedAvg*); "fedavg" = every tensor by n_k.
    Trainer options in the same method_args are ignored here.
    """

    def __init__(self, awpa: str = "adaptive", **options):
        super().__init__(awpa=awpa, **options)
        if awpa not in AWPA_MODES:
            raise ValueError(f"fedlsm: awpa must be one of {AWPA_MODES}, got {awpa!r}")
        self.awpa = awpa

    def aggregate(self, previous, contributions: list[Contribution], classifier_keys, round_num, summary=None):
        states, n = [c.weights for c in contributions], [c.n for c in contributions]
        if self.awpa == "fedavg":
            return aggregate_states(states, n), {}
        if self.awpa == "masked":
            cw = masked_class_weights(np.stack([c.annotated for c in contributions]), n)
            return aggregate_states(states, n, classifier_keys, cw, previous, zero_rows="previous"), {}
        lacking = [c.site for c in contributions if META_Q not in c.meta]
        if lacking:
            raise ValueError(f"fedlsm: site(s) {lacking} sent no class counts '{META_Q}' (not FedLSM trainers?)")
        q = np.stack([np.asarray(c.meta[META_Q], dtype=np.float64) for c in contributions])
        cw = awpa_weights(q, n)
        return aggregate_states(states, n, classifier_keys, cw, previous, zero_rows="samples"), {}


def register_all(register) -> None:
    register("fedlsm", FedLSMTrainer, FedLSMRule)
