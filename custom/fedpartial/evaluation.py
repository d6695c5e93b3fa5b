"""Run a model over a loader and score it with the project's metrics."""

from __future__ import annotations

import numpy as np
import torch

from .metrics import compute_metrics
from .stats import bootstrap_auc_ci


def probabilities(logits: torch.Tensor, task: str) -> torch.Tensor:
    """``(B, C)`` logits -> sigmoid (multi-label) or softmax (single-label) probabilities."""
    return torch.sigmoid(logits) if task == "multilabel" else torch.softmax(logits, dim=1)


@torch.no_grad()
def predict(
    model: torch.nn.Module, loader, task: str, device: torch.device | str = "cpu", key: str = "image"
) -> dict[str, np.ndarray]:
    """Probabilities for every item of ``loader``.

    Returns:
        ``{"probs": (N, C), "label": (N, C), "mask": (N, C) bool, "index": (N,)}``.
    """
    was_training = model.training
    model.eval()
    out: dict[str, list] = {"probs": [], "label": [], "mask": [], "index": []}
    for batch in loader:
        out["probs"].append(probabilities(model(batch[key].to(device)), task).float().cpu())
        for k in ("label", "mask", "index"):
            if k in batch:
                out[k].append(batch[k].cpu())
    model.train(was_training)
    return {k: torch.cat(v).numpy() if v else np.zeros((0,)) for k, v in out.items()}


def evaluate(model: torch.nn.Module, loader, task: str, classes: list[str], device: torch.device | str = "cpu") -> dict:
    """Metrics of ``model`` on a (fully or partially) labelled loader (``fedpartial.metrics`` result dict, plus
    ``ci``: bootstrap confidence intervals of the AUROC, :func:`fedpartial.stats.bootstrap_auc_ci`)."""
    return scores_metrics(predict(model, loader, task, device), task, classes)


def scored_mask(pred: dict[str, np.ndarray], task: str) -> np.ndarray:
    """``(N, C)`` bool: the entries a metric uses. Multi-label: the annotated ones; single-label: every class of
    the rows whose one label is annotated (one-vs-rest per class on the scored rows)."""
    if task == "multiclass":
        rows = pred["mask"].any(axis=1) & (pred["label"] * pred["mask"]).sum(axis=1).astype(bool)
        return np.repeat(rows[:, None], pred["probs"].shape[1], axis=1)
    return pred["mask"].astype(bool)


def scores_metrics(
    pred: dict[str, np.ndarray], task: str, classes: list[str], threshold: float | list[float] = 0.5
) -> dict:
    """:func:`evaluate`'s metrics of :func:`predict`'s output (multi-label thresholded metrics at ``threshold``:
    one value or ``C``)."""
    mask = scored_mask(pred, task)
    if task == "multiclass":
        result = compute_metrics(task, pred["label"], pred["probs"], classes, mask=mask[:, 0])
    else:
        result = compute_metrics(task, pred["label"], pred["probs"], classes, mask=mask, threshold=threshold)
    # bootstrap 95 % intervals of the per-class / macro AUROC (100 seeded resamples, fedpartial.stats)
    result["ci"] = bootstrap_auc_ci(pred["label"], pred["probs"], classes, mask) if len(pred["probs"]) else None
    return result
