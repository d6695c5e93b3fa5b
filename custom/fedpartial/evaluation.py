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


@torch.no_grad()
def predict_features(
    model: torch.nn.Module, loader, device: torch.device | str = "cpu", key: str = "image"
) -> dict[str, torch.Tensor]:
    """The pooled features of every item of ``loader``: ``{"features": (N, D), "label": (N, C), "mask": (N, C),
    "index": (N,)}`` (float32 / bool / long, on the CPU; the model in eval mode, restored afterwards)."""
    was_training = model.training
    model.eval()
    out: dict[str, list] = {"features": [], "label": [], "mask": [], "index": []}
    try:
        for batch in loader:
            out["features"].append(model.features(batch[key].to(device)).float().cpu())
            for k in ("label", "mask", "index"):
                out[k].append(batch[k].cpu())
    finally:
        model.train(was_training)
    return {k: torch.cat(v) for k, v in out.items()} if out["features"] else {}


def evaluate_features(
    model: torch.nn.Module,
    loader,
    task: str,
    classes: list[str],
    score,
    device: torch.device | str = "cpu",
) -> dict:
    """Metrics of scores computed from the model's features instead of its classifier: ``score(features (N, D),
    labels (N, C), mask (N, C)) -> (N, C)`` probabilities (e.g. a kNN vote, :mod:`fedpartial.methods.selfsup`)."""
    f = predict_features(model, loader, device)
    if not f:
        return scores_metrics(
            {"probs": np.zeros((0, len(classes))), "label": np.zeros((0, len(classes))), "mask": np.zeros((0, 0))},
            task,
            classes,
        )
    probs = score(f["features"], f["label"].float(), f["mask"].bool())
    pred = {"probs": probs.numpy(), "label": f["label"].numpy(), "mask": f["mask"].numpy(), "index": f["index"].numpy()}
    return scores_metrics(pred, task, classes)


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
