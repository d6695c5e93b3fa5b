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


def test_the_mean_summed_on_the_checks_read_equals_weighted_average(monkeypatch):
    """change_measures with site weights sums each float tensor's weighted mean block by block on the read that
    measures the changes (blocks of 5 values here): bit for bit weighted_average's result, a zero weight skipped
    (the first site's too), 0-d tensors included, integer buffers left to the rule."""
    import fedpartial.aggregation as agg

    monkeypatch.setattr(agg, "_CHUNK", 5)
    rng = np.random.default_rng(3)
    ref = {
        "big": rng.normal(size=(4, 7)).astype(np.float32),
        "odd": rng.normal(size=13).astype(np.float64),
        "scalar": np.array(0.5, np.float32),
        "n": np.array(7, np.int64),
    }
    states = [
        {
            k: (v + rng.normal(size=v.shape)).astype(v.dtype) if k != "n" else np.array(9, np.int64)
            for k, v in ref.items()
        }
        for _ in range(4)
    ]
    for w in ([3.0, 1.0, 0.0, 2.5], [0.0, 1.0, 2.0, 1.0]):
        sums = agg.change_measures(states, ref, weights=w).sums
        assert sorted(sums) == ["big", "odd", "scalar"]
        for key, total in sums.items():
            expected = agg.weighted_average([s[key] for s in states], w)
            assert total.dtype == expected.dtype and total.shape == expected.shape
            assert np.array_equal(total, expected), key
    assert agg.change_measures(states, ref).sums == {}  # no weights: nothing summed
    with pytest.raises(ValueError, match="not all zero"):
        agg.change_measures(states, ref, weights=[0, 0, 0, 0])


def _server_round(rule_weights=None, poison=False):
    """One round of the NVFlare aggregator (fedavg) over three ResNet-like states (float tensors, an integer
    buffer): ``(new global weights, the dtypes weighted_average saw)``. ``rule_weights``: site weights the rule
    switches to after it was asked for its plain weights (a rule whose weights move inside aggregate)."""
    from nvflare.apis.dxo import DXO, DataKind, from_shareable
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.model import ModelLearnableKey
    from nvflare.app_common.app_constant import AppConstants

    import fedpartial.aggregation as aggregation
    from fedpartial.fl.aggregator import PartialLabelAggregator

    rng = np.random.default_rng(5)
    prev = {"conv": rng.normal(size=(8, 3, 3)).astype(np.float32), "fc": rng.normal(size=(3, 8)).astype(np.float32)}
    prev["bn.n"] = np.array(2, np.int64)
    updates = [{k: (v + 0.01 * rng.normal(size=v.shape)).astype(v.dtype) for k, v in prev.items()} for _ in range(3)]
    if poison:
        updates[2]["conv"] = updates[2]["conv"] + 1e4  # far past the change bound: refused
    agg = PartialLabelAggregator("fedavg")
    if rule_weights is not None:
        asked = []
        base = agg.rule.site_weights

        def moving(contributions):
            asked.append(1)
            return base(contributions) if len(asked) == 1 else np.asarray(rule_weights, np.float64)

        agg.rule.site_weights = moving

    class Engine:
        def get_component(self, _cid):
            return None

        def get_clients(self):
            return []

        def fire_event(self, *_args):
            pass

    def ctx(site=None):
        c = FLContext()
        c.set_prop(ReservedKey.ENGINE, Engine(), private=True, sticky=False)
        c.set_prop(AppConstants.CURRENT_ROUND, 1, private=True, sticky=False)
        c.set_prop(AppConstants.GLOBAL_MODEL, {ModelLearnableKey.WEIGHTS: prev}, private=True, sticky=False)
        if site:
            peer = FLContext()
            peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=True, sticky=False)
            c.set_peer_context(peer)
        return c

    for k, u in enumerate(updates):
        assert agg.accept(DXO(DataKind.WEIGHTS, u, {"n_train": 10 * (k + 1)}).to_shareable(), ctx(f"site-{k + 1}"))
    seen, real = [], aggregation.weighted_average

    def spy(arrays, weights):
        seen.append(np.asarray(arrays[0]).dtype)
        return real(arrays, weights)

    aggregation.weighted_average, saved = spy, real
    try:
        out = from_shareable(agg.aggregate(ctx())).data
    finally:
        aggregation.weighted_average = saved
    return out, seen, updates


def test_the_server_reads_each_update_once_when_the_rule_averages_plainly():
    """FedAvg's mean is summed on the read that checks the updates: the rule reads no float tensor again, and
    the model is the weighted mean itself; a refused update, or a rule whose weights moved since it was asked,
    makes the rule average on its own, and the model is then the mean of what it kept, with the weights it used."""
    out, seen, updates = _server_round()
    assert seen == [np.dtype(np.int64)]  # only the integer buffer went through weighted_average again
    for key in ("conv", "fc"):
        np.testing.assert_array_equal(out[key], weighted_average([u[key] for u in updates], [10, 20, 30]))
    out, seen, updates = _server_round(poison=True)
    assert np.dtype(np.float32) in seen  # the rule averaged the two kept updates itself
    np.testing.assert_array_equal(out["conv"], weighted_average([u["conv"] for u in updates[:2]], [10, 20]))
    out, seen, updates = _server_round(rule_weights=[1.0, 0.0, 1.0])
    np.testing.assert_array_equal(out["fc"], weighted_average([u["fc"] for u in updates], [1.0, 0.0, 1.0]))
