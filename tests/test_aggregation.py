"""Aggregation rules against hand-computed values (two or three sites, two classes)."""

from __future__ import annotations

import numpy as np
import pytest

from fedpartial.aggregation import (
    aggregate_states,
    check_update,
    masked_class_weights,
    rowwise_average,
    weighted_average,
)
from fedpartial.methods import Contribution, get_method

KEYS = ["classifier.weight", "classifier.bias"]


def site(w_rows, b, enc):
    return {
        "encoder.w": np.array(enc, dtype=np.float32),
        "classifier.weight": np.array(w_rows, dtype=np.float32),
        "classifier.bias": np.array(b, dtype=np.float32),
        "bn.num_batches_tracked": np.array(3, dtype=np.int64),
    }


A = site([[1.0, 1.0], [2.0, 2.0]], [0.0, 10.0], [1.0])
B = site([[3.0, 3.0], [6.0, 6.0]], [4.0, 20.0], [4.0])


def test_fedavg_weighted_by_samples():
    # n = (1, 3): encoder (1*1 + 3*4)/4 = 3.25 ; bias class 0: (0 + 3*4)/4 = 3
    out = aggregate_states([A, B], [1, 3])
    assert out["encoder.w"][0] == pytest.approx(3.25)
    assert out["classifier.bias"][0] == pytest.approx(3.0)
    assert out["classifier.bias"][1] == pytest.approx((10 + 60) / 4)
    assert out["bn.num_batches_tracked"].dtype == np.int64 and out["bn.num_batches_tracked"] == 3


def test_masked_rows_only_from_labelling_sites():
    # site A labels class 0 only, site B labels both: row 0 = (1*A0 + 3*B0)/4, row 1 = B1 only
    annotated = np.array([[1, 0], [1, 1]], bool)
    cw = masked_class_weights(annotated, [1, 3])
    np.testing.assert_allclose(cw, [[1, 0], [3, 3]])
    out = aggregate_states([A, B], [1, 3], KEYS, cw, previous=A)
    np.testing.assert_allclose(out["classifier.weight"][0], [(1 * 1 + 3 * 3) / 4] * 2)
    np.testing.assert_allclose(out["classifier.weight"][1], [6.0, 6.0])
    np.testing.assert_allclose(out["classifier.bias"], [3.0, 20.0])
    assert out["encoder.w"][0] == pytest.approx(3.25)  # non-classifier tensors stay FedAvg


def test_masked_uniform_weighting_as_surgical_aggregation():
    cw = masked_class_weights(np.array([[1, 1], [1, 1]], bool), [1, 3], weighting="uniform")
    out = aggregate_states([A, B], [1, 3], KEYS, cw, previous=A)
    np.testing.assert_allclose(out["classifier.weight"][1], [4.0, 4.0])  # (2 + 6) / 2


def test_class_no_site_labels_keeps_previous_row():
    prev = site([[9.0, 9.0], [8.0, 8.0]], [7.0, 7.0], [0.0])
    cw = masked_class_weights(np.array([[1, 0], [1, 0]], bool), [1, 1])
    out = aggregate_states([A, B], [1, 1], KEYS, cw, previous=prev, zero_rows="previous")
    np.testing.assert_allclose(out["classifier.weight"][1], [8.0, 8.0])
    np.testing.assert_allclose(out["classifier.bias"][1], 7.0)


def test_zero_count_falls_back_to_sample_weights():
    # AWPA with q = 0 for class 1 everywhere: row 1 = FedAvg with n = (1, 3) = (2 + 18)/4 = 5
    q = np.array([[2.0, 0.0], [2.0, 0.0]])
    out = aggregate_states([A, B], [1, 3], KEYS, q, zero_rows="samples")
    np.testing.assert_allclose(out["classifier.weight"][1], [5.0, 5.0])
    np.testing.assert_allclose(out["classifier.weight"][0], [2.0, 2.0])  # q equal: plain mean of 1 and 3


def test_rowwise_average_shapes_and_errors():
    with pytest.raises(ValueError):
        rowwise_average([np.zeros((2, 3))], np.ones((1, 3)), np.zeros((2, 3)))
    with pytest.raises(ValueError):
        weighted_average([np.zeros(2)], [0.0])
    with pytest.raises(ValueError):
        weighted_average([np.zeros(2)], [float("nan")])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weighted_average_in_place_sums_match_numpy(dtype):
    """The BLAS axpy accumulation (contiguous float tensors) and the numpy one (strided views, integers, 0-d)
    give the weighted mean; a zero weight skips its array."""
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(4, 6)).astype(dtype) for _ in range(3)]
    w = [1.0, 2.0, 0.0]
    expected = (arrays[0] * 1 + arrays[1] * 2) / 3
    out = weighted_average(arrays, w)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    np.testing.assert_allclose(weighted_average([a.T for a in arrays], w), expected.T, rtol=1e-6)  # not contiguous
    assert weighted_average([np.array(2.5, dtype), np.array(4.0, dtype)], [1, 3]) == pytest.approx(3.625)
    ints = weighted_average([np.array(1, np.int64), np.array(4, np.int64)], [1, 3])
    assert ints.dtype == np.int64 and ints == 3  # 3.25 rounded


def test_check_update_catches_broken_updates():
    assert check_update(A, B) is None
    bad = dict(A, **{"encoder.w": np.array([np.nan], np.float32)})
    assert "non-finite" in check_update(bad, A)
    assert "shape" in check_update(dict(A, **{"encoder.w": np.zeros(2, np.float32)}), A)
    assert "keys" in check_update({k: v for k, v in A.items() if k != "encoder.w"}, A)


@pytest.mark.parametrize("method,expected_row1", [("fedavg", (2 + 6) / 2), ("fedavg_masked", 6.0)])
def test_registered_rules(method, expected_row1):
    rule_cls = get_method(method).rule
    contribs = [
        Contribution("site-1", A, 1.0, {"annotated": [True, False]}),
        Contribution("site-2", B, 1.0, {"annotated": [True, True]}),
    ]
    weights, meta = rule_cls().aggregate(A, contribs, {"classifier": KEYS}, 0)
    assert weights["classifier.weight"][1][0] == pytest.approx(expected_row1)


def test_check_update_finite_values_whose_sum_overflows_pass_and_every_non_finite_kind_fails():
    """The finiteness check sums first: a NaN / inf / -inf anywhere is refused, while finite float32 values whose
    sum overflows (3e38 + 3e38) still pass through the element-wise check."""
    ref = {"w": np.zeros(3, np.float32)}
    assert check_update({"w": np.array([3e38, 3e38, 0.0], np.float32)}, ref) is None
    for bad in (np.nan, np.inf, -np.inf):
        assert "non-finite" in check_update({"w": np.array([1.0, bad, 2.0], np.float32)}, ref)
    assert "non-finite" in check_update({"w": np.array([np.inf, -np.inf, 0.0], np.float32)}, ref)


def test_weighted_average_by_hand_keeps_dtypes_without_stacking():
    """(1 x a + 3 x b) / 4 per element for float32 / float64 arrays (dtype kept), integer buffers rounded."""
    from fedpartial.aggregation import weighted_average

    a, b = np.array([1.0, 2.0], np.float32), np.array([5.0, -2.0], np.float32)
    out = weighted_average([a, b], [1, 3])
    assert out.dtype == np.float32 and np.allclose(out, [4.0, -1.0])
    out64 = weighted_average([a.astype(np.float64), b.astype(np.float64), np.zeros(2)], [1, 3, 0])
    assert out64.dtype == np.float64 and np.allclose(out64, [4.0, -1.0])  # a zero weight leaves the average
    n = weighted_average([np.array(10, np.int64), np.array(13, np.int64)], [1, 1])  # 11.5 -> 12 (round half even)
    assert n.dtype == np.int64 and n.shape == () and int(n) == 12
