"""FedLSR (Jiang, Sun, Wang, Liu, "Towards Federated Learning against Noisy Labels via Local Self-Regularization",
CIKM 2022; released notebook Sprinter1999/FedLSR): local self-regularisation on two views of every image, FedAvg.

Per batch, with ``z1``, ``z2`` the logits of the two views (two forward passes) and ``lam ~ Beta(alpha, alpha)``
(one draw per batch):

- implicit regularisation: the mixed prediction ``p = lam softmax(z1) + (1 - lam) softmax(z2)`` sharpened,
  ``p_s = p^(1/T) / sum_c p_c^(1/T)`` (``T = 1/2``), is the model's output in the cross-entropy
  ``L_ce = -log p_s[y]`` (labelled rows);
- self-distillation between the views: ``L_sd = JS(q1 || q2) = (KL(q1 || m) + KL(q2 || m)) / 2``,
  ``m = (q1 + q2) / 2``, ``q_v = softmax(z_v / T_d)`` (``T_d = 1/3``, clamped at 1e-6 as the code);
- entropy regulariser (the paper's discussion, on in the released code): ``L_e = (H(q1) + H(q2)) / 2``;
- ``L = L_ce + beta(t) L_sd + lambda_e L_e`` with ``beta(t) = gamma min(t / t_w, 1)`` (``gamma = 0.4``,
  ``t_w = 0.2 x rounds``).

Multi-label (FedMLP's released adaptation, ``local_training.py::train_FedLSR``: sigmoid per class), made
consistent: ``p = lam sigmoid(z1) + (1 - lam) sigmoid(z2)`` per class, binary sharpening
``p_s = p^(1/T) / (p^(1/T) + (1 - p)^(1/T))``, ``L_ce = BCE(p_s, y)`` over every entry (``missing: negatives``,
the noisy-label reading: unannotated entries are labels 0) or the annotated ones, optional class weights on the
positive term (``class_weighting: inverse``: FedMLP's ``N / n_c``), ``L_sd`` and ``L_e`` per entry with Bernoulli
distributions ``q = sigmoid(z / T_d)``, averaged over the entries. FedMLP's run has no entropy term
(``lambda_e: 0``) and ``t_w = 40`` of 500 rounds.

``parity: code`` reproduces the released code's arithmetic: single-label ``nn.CrossEntropyLoss`` applied to the
probabilities ``p_s`` (a second softmax), ``nn.KLDivLoss(reduction='mean')`` (the JS averaged over the B*C
entries instead of summed over classes) and the entropy of ``softmax(q1)`` for view 1 twice; multi-label (FedMLP)
``BCEWithLogits`` applied to the probabilities ``p_s`` and the element-wise (non-Bernoulli) KL terms.

Views (``views``): the paper distils the original image against an augmented one (``["eval", "strong"]``);
FedMLP draws two independent weak views (``["weak", "weak"]``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..data.views import KINDS, ViewKind
from ..losses import labelled_rows
from ..options import opt
from .base import LocalTrainer, RoundOutput, ServerRule, TrainerOptions
from .common import DeviceSums, full_precision, label_table, plogp

__all__ = [
    "log_mixed",
    "sharpened_log_probs",
    "distill_probs",
    "ce_term",
    "js_term",
    "entropy_term",
    "sd_weight",
    "inverse_frequency",
    "fedlsr_loss",
    "FedLSROptions",
    "FedLSRTrainer",
    "register_all",
]

_CLAMP = 1e-6


# ------------------------------------------------------------------------------------------ pure functions


def log_mixed(z1: torch.Tensor, z2: torch.Tensor, lam: float, task: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log of the mixed prediction ``p = lam P(z1) + (1 - lam) P(z2)`` (P = softmax or sigmoid), computed stably.

    Returns:
        single-label ``(log p (B, C), None)``; multi-label ``(log p, log(1 - p))``, each ``(B, C)``.
    """
    a, b = math.log(lam) if lam > 0 else -math.inf, math.log1p(-lam) if lam < 1 else -math.inf

    def mix(l1, l2):
        return torch.logsumexp(torch.stack([l1 + a, l2 + b]), dim=0)

    if task == "multiclass":
        return mix(torch.log_softmax(z1, 1), torch.log_softmax(z2, 1)), None
    return mix(F.logsigmoid(z1), F.logsigmoid(z2)), mix(F.logsigmoid(-z1), F.logsigmoid(-z2))


def sharpened_log_probs(z1: torch.Tensor, z2: torch.Tensor, lam: float, temperature: float, task: str) -> torch.Tensor:
    """The sharpened mixed prediction as logits of the task's link: single-label ``log p_s`` with
    ``p_s = p^(1/T) / sum_c p_c^(1/T)`` (a log-softmax of ``log p / T``); multi-label ``logit(p_s)`` with the
    binary sharpening ``p_s = p^(1/T) / (p^(1/T) + (1 - p)^(1/T))``, i.e. ``logit(p_s) = logit(p) / T``.
    ``(B, C)`` each."""
    lp, lq = log_mixed(z1, z2, lam, task)
    if task == "multiclass":
        return torch.log_softmax(lp / temperature, dim=1)
    return (lp - lq) / temperature


def distill_probs(z: torch.Tensor, temperature: float, task: str) -> torch.Tensor:
    """``q = softmax(z / T_d)`` (single-label) or ``sigmoid(z / T_d)`` (multi-label), clamped to
    ``[1e-6, 1]`` (multi-label ``[1e-6, 1 - 1e-6]``) as the released code. ``(B, C)``."""
    if task == "multiclass":
        return torch.softmax(z / temperature, dim=1).clamp(_CLAMP, 1.0)
    return torch.sigmoid(z / temperature).clamp(_CLAMP, 1 - _CLAMP)


def ce_term(
    s: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    task: str,
    missing: str = "negatives",
    pos_weight: torch.Tensor | None = None,
    parity: str = "paper",
) -> torch.Tensor:
    """``L_ce`` of the sharpened mixed prediction.

    Args:
        s: ``(B, C)`` from :func:`sharpened_log_probs` (``log p_s`` / ``logit(p_s)``); labels, mask: ``(B, C)``;
        missing: multi-label entries: every entry (unannotated = 0) or the annotated ones ('partial');
        pos_weight: optional ``(C,)`` weight of the positive term (multi-label);
        parity: 'code' applies the loss to the probabilities ``p_s`` as if they were logits (released code).

    Single-label: mean over the labelled rows of ``-log p_s[y]`` (0 with a gradient when none).
    """
    if task == "multiclass":
        rows = labelled_rows(labels, mask)
        if not rows.any():
            return s.sum() * 0.0
        y = labels[rows].argmax(dim=1)
        if parity == "code":
            return F.cross_entropy(s[rows].exp(), y)
        return F.nll_loss(s[rows], y)
    m = mask.to(s.dtype)
    target = labels.to(s.dtype) * m
    x = torch.sigmoid(s) if parity == "code" else s
    pw = None if pos_weight is None else pos_weight.to(s.device, s.dtype)
    per = F.binary_cross_entropy_with_logits(x, target, reduction="none", pos_weight=pw)
    if missing == "partial":
        return (per * m).sum() / m.sum().clamp_min(1.0)
    return per.mean()


def _kl_terms(q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Element-wise ``q log(q / m)`` with ``0 log(0 / m) = 0`` (``m >= q / 2`` in the JS terms, so ``q > 0`` gives
    ``m > 0``; no ``0 * -inf``)."""
    return plogp(q) - torch.where(q > 0, q * torch.log(m.clamp_min(torch.finfo(m.dtype).tiny)), torch.zeros_like(q))


def js_term(q1: torch.Tensor, q2: torch.Tensor, task: str, parity: str = "paper") -> torch.Tensor:
    """``L_sd``: Jensen-Shannon divergence between the two views' distillation outputs ``q1``, ``q2`` ``(B, C)``.

    Single-label: ``sum_c [q1 log(q1/m) + q2 log(q2/m)] / 2`` per sample, mean over the batch (``parity: code``:
    mean over the B*C entries, the released ``KLDivLoss(reduction='mean')``). Multi-label: the Bernoulli JS of
    every entry, mean over the entries (``parity: code``: the element-wise terms of the positive class only,
    mean over the entries, as FedMLP's code).
    """
    m = (q1 + q2) / 2
    if task == "multiclass":
        per = (_kl_terms(q1, m) + _kl_terms(q2, m)) / 2
        return per.mean() if parity == "code" else per.sum(1).mean()
    pos = (_kl_terms(q1, m) + _kl_terms(q2, m)) / 2
    if parity == "code":
        return pos.mean()
    neg = (_kl_terms(1 - q1, 1 - m) + _kl_terms(1 - q2, 1 - m)) / 2
    return (pos + neg).mean()


def entropy_term(q1: torch.Tensor, q2: torch.Tensor, task: str, parity: str = "paper") -> torch.Tensor:
    """``L_e``: mean entropy of the two views' distillation outputs. Single-label ``(H(q1) + H(q2)) / 2`` with
    ``H(q) = -sum_c q_c log q_c``, mean over the batch (``parity: code``: ``H(softmax(q1))``, view 1 twice, as the
    released notebook); multi-label the binary entropies, mean over views and entries."""
    if task == "multiclass":
        if parity == "code":
            return -plogp(torch.softmax(q1, dim=1)).sum(1).mean()
        return -(plogp(q1).sum(1) + plogp(q2).sum(1)).mean() / 2
    h = lambda q: -(plogp(q) + plogp(1 - q))  # noqa: E731
    return (h(q1) + h(q2)).mean() / 2


def sd_weight(round_num: int, gamma: float, t_w: int) -> float:
    """``beta(t) = gamma * min(t / t_w, 1)`` (linear ramp-up of the self-distillation weight)."""
    return float(gamma) if t_w <= 0 or round_num >= t_w else float(gamma) * round_num / t_w


def inverse_frequency(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """FedMLP's positive-term weights ``N / n_c`` (``n_c`` = the site's annotated positives of class c; 1 where
    ``n_c = 0``, where no positive target exists anyway). ``(N, C)`` -> ``(C,)``."""
    n = labels.shape[0]
    pos = (labels.float() * mask.float()).sum(0)
    return torch.where(pos > 0, n / pos.clamp_min(1.0), torch.ones_like(pos))


@full_precision()
def fedlsr_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    lam: float,
    beta: float,
    task: str,
    sharpen_t: float = 0.5,
    distill_t: float = 1 / 3,
    lambda_e: float = 0.6,
    missing: str = "negatives",
    pos_weight: torch.Tensor | None = None,
    parity: str = "paper",
    as_tensors: bool = False,
) -> tuple[torch.Tensor, dict]:
    """``L = L_ce + beta L_sd + lambda_e L_e`` for one batch (see the module docstring).

    Args:
        z1, z2: ``(B, C)`` logits of the two views; labels, mask: ``(B, C)``; lam: the mixing weight;
        beta: the round's self-distillation weight (:func:`sd_weight`).

    Returns:
        ``(loss, {"ce", "sd", "entropy"})``: the terms as Python floats, or as detached 0-d tensors with
        ``as_tensors`` (no host synchronisation: what the trainer sums on the device).
    """
    z1, z2 = z1.float(), z2.float()  # float32: in bfloat16 the clamp 1 - 1e-6 is 1.0 and (1 - q) log(1 - m) NaN
    s = sharpened_log_probs(z1, z2, lam, sharpen_t, task)
    ce = ce_term(s, labels, mask, task, missing, pos_weight, parity)
    q1, q2 = distill_probs(z1, distill_t, task), distill_probs(z2, distill_t, task)
    sd = js_term(q1, q2, task, parity)
    loss = ce + beta * sd
    ent = entropy_term(q1, q2, task, parity) if lambda_e else None
    if ent is not None:
        loss = loss + lambda_e * ent
    parts = {"ce": ce.detach(), "sd": sd.detach(), "entropy": ent.detach() if ent is not None else torch.zeros_like(ce)}
    return loss, parts if as_tensors else {k: float(v) for k, v in parts.items()}


# ------------------------------------------------------------------------------------------ the site


@dataclass
class FedLSROptions(TrainerOptions):
    """FedLSR's site options (method_args; the released notebook's defaults)."""

    gamma: float = opt(0.4, "maximum self-distillation weight beta")
    t_w: int | None = opt(
        None, "rounds of the linear ramp of beta (None: 0.2 x the job's rounds, the notebook; FedMLP: 40 of 500)"
    )
    sharpen_t: float = opt(0.5, "sharpening temperature T of the mixed prediction (p^(1/T))")
    distill_t: float = opt(1 / 3, "self-distillation temperature T_d (q = softmax(z / T_d))")
    lambda_e: float = opt(0.6, "weight of the entropy regulariser (FedMLP's multi-label run: 0)")
    mix_alpha: float = opt(1.0, "Beta(alpha, alpha) of the prediction-mixing weight")
    views: tuple[ViewKind, ViewKind] = opt(
        ("eval", "strong"), "the two views: original + augmented (paper), or two weak draws (FedMLP: ['weak', 'weak'])"
    )
    missing: Literal["negatives", "partial"] = opt(
        "negatives", "multi-label: unannotated entries are labels 0 (noisy-label reading, FedMLP) or left out of L_ce"
    )
    class_weighting: Literal["none", "inverse"] = opt(
        "none", "multi-label positive-term weights: none, or FedMLP's N / n_c"
    )
    parity: Literal["paper", "code"] = opt("paper", "'code': the released arithmetic (see the module docstring)")

    def __post_init__(self):
        for name in ("sharpen_t", "distill_t", "mix_alpha"):
            if getattr(self, name) <= 0:
                raise ValueError(f"fedlsr: {name} must be > 0, got {getattr(self, name)}")
        if len(self.views) != 2 or any(v not in KINDS for v in self.views):
            raise ValueError(f"fedlsr: views must be two of {KINDS}, got {self.views}")
        if self.t_w is not None and self.t_w < 0:
            raise ValueError(f"fedlsr: t_w must be >= 0, got {self.t_w}")


class FedLSRTrainer(LocalTrainer):
    """FedLSR's local training (both task types); FedAvg on the server.

    Options: :class:`FedLSROptions`. Counters per round: ``fedlsr_sd_weight`` (beta), ``fedlsr_ce``, ``fedlsr_sd``,
    ``fedlsr_entropy`` (mean terms over the round's steps), ``fedlsr_mix`` (mean mixing weight).
    """

    Options = FedLSROptions

    def t_w(self, num_rounds: int) -> int:
        return int(self.opts.t_w) if self.opts.t_w is not None else int(round(0.2 * num_rounds))

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        ctx, o = self.ctx, self.opts
        beta = sd_weight(round_num, o.gamma, self.t_w(num_rounds))
        pos_weight = None
        if ctx.task == "multilabel" and o.class_weighting == "inverse":
            pos_weight = inverse_frequency(*label_table(ctx.data)).to(ctx.device)
        beta_dist = torch.distributions.Beta(float(o.mix_alpha), float(o.mix_alpha))
        model = self.train_mode()
        self.make_optimizer()
        steps, mix, device_sums = 0, 0.0, DeviceSums()  # the losses stay on the device, read once after the round
        for batch in self.batches({"image": o.views[0], "image_2": o.views[1]}, round_num):
            z1, z2 = model(batch["image"]), model(batch["image_2"])
            lam = float(beta_dist.sample())
            loss, parts = fedlsr_loss(
                z1,
                z2,
                batch["label"],
                batch["mask"],
                lam,
                beta,
                ctx.task,
                o.sharpen_t,
                o.distill_t,
                o.lambda_e,
                o.missing,
                pos_weight,
                o.parity,
                as_tensors=True,
            )
            self.step(loss)
            device_sums.add(loss=loss, **parts)
            steps += 1
            mix += lam
        sums = {"loss": 0.0, "ce": 0.0, "sd": 0.0, "entropy": 0.0, **device_sums.read(), "mix": mix}
        total, s = sums["loss"], max(steps, 1)
        meta = {
            "fedlsr_sd_weight": beta,
            "fedlsr_ce": sums["ce"] / s,
            "fedlsr_sd": sums["sd"] / s,
            "fedlsr_entropy": sums["entropy"] / s,
            "fedlsr_mix": sums["mix"] / s,
        }
        return RoundOutput(steps=steps, loss=total / s, meta=meta)


def register_all(register) -> None:
    register(
        "fedlsr",
        FedLSRTrainer,
        ServerRule,
        doc="FedLSR (Jiang et al., CIKM 2022): local self-regularisation, FedAvg",
        job="fedlsr_ich",
        comparison=True,
    )
