"""Surgical aggregation's pieces as plain functions on tensors / arrays (no NVFlare).

- :func:`local_bce`: the local validation loss of the warm-up's epoch selection (and the paper's model
  selection): binary cross-entropy over the entries of the site's validation set that are annotated there AND
  belong to the site's own classes, mean over those entries.
- :func:`estimate_norm_statistics`: BatchNorm running statistics of a frozen representation, as the exact
  average over one pass of the site's training images (FedBN+ without pretrained weights freezes these).
- :func:`average_norm`: the unweighted (or weighted) mean of the norm tensors of the sites' states.
- :func:`freeze_for_warmup`: which parameters the warm-up trains (the task block; optionally the hidden head).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...aggregation import weighted_average
from ...models import NORM_TYPES


@torch.no_grad()
def local_bce(
    model: torch.nn.Module, loader, annotated: np.ndarray | torch.Tensor, device: torch.device | str = "cpu"
) -> float | None:
    """Mean BCE of ``model`` (eval mode, restored afterwards) over a loader's annotated entries of the classes
    in ``annotated``.

    Args:
        loader: batches ``{"image": (B, ...), "label": (B, C) float 0/1, "mask": (B, C) bool}``.
        annotated: ``(C,)`` bool, the site's own classes.

    Returns:
        ``sum BCE / number of entries`` over entries with ``mask & annotated``; None when there is none.
    """
    own = torch.as_tensor(np.asarray(annotated, dtype=bool))
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in loader:
            logits = model(batch["image"].to(device)).float().cpu()
            m = batch["mask"].bool().cpu() & own[None, :]
            if not m.any():
                continue
            loss = F.binary_cross_entropy_with_logits(logits, batch["label"].float().cpu(), reduction="none")
            total += float(loss[m].sum())
            count += int(m.sum())
    finally:
        model.train(was_training)
    return total / count if count else None


@torch.no_grad()
def estimate_norm_statistics(model: torch.nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Reset every BatchNorm's running mean / variance and re-estimate them as the cumulative average over
    ``batches`` (``(B, C_in, H, W)`` image tensors; ``momentum=None``), every other module in eval mode and no
    parameter changed. Modes and momenta are restored. Returns the number of batches seen."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    modes = {m: m.training for m in model.modules()}
    momenta = {m: m.momentum for m in norms}
    model.eval()
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    seen = 0
    try:
        for x in batches:
            model(x)
            seen += 1
    finally:
        for m in norms:
            m.momentum = momenta[m]
        for m, mode in modes.items():
            m.train(mode)
    return seen


def average_norm(
    states: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], norm_keys: Sequence[str]
) -> dict[str, np.ndarray]:
    """``{key: sum_k w_k state_k[key] / sum_k w_k}`` for the norm tensors (weights, biases, running statistics)."""
    return {k: weighted_average([s[k] for s in states], weights) for k in norm_keys if k in states[0]}


def freeze_for_warmup(
    model: torch.nn.Module, groups: Mapping[str, list[str]], train_groups: Sequence[str]
) -> list[str]:
    """Set ``requires_grad`` True only for the parameters of ``train_groups`` (``classifier``, optionally
    ``head``); returns their names. The representation (``encoder`` and ``norm``) is frozen."""
    names = {k for g in train_groups for k in groups.get(g, ())}
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
        if name in names:
            trainable.append(name)
    return trainable


def head_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules after the pooled feature (dropout, hidden layers, classifier): in train mode during the
    warm-up (their dropout active), everything else in eval mode."""
    return [
        m
        for m in (getattr(model, "drop", None), getattr(model, "hidden", None), getattr(model, "classifier", None))
        if m is not None
    ]


def has_norm_layers(model: torch.nn.Module) -> bool:
    return any(isinstance(m, NORM_TYPES) for m in model.modules())
