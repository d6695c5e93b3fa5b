"""Building blocks several methods share (pure functions on tensors, no NVFlare): frozen and EMA teachers,
entropies, MC-dropout predictive entropy, the site's label table and whole-set passes.

Per-class averaging of site metadata over the sites that hold a class is
:func:`fedpartial.aggregation.class_average`.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..evaluation import probabilities
from ..models import full_precision

_EPS = 1e-12


# ------------------------------------------------------------------------------------------ optimiser


@torch.no_grad()
def decay_dominated(optimizer: torch.optim.Optimizer) -> float:
    """The share of the optimised parameter entries (gradients in place, after ``backward``) whose coupled weight
    decay term ``weight_decay * theta`` (Adam's and SGD's ``weight_decay``, added to the gradient) is larger in
    magnitude than the loss's own gradient: under Adam, which steps every entry by about the learning rate
    whatever the gradient's scale, those entries step towards zero rather than where the loss points. A site
    whose only loss is small (a ramped-up consistency term) can train mostly its weights' decay; 0 without weight
    decay or gradients."""
    over = total = 0
    for group in optimizer.param_groups:
        wd = float(group.get("weight_decay") or 0.0)
        for p in group["params"]:
            if p.grad is None:
                continue
            total += p.numel()
            if wd > 0:
                over += int((wd * p.abs() > p.grad.abs()).sum())
    return over / total if total else 0.0


# ------------------------------------------------------------------------------------------ teachers


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode with gradients off (the received global model as a fixed teacher)."""
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


@torch.no_grad()
def ema_update(teacher: torch.nn.Module, student: torch.nn.Module, decay: float) -> None:
    """Mean-teacher update, in place: ``t <- decay * t + (1 - decay) * s`` for every floating-point entry of the
    state dict (parameters and BatchNorm statistics); integer buffers (``num_batches_tracked``) are copied.

    The floating-point entries are updated as two lists (``torch._foreach_mul_`` / ``_foreach_add_``: the same
    ``mul_`` and ``add_`` of every tensor, the same numbers, one call each instead of a Python loop)."""
    s_state = student.state_dict()
    t_float, s_float = [], []
    for key, t in teacher.state_dict().items():
        s = s_state[key]
        if torch.is_floating_point(t):
            t_float.append(t)
            s_float.append(s.to(t.dtype))
        else:
            t.copy_(s)
    if t_float:
        torch._foreach_mul_(t_float, decay)
        torch._foreach_add_(t_float, s_float, alpha=1.0 - decay)


def ema_decay(step: int, max_decay: float) -> float:
    """Mean-teacher decay at global step ``step`` (0-based, counted across rounds): ``min(1 - 1/(step + 1),
    max_decay)`` (Tarvainen & Valpola's ramp; FedIRM's and RSCFed's released ``update_ema_variables``)."""
    return min(1.0 - 1.0 / (step + 1), float(max_decay))


class MeanTeacher:
    """A mean teacher kept across rounds as site state: a frozen copy of the student on first use (or the saved
    one), updated by :func:`ema_update` with :func:`ema_decay`; saved under ``<name>_teacher`` /
    ``<name>_ema_step`` (loaded with ``weights_only=True``), also when a process restored it but never used it."""

    def __init__(self, name: str):
        self.name, self.model, self.step = name, None, 0
        self._saved: dict | None = None

    def get(self, student: torch.nn.Module) -> torch.nn.Module:
        if self.model is None:
            self.model = frozen_copy(student)
            if self._saved is not None:
                self.model.load_state_dict(self._saved)
                self._saved = None
        return self.model

    def update(self, student: torch.nn.Module, max_decay: float) -> None:
        ema_update(self.get(student), student, ema_decay(self.step, max_decay))
        self.step += 1

    def state_dict(self) -> dict:
        if self.model is None and self._saved is None:
            return {}
        weights = (
            self._saved
            if self.model is None
            else {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        )
        return {f"{self.name}_teacher": weights, f"{self.name}_ema_step": int(self.step)}

    def load_state_dict(self, state: dict) -> None:
        if f"{self.name}_teacher" in state:
            self.model, self._saved = None, state[f"{self.name}_teacher"]
            self.step = int(state.get(f"{self.name}_ema_step", 0))


class WithMeanTeacher:
    """Mixin for a :class:`~.base.LocalTrainer` that sets ``self.mean_teacher`` (:class:`MeanTeacher`): the teacher
    on demand, its step, and its place in the site state (listed before ``LocalTrainer`` in the bases)."""

    mean_teacher: MeanTeacher

    def ensure_teacher(self) -> torch.nn.Module:
        """The mean teacher: restored from the site state, or a copy of the current model the first time."""
        return self.mean_teacher.get(self.ctx.model)

    @property
    def teacher(self) -> torch.nn.Module | None:
        return self.mean_teacher.model

    @property
    def ema_step(self) -> int:
        return self.mean_teacher.step

    def state_dict(self) -> dict:
        return {**super().state_dict(), **self.mean_teacher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.mean_teacher.load_state_dict(state)


# ------------------------------------------------------------------------------------------ round totals


class DeviceSums:
    """Per-round sums of per-step values kept on the training device and read once, at the end of the round (one
    host synchronisation per round instead of one per step and term, so a GPU is never waited on mid-round).

    Floating-point values are summed in float64: a float32 loss added in float64 in the same order gives exactly
    what ``total += float(loss)`` gave. Integer values (counts) stay integers."""

    def __init__(self):
        self._sums: dict[str, torch.Tensor] = {}

    def add(self, **values: torch.Tensor) -> None:
        """``name=tensor`` (a 0-d tensor, or any tensor: its sum) added to the running sum of ``name``."""
        for name, value in values.items():
            self._add(name, value.detach().sum())

    def add_each(self, **values: torch.Tensor) -> None:
        """``name=tensor`` added elementwise to the running sum of ``name`` (same shape every step, e.g. ``(C,)``
        per-class counts)."""
        for name, value in values.items():
            self._add(name, value.detach())

    def _add(self, name: str, v: torch.Tensor) -> None:
        v = v.double() if v.is_floating_point() else v.long()
        self._sums[name] = v if name not in self._sums else self._sums[name] + v

    def read(self) -> dict:
        """``{name: sum}``: Python numbers for :meth:`add`, numpy arrays for :meth:`add_each` (the round's host
        read: the first waits for the device, the others find it done); names never added are absent."""
        out: dict = {}
        for name, v in self._sums.items():
            out[name] = v.item() if v.dim() == 0 else v.cpu().numpy()
        return out


# ------------------------------------------------------------------------------------------ entropies


def plogp(p: torch.Tensor) -> torch.Tensor:
    """``p log p`` elementwise with ``0 log 0 = 0``."""
    return torch.where(p > 0, p * torch.log(p.clamp_min(_EPS)), torch.zeros_like(p))


def softmax_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``H(x_i) = -sum_c p_ic log p_ic`` (natural log): ``(N, C)`` softmax probabilities -> ``(N,)``."""
    return -plogp(probs.double()).sum(1).to(probs.dtype)


def binary_entropy(probs: torch.Tensor) -> torch.Tensor:
    """``h(p) = -p ln p - (1 - p) ln(1 - p)`` elementwise (sigmoid outputs), in nats."""
    p = probs.double()
    return (-(plogp(p) + plogp(1 - p))).to(probs.dtype)


def predictive_entropy(mean_probs: torch.Tensor, task: str) -> torch.Tensor:
    """Entropy of a mean prediction: ``(N, C)`` -> ``(N,)`` softmax entropy (single-label) or ``(N, C)``
    per-class binary entropy (multi-label), in nats (``ln 2`` is the maximum of a binary entropy)."""
    return softmax_entropy(mean_probs) if task == "multiclass" else binary_entropy(mean_probs)


def dropout_only_in_head(model: torch.nn.Module) -> bool:
    """Whether every dropout layer of ``model`` sits after its pooled feature (a ``features`` / ``head`` model whose
    encoder has no dropout: :class:`~fedpartial.models.PartialLabelNet`'s ``dropout`` and ``head_dropout``); then
    the stochastic passes of MC dropout differ only in the head and the features can be computed once."""
    encoder = getattr(model, "encoder", None)
    if encoder is None or not hasattr(model, "features") or not hasattr(model, "head"):
        return False
    return not any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in encoder.modules())


@torch.no_grad()
def mc_dropout_probs(model: torch.nn.Module, x: torch.Tensor, passes: int, task: str) -> torch.Tensor:
    """``(T, B, C)`` probabilities of ``passes`` stochastic forward passes with dropout active and every other
    layer (BatchNorm) in eval mode (Monte-Carlo dropout, Gal & Ghahramani). The model's modes are restored.

    When the dropout sits only after the pooled feature (:func:`dropout_only_in_head`, FedIRM's model) the encoder
    runs once and the head ``passes`` times on its features: the same numbers for the same seed (the dropout masks
    are drawn in the same order), ``passes`` - 1 encoder passes fewer."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.train()
    try:
        if dropout_only_in_head(model):  # the encoder is deterministic here: run it once, the head T times
            feats = model.features(x)
            return torch.stack([_probs32(model.head(feats), task) for _ in range(int(passes))])
        return torch.stack([_probs32(model(x), task) for _ in range(int(passes))])
    finally:
        for m, mode in modes.items():
            m.train(mode)


def _probs32(logits: torch.Tensor, task: str) -> torch.Tensor:
    """:func:`~fedpartial.evaluation.probabilities` in float32 with autocast off (under ``train.amp`` a bfloat16
    sigmoid turns every p >= 0.998 into 1.0 and leaves a few dozen distinct values per class)."""
    with full_precision():
        return probabilities(logits.float(), task)


# ------------------------------------------------------------------------------------------ the site's data


def label_table(data) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels (N, C) float, mask (N, C) bool)`` of the site's training set, in row-index order."""
    ds = data.dataset("train", {"image": "eval"})
    return torch.as_tensor(ds.labels).float().cpu(), torch.as_tensor(ds.mask).bool().cpu()


@torch.inference_mode()
def whole_set_pass(
    model: torch.nn.Module,
    loader,
    n: int,
    task: str,
    device: torch.device | str = "cpu",
    features: bool = False,
    key: str = "image",
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One inference pass of ``model`` (eval mode, restored afterwards) over every training image.

    Args:
        loader: an unshuffled loader whose batches carry ``index``; n: the number of rows.
        features: also return the pooled features (``model.features``; the logits are ``model.head`` of them).

    Returns:
        ``(features (N, D) or None, probs (N, C))``, rows in row-index order.
    """
    was_training = model.training
    model.eval()
    feats: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    try:
        for b in loader:
            x = b[key].to(device)
            if features:
                f = model.features(x)
                logits = model.head(f)
            else:
                logits = model(x)
            p = _probs32(logits, task).cpu()
            idx = b["index"].cpu().long()
            if probs is None:
                probs = torch.zeros(n, p.shape[1])
            probs[idx] = p
            if features:
                if feats is None:
                    feats = torch.zeros(n, f.shape[1])
                feats[idx] = f.float().cpu()
    finally:
        model.train(was_training)
    if probs is None:
        probs = torch.zeros(n, 0)
    if features and feats is None:
        feats = torch.zeros(n, 0)
    return feats, probs


@full_precision()
def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(N, D)`` x ``(M, D)`` -> ``(N, M)`` cosine similarities, float32 (autocast off)."""
    return F.normalize(a.float(), dim=1, eps=_EPS) @ F.normalize(b.float(), dim=1, eps=_EPS).t()
