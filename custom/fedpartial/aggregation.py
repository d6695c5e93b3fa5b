"""Server-side aggregation rules as plain functions on arrays (no NVFlare here).

A model state is a ``dict[str, np.ndarray]``. The classifier tensors (``classifier.weight`` ``(C, D)``,
``classifier.bias`` ``(C,)``) have one row per class; every rule below averages them row by row with its
own per-class weights, and averages every other tensor with per-site weights.

- FedAvg (McMahan et al.): ``w = sum_k n_k w_k / sum_k n_k`` for every tensor.
- Class-masked rows (FPSL's task-dependent aggregation, FedLSM's FedAvg*, surgical aggregation's task block):
  row c of the classifier is averaged only over the sites that annotate class c,
  ``W_c = sum_{k: c in A_k} a_k W_{k,c} / sum_{k: c in A_k} a_k`` with ``a_k = n_k`` ("samples") or
  ``a_k = 1`` ("uniform", as surgical aggregation); a class no contributing site annotates keeps the previous
  global row.
- Adaptive weighted proxy aggregation (FedLSM's AWPA): ``W_c = sum_k q_{k,c} W_{k,c} / sum_k q_{k,c}`` with
  ``q_{k,c}`` the site's estimated count of class c; when ``sum_k q_{k,c} = 0`` the row falls back to ``n_k``
  weights (the released code divides by zero there).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

State = Mapping[str, np.ndarray]


def weighted_average(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum_k w_k x_k / sum_k w_k`` over the first axis of the stacked arrays; keeps the dtype of ``arrays[0]``
    (integer buffers such as BatchNorm's ``num_batches_tracked`` are rounded)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(arrays) == 0 or len(arrays) != len(w):
        raise ValueError(f"need one weight per array, got {len(arrays)} arrays and {len(w)} weights")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero: {w.tolist()}")
    stacked = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
    out = np.tensordot(w / w.sum(), stacked, axes=1)
    dtype = np.asarray(arrays[0]).dtype
    if np.issubdtype(dtype, np.integer):
        out = np.rint(out)
    return out.astype(dtype)


def class_average(values: Sequence[np.ndarray] | np.ndarray, class_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-class average of site metadata over the sites that hold each class (classifier rows, FedMLP's
    prototypes, FedIRM's relation-matrix rows, ...).

    Args:
        values: K arrays of shape ``(C, ...)`` (entry c belongs to class c), or one ``(K, C, ...)`` array.
        class_weights: ``(K, C)`` non-negative weights of site k for class c (0 = site k does not hold c).

    Returns:
        ``(avg (C, ...) float64, held (C,) bool)``: ``sum_k a_{k,c} v_k[c] / sum_k a_{k,c}``, and whether any
        site holds class c (``avg[c]`` is 0 where none does).
    """
    a = np.asarray(class_weights, dtype=np.float64)
    stacked = np.stack([np.asarray(r, dtype=np.float64) for r in values])  # (K, C, ...)
    if a.shape != stacked.shape[:2]:
        raise ValueError(f"class_weights shape {a.shape} does not match values {stacked.shape[:2]}")
    if not np.all(np.isfinite(a)) or np.any(a < 0):
        raise ValueError("class weights must be finite and non-negative")
    total = a.sum(axis=0)  # (C,)
    safe = np.where(total > 0, total, 1.0)
    norm = (a / safe).reshape(a.shape + (1,) * (stacked.ndim - 2))
    return (norm * stacked).sum(axis=0), total > 0


def rowwise_average(rows: Sequence[np.ndarray], class_weights: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Average per-class rows with per-class site weights (:func:`class_average`), ``fallback[c]`` where class
    c has zero total weight; ``rows`` are K arrays ``(C, ...)``, ``fallback`` is ``(C, ...)``. Keeps the dtype
    of ``rows[0]``."""
    out, held = class_average(rows, class_weights)
    keep = (~held).reshape((-1,) + (1,) * (out.ndim - 1))
    out = np.where(keep, np.asarray(fallback, dtype=np.float64), out)
    return out.astype(np.asarray(rows[0]).dtype)


def aggregate_states(
    states: Sequence[State],
    site_weights: Sequence[float],
    row_keys: Sequence[str] = (),
    class_weights: np.ndarray | None = None,
    previous: State | None = None,
    zero_rows: str = "previous",
) -> dict[str, np.ndarray]:
    """Aggregate K site states.

    Args:
        states: K model states with identical keys and shapes.
        site_weights: ``(K,)`` weights for every non-classifier tensor (FedAvg: sample counts n_k).
        row_keys: the tensors averaged row by row (the classifier group), row c = class c.
        class_weights: ``(K, C)`` per-class weights for those rows; None = plain FedAvg everywhere.
        previous: the previous global state (fallback rows for ``zero_rows="previous"``).
        zero_rows: what a class with zero total weight gets: ``"previous"`` (keep the old global row) or
            ``"samples"`` (FedAvg of the row with ``site_weights``, FedLSM's AWPA fallback).
    """
    if not states:
        raise ValueError("no site states to aggregate")
    out: dict[str, np.ndarray] = {}
    for key in states[0]:
        arrays = [s[key] for s in states]
        plain = weighted_average(arrays, site_weights)
        if class_weights is None or key not in row_keys:
            out[key] = plain
            continue
        if zero_rows == "previous":
            fallback = previous[key] if previous is not None and key in previous else plain
        elif zero_rows == "samples":
            fallback = plain
        else:
            raise ValueError(f"zero_rows must be 'previous' or 'samples', got {zero_rows!r}")
        out[key] = rowwise_average(arrays, class_weights, fallback)
    return out


def masked_class_weights(annotated: np.ndarray, n_samples: Sequence[float], weighting: str = "samples") -> np.ndarray:
    """``(K, C)`` weights for class-masked rows: ``n_k`` (or 1 for ``weighting="uniform"``) where site k
    annotates class c, else 0."""
    m = np.asarray(annotated, dtype=np.float64)
    if weighting == "samples":
        return m * np.asarray(n_samples, dtype=np.float64)[:, None]
    if weighting == "uniform":
        return m
    raise ValueError(f"weighting must be 'samples' or 'uniform', got {weighting!r}")


def check_update(state: State, reference: State) -> str | None:
    """Why a site's update is unusable (missing / extra keys, wrong shapes, non-finite values), or None."""
    missing = sorted(set(reference) - set(state))
    extra = sorted(set(state) - set(reference))
    if missing or extra:
        return f"keys differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})"
    for k, ref in reference.items():
        v = np.asarray(state[k])
        if v.shape != np.shape(ref):
            return f"tensor '{k}' has shape {v.shape}, expected {np.shape(ref)}"
        if np.issubdtype(v.dtype, np.floating) and not np.all(np.isfinite(v)):
            return f"tensor '{k}' has non-finite values"
    return None
