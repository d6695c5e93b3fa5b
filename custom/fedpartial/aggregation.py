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

from typing import Mapping, NamedTuple, Sequence

import numpy as np

State = Mapping[str, np.ndarray]

_AXPY: dict = {}  # dtype -> BLAS axpy, filled on first use (scipy imported where aggregation happens: the server)


_BLAS: list = []  # the threadpoolctl controller, made on first use


def one_blas_thread():
    """A context in which BLAS runs on one thread. The server's passes over the updates (axpy, dot) are bound by
    memory, not arithmetic: a second BLAS thread buys nothing, and where the machine is busy (the server's other
    threads, a co-located site) OpenBLAS's threads wait on each other: 8 ResNet-18 updates took 0.13 s on one
    thread and 0.34-3.2 s on two on a loaded 2-core machine (``benchmarks/aggregation_speed.py``)."""
    if not _BLAS:
        from threadpoolctl import ThreadpoolController

        _BLAS.append(ThreadpoolController())
    return _BLAS[0].limit(limits=1, user_api="blas")


def _axpy(dtype: np.dtype):
    if not _AXPY:
        from scipy.linalg import blas

        _AXPY.update({np.dtype(np.float32): blas.saxpy, np.dtype(np.float64): blas.daxpy})
    return _AXPY.get(dtype)


def _add_scaled(out: np.ndarray, x: np.ndarray, a: float) -> None:
    """``out += a * x`` in place: one BLAS axpy pass when both are C-contiguous arrays of out's float dtype (the
    usual case: float32 model tensors), else numpy (a temporary for ``a * x``: integers, strided views)."""
    axpy = _axpy(out.dtype)
    if axpy is not None and x.dtype == out.dtype and out.flags.c_contiguous and x.flags.c_contiguous and out.size > 0:
        axpy(x.reshape(-1), out.reshape(-1), a=a)  # in place on out's memory (checked in tests/test_aggregation)
    else:
        out += np.multiply(x, a, dtype=out.dtype)


def weighted_average(arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """``sum_k w_k x_k / sum_k w_k`` over the first axis of the stacked arrays; keeps the dtype of ``arrays[0]``
    (integer buffers such as BatchNorm's ``num_batches_tracked`` are rounded)."""
    if len(arrays) == 0 or len(arrays) != np.size(weights):
        raise ValueError(f"need one weight per array, got {len(arrays)} arrays and {np.size(weights)} weights")
    w = averaging_weights(weights)
    first = np.asarray(arrays[0])
    dtype = first.dtype
    # accumulate in place, at least float32 (float64 stays float64, integers in float64): no (K, ...) stack of copies
    acc = np.promote_types(dtype, np.float32) if np.issubdtype(dtype, np.floating) else np.dtype(np.float64)
    out = np.empty(first.shape, acc)  # an array even for 0-d tensors
    for k, (a, wk) in enumerate(zip(arrays, w)):
        _accumulate(out, np.asarray(a), float(wk), k == 0)
    if np.issubdtype(dtype, np.integer):
        out = np.rint(out)
    return out.astype(dtype, copy=False)


def class_average(
    values: Sequence[np.ndarray] | np.ndarray, class_weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
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
    presummed: Mapping[str, np.ndarray] | None = None,
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
        presummed: ``{key: weighted_average of key}`` already summed with ``site_weights`` (the server's one read
            of the updates, :func:`change_measures`); those keys are not read again.
    """
    if not states:
        raise ValueError("no site states to aggregate")
    out: dict[str, np.ndarray] = {}
    for key in states[0]:
        arrays = [s[key] for s in states]
        plain = presummed.get(key) if presummed is not None else None
        if plain is None:
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


def _finite_sum(v: np.ndarray) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(v.sum()))


def check_update(state: State, reference: State, values: bool = True) -> str | None:
    """Why a site's update is unusable (missing / extra keys, wrong shapes or dtypes, non-finite values), or None.

    ``values=False`` checks only the structure (keys, shapes, dtypes) and reads no value: the server checks the
    values of a round's updates together with their changes (:func:`change_measures`), one read of each.
    """
    missing = sorted(set(reference) - set(state))
    extra = sorted(set(state) - set(reference))
    if missing or extra:
        return f"keys differ from the global model (missing {missing[:3]}, unexpected {extra[:3]})"
    for k, ref in reference.items():
        v = np.asarray(state[k])
        if v.shape != np.shape(ref):
            return f"tensor '{k}' has shape {v.shape}, expected {np.shape(ref)}"
        if v.dtype != np.asarray(ref).dtype:
            return f"tensor '{k}' has dtype {v.dtype}, expected {np.asarray(ref).dtype}"
        # a NaN / inf makes the sum non-finite; only one that overflowed needs the element-wise check
        if values and np.issubdtype(v.dtype, np.floating) and not _finite_sum(v) and not np.all(np.isfinite(v)):
            return f"tensor '{k}' has non-finite values"
    return None


def non_finite(state: State, squares: Mapping[str, float]) -> str | None:
    """Why an update whose squared change norms ``squares`` (:func:`change_measures`) are known is unusable: a
    tensor with a NaN / inf value (its squared change is then not finite; one whose change merely overflows has
    finite values and is left to the change bound), or None."""
    for k, sq in squares.items():
        if not np.isfinite(sq) and not np.all(np.isfinite(np.asarray(state[k]))):
            return f"tensor '{k}' has non-finite values"
    return None


# ------------------------------------------------------------------------------------------ robustness
# Plain functions used by the server before and during averaging (fedpartial.fl.aggregator: bounded changes;
# ServerRule.average: norm clipping, coordinate-wise median, trimmed mean). A site's *change* of a tensor is
# ``d_k = w_k - w_prev`` (the received global model); norms are L2 norms in the tensors' own float precision.

ROBUST = ("none", "median", "trimmed_mean")
BOUND_MODES = ("reject", "clip")


def is_float(a) -> bool:
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def lower_median(values: Sequence[float]) -> float:
    """The lower median: the ``ceil(K/2)``-th smallest of K values (an actual value; with K = 2 the smaller one,
    so a single outlier never moves it halfway, as ``np.median`` would)."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size == 0:
        raise ValueError("lower_median of no values")
    return float(v[(v.size - 1) // 2])


def change_norms(states: Sequence[State], reference: State) -> dict[str, np.ndarray]:
    """``{key: (K,) ||w_k[key] - ref[key]||_2}`` for every floating-point tensor of ``reference``."""
    return {k: np.sqrt(v) for k, v in change_measures(states, reference).squares.items()}


_CHUNK = 1 << 17  # values per block (512 KB of float32): the differences and the blocks they need stay in the cache


def _flat(a, dtype: np.dtype) -> np.ndarray:
    x = np.ravel(np.asarray(a))
    return x if x.dtype == dtype else x.astype(dtype)


class ChangeMeasures(NamedTuple):
    """What one read of K updates measures (:func:`change_measures`), per floating-point tensor of the reference."""

    squares: dict[str, np.ndarray]  # (K,) ||d_k||^2, d_k = w_k - ref
    dots: dict[str, np.ndarray]  # (K,) <d_k, Delta>, for the tensors of the step only
    reference_norms: dict[str, float]  # ||ref||
    sums: dict[str, np.ndarray]  # sum_k a_k w_k (:func:`weighted_average`'s arithmetic), when weights were given


def averaging_weights(weights: Sequence[float]) -> np.ndarray:
    """The normalised weights ``w / sum(w)`` (float64) :func:`weighted_average` applies; ValueError unless they are
    finite, non-negative and not all zero."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero: {w.tolist()}")
    return w / w.sum()


def _accumulate(out: np.ndarray, x: np.ndarray, a: float, first: bool) -> None:
    """One step of :func:`weighted_average` on a block: ``out = a * x`` for the first array, then ``out += a * x``
    (skipped for a zero weight), the same float operations in the same order, so a block-wise sum equals it."""
    if first:
        np.multiply(x, a, out=out, dtype=out.dtype)
    elif a:
        _add_scaled(out, x, a)


def change_measures(
    states: Sequence[State],
    reference: State,
    step: Mapping[str, np.ndarray] | None = None,
    weights: Sequence[float] | None = None,
) -> ChangeMeasures:
    """The changes ``d_k = w_k - ref`` of K updates measured in one read of each: ``||d_k||^2`` for every
    floating-point tensor of ``reference``, ``<d_k, Delta>`` for those of ``step`` (the last global step), and
    ``||ref||`` (the change bound's scale, :func:`change_scale`).

    ``weights``: ``(K,)`` site weights; the weighted mean of each float32 / float64 tensor is then summed on the
    same read (``sums``, equal to :func:`weighted_average` of the tensor bit for bit), so a server whose rule
    averages plainly reads each update once.

    Block by block: a block of ``ref`` (and of ``Delta``) is read once for all K updates, each block's difference
    goes through one small buffer (never written out whole), products in the tensors' own float precision
    (float32 / float64; other dtypes in float64), sums in float64. A NaN / inf value, or a change too large for
    the precision, makes a square non-finite (:func:`non_finite` tells the two apart).
    """
    out = ChangeMeasures({}, {}, {}, {})
    n = len(states)
    a = None if weights is None else averaging_weights(weights)
    if a is not None and len(a) != n:
        raise ValueError(f"need one weight per update, got {n} updates and {len(a)} weights")
    for key, ref in reference.items():
        if not is_float(ref):
            continue
        r = np.ravel(np.asarray(ref))
        dtype = r.dtype if r.dtype in (np.float32, np.float64) else np.dtype(np.float64)
        r = _flat(r, dtype)
        xs = [_flat(s[key], dtype) for s in states]
        st = None if step is None or key not in step else _flat(step[key], dtype)
        summed = a is not None and n > 0 and all(np.asarray(s[key]).dtype == dtype for s in states)
        total = np.empty(np.shape(ref), dtype) if summed else None
        flat_total = None if total is None else total.reshape(-1)
        axpy = _axpy(dtype) if summed else None
        sq, dot, rr = np.zeros(n), np.zeros(n), 0.0
        buf = np.empty(min(_CHUNK, r.size), dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            for i in range(0, r.size, _CHUNK):
                rb = r[i : i + _CHUNK]
                rr += float(np.dot(rb, rb))
                d = buf[: rb.size]
                sb = None if st is None else st[i : i + _CHUNK]
                for k, x in enumerate(xs):
                    xb = x[i : i + _CHUNK]
                    np.subtract(xb, rb, out=d)
                    sq[k] += float(np.dot(d, d))
                    if sb is not None:
                        dot[k] += float(np.dot(d, sb))
                    if flat_total is None:
                        continue
                    if k == 0:  # weighted_average's arithmetic, block by block (_accumulate)
                        np.multiply(xb, a[0], out=flat_total[i : i + _CHUNK], dtype=dtype)
                    elif a[k]:
                        axpy(xb, flat_total[i : i + _CHUNK], a=float(a[k]))
        out.squares[key], out.reference_norms[key] = sq, float(np.sqrt(rr))
        if st is not None:
            out.dots[key] = dot
        if total is not None:
            out.sums[key] = total
    return out


def change_norm(a: np.ndarray, ref: np.ndarray) -> float:
    """``||a - ref||_2`` (:func:`change_measures` of one array)."""
    return float(np.sqrt(change_measures([{"a": a}], {"a": ref}).squares["a"][0]))


def _norm(d: np.ndarray) -> float:
    """``||d||_2`` in the array's own float precision (BLAS dot; other dtypes in float64)."""
    flat = d.reshape(-1)
    if flat.dtype not in (np.float32, np.float64):
        flat = flat.astype(np.float64)
    return float(np.sqrt(np.dot(flat, flat)))


def change_scale(
    ref_norm: float,
    size: int,
    step_norm: float | None,
    floor: float = 0.04,
    abs_floor: float = 0.01,
    first_floor: float = 0.2,
) -> float:
    """The size of one tensor's change the bound is measured in (a site's change may be ``max_ratio`` times it).

    - first round of a run (``step_norm`` None: no earlier global step): the tensor's own size in the global
      model, ``max(||ref||, first_floor * sqrt(size))``; the floor (0.2 per value: with ``max_ratio`` 25 a
      change of root mean square 5 per value) covers tensors that start at zero (BatchNorm shifts and running
      means move from 0 to the data's statistics in the first round: up to 1.7 for a 32-value running mean in a
      HAM10000 run);
    - later rounds: the last global step of that tensor, ``||Delta||``, but at least ``floor * ||ref||`` and
      ``abs_floor * sqrt(size)`` (a tensor that stopped moving, or one that is (almost) zero, e.g. a BatchNorm
      shift or running mean at initialisation, must not make every small change an outlier).

    Neither depends on the other updates of the round, so the bound is the same with 2, 3 or 50 contributors.
    """
    root = float(np.sqrt(max(int(size), 1)))
    if step_norm is None:
        return max(float(ref_norm), float(first_floor) * root)
    return max(float(step_norm), float(floor) * float(ref_norm), float(abs_floor) * root)


def bound_changes(
    states: Sequence[State],
    reference: State,
    max_ratio: float,
    mode: str = "reject",
    steps: Mapping[str, float] | None = None,
    norms: Mapping[str, np.ndarray] | None = None,
    floor: float = 0.04,
    abs_floor: float = 0.01,
    reference_norms: Mapping[str, float] | None = None,
) -> tuple[list[dict[str, np.ndarray]], dict[int, str]]:
    """Bound each site's change of each tensor by ``max_ratio`` times :func:`change_scale` of that tensor.

    Args:
        states: K site states (already checked for keys / shapes / finiteness).
        reference: the global model the sites received.
        max_ratio: a change ``||d_k|| > max_ratio * change_scale`` is too large.
        mode: ``"reject"`` (the site's whole update is refused) or ``"clip"`` (the change of that tensor is scaled
            down to the bound: ``w = ref + d * bound / ||d||``).
        steps: ``{key: ||Delta||}``, the norm of each tensor's last global step (the change of the previous
            aggregation); None in the first round of a run (the bound is then relative to the tensor's own norm).
        norms: the changes' norms if already known (``{key: (K,)}`` as :func:`change_norms` returns, e.g. collected
            by :func:`change_measures`); computed here when None.
        reference_norms: ``{key: ||reference[key]||}`` if already known (:func:`change_measures`).

    Returns:
        ``(states out, {site index: why})``: with "reject" the refused sites are left out of ``states out`` (the
        others unchanged); with "clip" every site is kept and the dict names the clipped ones.
    """
    if mode not in BOUND_MODES:
        raise ValueError(f"mode must be one of {BOUND_MODES}, got {mode!r}")
    if max_ratio <= 0 or len(states) == 0:
        return [dict(s) for s in states], {}
    if norms is None:
        norms = change_norms(states, reference)
    what = "its own norm in the global model" if steps is None else "its last global step"
    why: dict[int, str] = {}
    out = [dict(s) for s in states]
    for key, nk in norms.items():
        nk = np.asarray(nk, dtype=np.float64)
        ref = np.asarray(reference[key])
        ref_norm = _norm(ref) if reference_norms is None or key not in reference_norms else reference_norms[key]
        scale = change_scale(ref_norm, ref.size, None if steps is None else steps.get(key, 0.0), floor, abs_floor)
        bound = float(max_ratio) * scale
        for k in np.flatnonzero(nk > bound):
            if k not in why:
                why[int(k)] = f"tensor '{key}' changed by {nk[k]:.4g}, more than {max_ratio:g} x {what} ({scale:.4g})"
            if mode == "clip":
                ref64 = np.asarray(reference[key], dtype=np.float64)
                d = np.asarray(states[k][key], dtype=np.float64) - ref64
                out[k][key] = (ref64 + d * (bound / nk[k])).astype(np.asarray(states[k][key]).dtype)
    if mode == "reject":
        out = [s for k, s in enumerate(out) if k not in why]
    return out, why


def step_of(
    new: State, old: State, out: Mapping[str, np.ndarray] | None = None, norms: dict[str, float] | None = None
) -> dict[str, np.ndarray]:
    """The global step ``{key: new[key] - old[key]}`` (float32) of every floating-point tensor.

    ``out``: arrays to write it into where their shapes fit (the server reuses them round after round instead of
    allocating a model's worth of memory); ``norms``: a dict filled with each tensor's ``||step||_2`` on the same
    pass (float32 products summed in float64; NaN / inf where ``new`` has such values)."""
    step = {}
    for k, v in old.items():
        if not is_float(v) or k not in new:
            continue
        buf = None if out is None else out.get(k)
        fits = isinstance(buf, np.ndarray) and buf.dtype == np.float32 and buf.shape == np.shape(v)
        o = buf if fits and buf.flags.writeable and buf.flags.c_contiguous else np.empty(np.shape(v), np.float32)
        a, b, flat = np.ravel(new[k]), np.ravel(v), o.reshape(-1)
        total = 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            for i in range(0, flat.size, _CHUNK):
                d = np.subtract(a[i : i + _CHUNK], b[i : i + _CHUNK], out=flat[i : i + _CHUNK], dtype=np.float32)
                if norms is not None:
                    total += float(np.dot(d, d))
        if norms is not None:
            norms[k] = float(np.sqrt(total))
        step[k] = o
    return step


def cosines_from(dots: Mapping[str, np.ndarray], squares: Mapping[str, np.ndarray], step_norms: Mapping[str, float]):
    """:func:`change_cosine` of each of K updates from what :func:`change_measures` measured (``<d_k, Delta>`` and
    ``||d_k||^2`` per tensor) and the step's norms ``{key: ||Delta[key]||}`` (:func:`norms_of`): ``(K,)`` cosines,
    NaN where either vector is 0 or a value is not finite; no update is read again."""
    dot = sum(np.asarray(dots[k], np.float64) for k in step_norms)
    dd = sum(np.asarray(squares[k], np.float64) for k in step_norms)
    ss = sum(float(v) ** 2 for v in step_norms.values())
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = np.asarray(dot, np.float64) / np.sqrt(np.asarray(dd, np.float64) * ss)
    return np.where((np.asarray(dd) > 0) & (ss > 0) & np.isfinite(out), out, np.nan)


def norms_of(state: Mapping[str, np.ndarray]) -> dict[str, float]:
    """``{key: ||state[key]||_2}`` (BLAS products in the arrays' own float precision)."""
    return {k: _norm(np.asarray(v)) for k, v in state.items()}


def change_cosine(state: State, reference: State, step: Mapping[str, np.ndarray]) -> float | None:
    """Cosine between a site's whole change ``d = state - reference`` and the last global step ``Delta`` (all
    floating-point tensors of ``step`` as one vector): ``<d, Delta> / (||d|| ||Delta||)``; None when either is 0.

    Honest updates continue roughly the direction the model moved last round (cosine 0.88-0.95 in
    ``tests/test_reliability_simulator.py``'s run); a reversed update, ``2 * reference - w`` (the same size as
    the site's real change, so no size bound sees it), has the opposite sign."""
    m = change_measures([state], reference, step)
    cos = float(cosines_from(m.dots, m.squares, norms_of(step))[0])
    return None if np.isnan(cos) else cos


def peer_cosines(
    states: Sequence[State], reference: State, keys: Sequence[str], which: Sequence[int] | None = None
) -> list[float | None]:
    """For each site k, the cosine between its change ``d_k = state_k - reference`` and the sum of the other sites'
    changes ``S - d_k`` (``S = sum_j d_j``), over the tensors ``keys`` as one vector:
    ``<d_k, S - d_k> / (||d_k|| ||S - d_k||)``, from ``<d_k, S>``, ``||d_k||^2`` and ``||S||^2`` (one sum of the
    changes held at a time, per tensor); None where either vector is 0 (a single site, others that cancel out).
    ``which``: the sites to compute it for (the others get None; the sum still covers every site): the server asks
    only for the updates that point against the last step, so an honest round reads no update again.

    Honest sites that start a round from the same model move roughly together, also when they all turn back
    against the model's last step (training that oscillates late in a run); a reversed update points against
    them."""
    n = len(states)
    wanted = list(range(n)) if which is None else sorted({int(k) for k in which})
    dots, sq, total = np.zeros(n), np.zeros(n), 0.0
    if not wanted:
        return [None] * n
    with np.errstate(over="ignore", invalid="ignore"):  # a hostile 1e30 change: inf, then no cosine
        for key in keys:  # one tensor at a time, one site's change at a time: memory of three tensors, not n
            ref = np.asarray(reference[key], dtype=np.float32).ravel()
            summed, d = np.zeros_like(ref), np.empty_like(ref)
            for s in states:
                np.subtract(np.asarray(s[key], dtype=np.float32).ravel(), ref, out=d)
                summed += d
            total += float(summed @ summed)
            for k in wanted:  # float32 products (BLAS), summed over tensors in float64
                np.subtract(np.asarray(states[k][key], dtype=np.float32).ravel(), ref, out=d)
                dots[k] += float(d @ summed)
                sq[k] += float(d @ d)
        out: list[float | None] = []
        for k in range(n):
            others_sq = total - 2.0 * dots[k] + sq[k]  # ||S - d_k||^2
            finite = np.isfinite([dots[k], sq[k], others_sq]).all()  # a change too large for float32 keeps no one
            if k not in wanted or not finite or sq[k] <= 0 or others_sq <= 1e-12 * max(total, sq[k]):
                out.append(None)
            else:
                out.append(float((dots[k] - sq[k]) / np.sqrt(sq[k] * others_sq)))
    return out


def clip_change_norms(states: Sequence[State], reference: State, factor: float) -> list[dict[str, np.ndarray]]:
    """Norm clipping: each site's whole change (all floating-point tensors together) is scaled down to at most
    ``factor`` times the round's median whole-change norm, ``w_k = ref + d_k * min(1, tau / ||d_k||)`` with
    ``tau = factor * lower_median_j ||d_j||``; other tensors untouched. ``factor <= 0``: no clipping."""
    if factor <= 0 or not states:
        return [dict(s) for s in states]
    per_key = change_norms(states, reference)
    total = np.sqrt(sum(v**2 for v in per_key.values())) if per_key else np.zeros(len(states))
    tau = float(factor) * lower_median(total)
    out = []
    for k, s in enumerate(states):
        scale = 1.0 if total[k] <= tau or total[k] == 0 else tau / total[k]
        new = dict(s)
        if scale < 1.0:
            for key in per_key:
                ref = np.asarray(reference[key], dtype=np.float64)
                new[key] = (ref + (np.asarray(s[key], dtype=np.float64) - ref) * scale).astype(np.asarray(s[key]).dtype)
        out.append(new)
    return out


def trim_count(k: int, trim: float) -> int:
    """Values dropped from EACH end by a trimmed mean of k values: ``ceil(trim * k)``, at most ``(k - 1) // 2``
    (at least one value is left); 0 when ``trim`` is 0."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    return min(int(np.ceil(trim * k - 1e-12)), (k - 1) // 2)


def robust_combine(arrays: Sequence[np.ndarray], how: str, trim: float = 0.2) -> np.ndarray:
    """Coordinate-wise ``"median"`` (``np.median`` over sites: the mean of the two middle values for even K) or
    ``"trimmed_mean"`` (per coordinate, drop the :func:`trim_count` smallest and largest values and average the
    rest) of K arrays, unweighted; keeps the dtype of ``arrays[0]`` (integers rounded)."""
    stacked = np.stack([np.asarray(a, dtype=np.float64) for a in arrays])
    if how == "median":
        out = np.median(stacked, axis=0)
    elif how == "trimmed_mean":
        t = trim_count(len(arrays), trim)
        s = np.sort(stacked, axis=0)
        out = s[t : len(arrays) - t].mean(axis=0)
    else:
        raise ValueError(f"how must be 'median' or 'trimmed_mean', got {how!r}")
    dtype = np.asarray(arrays[0]).dtype
    if np.issubdtype(dtype, np.integer):
        out = np.rint(out)
    return out.astype(dtype)


def robust_rows(
    rows: Sequence[np.ndarray], class_weights: np.ndarray, fallback: np.ndarray, how: str, trim: float = 0.2
) -> np.ndarray:
    """Row c = :func:`robust_combine` of the rows of the sites with ``class_weights[k, c] > 0`` (the weights
    only choose who takes part); ``fallback[c]`` where no site does."""
    a = np.asarray(class_weights, dtype=np.float64)
    out = np.array(fallback, dtype=np.asarray(rows[0]).dtype, copy=True)
    for c in range(a.shape[1]):
        holders = np.flatnonzero(a[:, c] > 0)
        if holders.size:
            out[c] = robust_combine([np.asarray(rows[k])[c] for k in holders], how, trim)
    return out


def robust_states(
    states: Sequence[State],
    site_weights: Sequence[float],
    how: str,
    trim: float = 0.2,
    row_keys: Sequence[str] = (),
    class_weights: np.ndarray | None = None,
    previous: State | None = None,
    zero_rows: str = "previous",
) -> dict[str, np.ndarray]:
    """:func:`aggregate_states` with :func:`robust_combine` in place of the weighted mean: every tensor over the
    sites with a positive site weight, classifier rows (with ``class_weights``) over the sites holding the class
    (:func:`robust_rows`); a class nobody holds keeps the previous row (``zero_rows="previous"``) or gets the
    robust combination over all sites (``"samples"``)."""
    w = np.asarray(site_weights, dtype=np.float64)
    keep = [k for k in range(len(states)) if w[k] > 0]
    if not keep:
        raise ValueError(f"weights must not be all zero: {w.tolist()}")
    out: dict[str, np.ndarray] = {}
    for key in states[0]:
        arrays = [states[k][key] for k in keep]
        plain = robust_combine(arrays, how, trim)
        if class_weights is None or key not in row_keys:
            out[key] = plain
            continue
        if zero_rows == "previous":
            fallback = previous[key] if previous is not None and key in previous else plain
        else:
            fallback = plain
        out[key] = robust_rows(arrays, np.asarray(class_weights)[keep], fallback, how, trim)
    return out
