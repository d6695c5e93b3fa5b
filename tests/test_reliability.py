"""Reliability and security, unit level: robust aggregation maths by hand, update checks at the
server, what a site refuses and what leaves it, hostile manifests, and the jobs' fault-tolerance settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from fedpartial.aggregation import (
    bound_changes,
    change_cosine,
    change_norms,
    change_scale,
    check_update,
    clip_change_norms,
    lower_median,
    peer_cosines,
    robust_combine,
    robust_rows,
    robust_states,
    step_of,
    trim_count,
)
from fedpartial.data.manifest import ManifestError, read_manifest
from fedpartial.methods import Contribution, get_method

CLASSES = ["a", "b"]


# ------------------------------------------------------------------------------------------ plain maths
def test_lower_median_by_hand():
    assert lower_median([3, 1, 2]) == 2
    assert lower_median([5, 1]) == 1  # never halfway towards an outlier
    assert lower_median([4, 1, 3, 2]) == 2
    with pytest.raises(ValueError):
        lower_median([])


def _three():
    ref = {"w": np.zeros(2, np.float32), "b": np.zeros(1, np.float32), "n": np.array(7, np.int64)}
    states = [
        {"w": np.array([3, 4], np.float32), "b": np.array([0.1], np.float32), "n": np.array(9, np.int64)},
        {"w": np.array([0, 1], np.float32), "b": np.array([0.1], np.float32), "n": np.array(9, np.int64)},
        {"w": np.array([0, 2], np.float32), "b": np.array([0.1], np.float32), "n": np.array(9, np.int64)},
    ]
    return ref, states


def test_change_norms_skip_integer_buffers():
    ref, states = _three()
    norms = change_norms(states, ref)
    assert set(norms) == {"w", "b"}
    np.testing.assert_allclose(norms["w"], [5, 1, 2])
    np.testing.assert_allclose(norms["b"], [0.1, 0.1, 0.1], rtol=1e-6)


def test_change_scale_by_hand():
    # first round: the tensor's own norm, at least 0.2 per value (a tensor starting at 0)
    assert change_scale(5.0, 4, None) == 5.0
    assert change_scale(0.0, 4, None) == pytest.approx(0.2 * 2)
    # later rounds: the last global step, at least 4 % of the norm and 0.01 per value
    assert change_scale(5.0, 4, 1.0) == 1.0
    assert change_scale(5.0, 4, 0.1) == pytest.approx(0.04 * 5)
    assert change_scale(0.0, 4, 0.0) == pytest.approx(0.01 * 2)


def test_bound_changes_reject_and_clip_by_hand():
    ref, states = _three()  # w: changes 5, 1, 2 from (0, 0); b: 0.1 each
    steps = {"w": 1.0, "b": 0.1}
    # ratio 3 x the last step 1 -> bound 3: site 0 (5 > 3) is too large, whatever the other sites sent
    kept, why = bound_changes(states, ref, max_ratio=3, mode="reject", steps=steps)
    assert list(why) == [0] and "tensor 'w' changed by 5, more than 3 x its last global step (1)" in why[0]
    assert len(kept) == 2 and kept[0] is not states[1] and np.array_equal(kept[0]["w"], states[1]["w"])
    clipped, why = bound_changes(states, ref, max_ratio=3, mode="clip", steps=steps)
    assert list(why) == [0] and len(clipped) == 3
    np.testing.assert_allclose(clipped[0]["w"], [1.8, 2.4], rtol=1e-6)  # (3, 4) * 3 / 5
    assert clipped[0]["w"].dtype == np.float32 and np.array_equal(clipped[1]["w"], states[1]["w"])
    # the same updates with two contributors: each one is judged alone, so nothing changes for site 0 / 1
    assert list(bound_changes(states[:2], ref, 3, steps=steps)[1]) == [0]
    assert bound_changes(states[1:], ref, 3, steps=steps)[1] == {}
    # first round (no step): against the tensor's own norm; ref (0, 0) -> 0.2 x sqrt(2) = 0.283, x 3 = 0.849
    assert sorted(bound_changes(states, ref, 3)[1]) == [0, 1, 2]
    assert bound_changes(states, {**ref, "w": np.array([6, 8], np.float32)}, 3)[1] == {}  # ||ref|| 10 -> 30
    # a loose bound keeps everything; 0 switches it off
    assert bound_changes(states, ref, max_ratio=5, steps=steps)[1] == {}
    assert bound_changes(states, ref, max_ratio=0)[1] == {}
    with pytest.raises(ValueError):
        bound_changes(states, ref, 2, mode="ignore")


def test_two_honest_updates_of_very_different_size_are_both_kept():
    """A median of two is the smaller change: a site training 25 x more steps than the other was refused by a
    median bound; against the last global step neither is."""
    ref = {"w": np.ones(100, np.float32)}
    small, large = ({"w": np.ones(100, np.float32) + 0.001}, {"w": np.ones(100, np.float32) + 0.1})
    step = {"w": 0.5}  # last global step 0.05 per value
    assert bound_changes([small, large], ref, 25, steps=step)[1] == {}
    assert list(bound_changes([small, {"w": large["w"] * 100}], ref, 25, steps=step)[1]) == [1]


def test_change_cosine_and_step_by_hand():
    ref = {"w": np.zeros(2, np.float32), "n": np.array(3, np.int64)}
    step = step_of({"w": np.array([1.0, 0.0], np.float32), "n": np.array(5)}, ref)
    assert list(step) == ["w"] and step["w"].tolist() == [1.0, 0.0]  # integer buffers are no direction
    assert change_cosine({"w": np.array([2.0, 2.0], np.float32)}, ref, step) == pytest.approx(1 / np.sqrt(2))
    # the reversed update 2 * ref - w: the same size, the opposite cosine
    assert change_cosine({"w": np.array([-2.0, -2.0], np.float32)}, ref, step) == pytest.approx(-1 / np.sqrt(2))
    assert change_cosine({"w": np.zeros(2, np.float32)}, ref, step) is None


def test_change_norm_block_by_block_by_hand(monkeypatch):
    import fedpartial.aggregation as agg

    monkeypatch.setattr(agg, "_CHUNK", 3)  # 7 values: blocks of 3, 3 and 1
    a = np.array([3, 0, 0, 0, 0, 4, 2], np.float32)
    assert agg.change_norm(a, np.zeros(7, np.float32)) == pytest.approx(np.sqrt(9 + 16 + 4))
    assert agg.change_norm(a.reshape(7, 1), a.reshape(7, 1) + 1) == pytest.approx(np.sqrt(7))
    assert np.isnan(agg.change_norm(np.array([1, np.nan], np.float32), np.zeros(2, np.float32)))
    assert agg.change_norm(np.zeros(0, np.float32), np.zeros(0, np.float32)) == 0.0


def test_change_measures_give_the_change_norms_bound_changes_uses():
    """The server reads each update once: change_measures' squares are the squared change norms (each site's alone
    too), a NaN makes its square non-finite and non_finite names the tensor, while finite values whose change
    overflows are left to the bound; bound_changes decides on norms it is given (here deliberately not the true
    ones) instead of recomputing."""
    from fedpartial.aggregation import change_measures, non_finite

    ref, states = _three()
    squares, dots, ref_norms, _ = change_measures(states, ref)
    assert dots == {} and ref_norms == {"w": 0.0, "b": 0.0}  # floating-point tensors only
    assert change_measures(states, states[0]).reference_norms == pytest.approx({"w": 5.0, "b": 0.1})
    for key, expected in change_norms(states, ref).items():
        np.testing.assert_allclose(np.sqrt(squares[key]), expected, rtol=1e-6)
        for k, s in enumerate(states):
            d = np.asarray(s[key], np.float64) - np.asarray(ref[key], np.float64)
            assert squares[key][k] == pytest.approx(float(d.ravel() @ d.ravel()), rel=1e-6)
    bad = dict(states[0], w=np.array([np.nan, 0], np.float32))
    sq = change_measures([bad], ref).squares
    assert "tensor 'w' has non-finite values" == non_finite(bad, {k: v[0] for k, v in sq.items()})
    assert check_update(bad, ref, values=False) is None and "non-finite" in check_update(bad, ref)
    # finite values whose change overflows pass the check; their infinite change norm is refused by the bound
    huge = dict(states[0], w=np.array([3e38, -3e38], np.float32))
    sq = change_measures([huge], {**ref, "w": np.array([-3e38, 3e38], np.float32)}).squares
    assert sq["w"][0] == np.inf and non_finite(huge, {k: v[0] for k, v in sq.items()}) is None
    given = {"w": np.array([1.0, 50.0, 1.0]), "b": np.array([0.1, 0.1, 0.1])}
    steps = {"w": 1.0, "b": 0.1}
    assert list(bound_changes(states, ref, 3, steps=steps, norms=given)[1]) == [1]  # the true ones: site 0


def test_bound_changes_floor_on_unchanged_tensors():
    """A tensor the last round did not move (step 0) still refuses a huge change, but not a small one."""
    ref = {"g": np.ones(4, np.float32)}  # ||ref|| = 2 -> floor max(0.04 x 2, 0.01 x 2) = 0.08, x 25 = 2
    states = [{"g": np.ones(4, np.float32)}, {"g": np.full(4, 1e30, np.float32)}]
    assert list(bound_changes(states, ref, 25, steps={"g": 0.0})[1]) == [1]
    states[1] = {"g": np.array([1, 1, 1, 2.9], np.float32)}  # change 1.9 <= 2
    assert bound_changes(states, ref, 25, steps={"g": 0.0})[1] == {}


def test_clip_change_norms_by_hand():
    ref = {"w": np.zeros(2), "k": np.array(1)}
    states = [
        {"w": np.array([3.0, 4.0]), "k": np.array(5)},
        {"w": np.array([0.0, 1.0]), "k": np.array(5)},
        {"w": np.array([0.0, 2.0]), "k": np.array(5)},
    ]
    out = clip_change_norms(states, ref, factor=1.0)  # tau = 1 x lower median (5, 1, 2) = 2
    np.testing.assert_allclose(out[0]["w"], [1.2, 1.6])  # (3, 4) * 2 / 5
    np.testing.assert_allclose(out[1]["w"], [0, 1])
    np.testing.assert_allclose(out[2]["w"], [0, 2])  # exactly at tau: untouched
    assert out[0]["k"] == 5  # integer buffers untouched
    assert clip_change_norms(states, ref, 0)[0]["w"].tolist() == [3.0, 4.0]


def test_trim_count_by_hand():
    assert trim_count(3, 0.2) == 1  # ceil(0.6)
    assert trim_count(10, 0.2) == 2
    assert trim_count(2, 0.2) == 0  # at least one value left
    assert trim_count(4, 0.4) == 1  # ceil(1.6) = 2, capped at (4 - 1) // 2
    assert trim_count(5, 0.0) == 0
    with pytest.raises(ValueError):
        trim_count(5, 0.5)


def test_robust_combine_by_hand():
    np.testing.assert_allclose(robust_combine([np.array([1.0]), np.array([100.0]), np.array([3.0])], "median"), [3])
    np.testing.assert_allclose(robust_combine([np.array([1.0, 2.0]), np.array([3.0, 4.0])], "median"), [2, 3])
    vals = [np.array([v], np.float32) for v in (1, 2, 3, 100, 4)]
    out = robust_combine(vals, "trimmed_mean", 0.2)  # drop 1 and 100: (2 + 3 + 4) / 3
    assert out.dtype == np.float32 and out.tolist() == [3.0]
    ints = robust_combine([np.array(1), np.array(2)], "median")  # 1.5 -> rounded, dtype kept
    assert ints.dtype == np.asarray(1).dtype and int(ints) == 2
    with pytest.raises(ValueError):
        robust_combine(vals, "mean")


def test_robust_rows_over_the_holders_only():
    rows = [np.array([[1.0], [10.0]]), np.array([[2.0], [20.0]]), np.array([[30.0], [1000.0]])]
    cw = np.array([[1, 1], [1, 0], [1, 1]])  # site 1 does not hold class 1
    out = robust_rows(rows, cw, fallback=np.array([[-1.0], [-1.0]]), how="median")
    np.testing.assert_allclose(out, [[2.0], [505.0]])  # median(1, 2, 30); median(10, 1000)
    out = robust_rows(rows, np.array([[1, 0], [1, 0], [1, 0]]), np.array([[-1.0], [-7.0]]), "median")
    np.testing.assert_allclose(out, [[2.0], [-7.0]])  # nobody holds class 1: the fallback (previous row)


def test_robust_states_ignore_zero_weight_sites():
    states = [{"x": np.array([1.0])}, {"x": np.array([2.0])}, {"x": np.array([9.0])}, {"x": np.array([1e9])}]
    out = robust_states(states, [1, 1, 1, 0], "median")
    assert out["x"].tolist() == [2.0]


def test_check_update_refuses_wrong_dtype():
    ref = {"w": np.zeros(2, np.float32)}
    assert "dtype float64" in check_update({"w": np.zeros(2)}, ref)
    assert "non-finite" in check_update({"w": np.array([np.inf, 0], np.float32)}, ref)
    assert check_update({"w": np.ones(2, np.float32)}, ref) is None


# ------------------------------------------------------------------------------------------ rule options
def _contribs(values, n=(10, 10, 10)):
    return [
        Contribution(site=f"s{i}", weights={"x": np.array([v], np.float32)}, n=float(k), meta={})
        for i, (v, k) in enumerate(zip(values, n))
    ]


@pytest.mark.parametrize("method", ["fedavg", "fedavg_masked", "fedmlp", "fedlsm", "surgical"])
def test_robust_options_exist_under_every_rule(method):
    rule = get_method(method).make_rule({"robust": "median", "clip_norm": 2.0})
    assert rule.opts.robust == "median" and rule.opts.clip_norm == 2.0 and rule.opts.trim == 0.2
    out = rule.average({"x": np.array([0.0], np.float32)}, _contribs([1.0, 2.0, 1e6]), {})
    assert out["x"].tolist() == [2.0]  # median after clipping (1e6 -> 2 x lower median 2 = 4): median(1, 2, 4)


def test_rule_average_options_by_hand():
    prev = {"x": np.array([0.0], np.float32)}
    fedavg = get_method("fedavg")
    assert fedavg.make_rule({}).average(prev, _contribs([1.0, 2.0, 9.0], (1, 1, 2)), {})["x"].tolist() == [5.25]
    # trimmed mean of 5 values with trim 0.2 drops one at each end
    c5 = [
        Contribution(site=f"s{i}", weights={"x": np.array([v], np.float32)}, n=1.0, meta={})
        for i, v in enumerate((1, 2, 3, 100, 4))
    ]
    assert fedavg.make_rule({"robust": "trimmed_mean"}).average(prev, c5, {})["x"].tolist() == [3.0]
    # clipping alone: (1, 2, 9) with tau = 1 x 2 -> (1, 2, 2), weights (1, 1, 2): (1 + 2 + 4) / 4
    assert fedavg.make_rule({"clip_norm": 1.0}).average(prev, _contribs([1.0, 2.0, 9.0], (1, 1, 2)), {})[
        "x"
    ].tolist() == [1.75]
    with pytest.raises(ValueError):
        fedavg.make_rule({"trim": 0.6})
    with pytest.raises(ValueError):
        fedavg.make_rule({"robust": "mode"})


# ------------------------------------------------------------------------------------------ the aggregator
class _Engine:
    def __init__(self, components, clients=()):
        self.components, self.clients = components, clients

    def get_component(self, cid):
        return self.components.get(cid)

    def get_clients(self):
        return [type("C", (), {"name": c})() for c in self.clients]

    def fire_event(self, *args, **kwargs):  # error logs fire an event in NVFlare 2.9
        pass


def _ctx(engine, site: str | None = None, rnd: int = 1, prev=None):
    from nvflare.apis.fl_constant import FLContextKey, ReservedKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.model import ModelLearnableKey
    from nvflare.app_common.app_constant import AppConstants

    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, engine, private=True, sticky=False)
    ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
    if prev is not None:
        ctx.set_prop(AppConstants.GLOBAL_MODEL, {ModelLearnableKey.WEIGHTS: prev}, private=True, sticky=False)
    if site:
        peer = FLContext()
        peer.set_prop(FLContextKey.CLIENT_NAME, site, private=False, sticky=False)
        peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
        ctx.set_peer_context(peer)
    return ctx


def _update(weights, n):
    from nvflare.apis.dxo import DXO, DataKind

    return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta={"n_train": n}).to_shareable()


def _aggregator(sites=("site-1", "site-2", "site-3", "site-4"), n_train=20):
    from fedpartial.fl.aggregator import PartialLabelAggregator

    agg = PartialLabelAggregator(method="fedavg")
    summary = type("S", (), {"summary": {"classes": CLASSES, "sites": {s: {"n_train": n_train} for s in sites}}})()
    return agg, _Engine({"data_summary": summary, "aggregator": agg}, sites)


@pytest.mark.parametrize(
    "n, why",
    [
        (1e12, "exceeds the 20 training images"),
        ("abc", "is not a number"),
        (3.5, "not a positive integer"),
        (0, "not a positive integer"),
        (float("nan"), "not a positive integer"),
        (-4, "not a positive integer"),
    ],
)
def test_sample_count_checked_against_the_data_check(n, why):
    agg, engine = _aggregator()
    prev = {"x": np.zeros(2, np.float32)}
    assert not agg.accept(_update({"x": np.ones(2, np.float32)}, n), _ctx(engine, "site-1", prev=prev))
    assert agg.rejected and why in agg.rejected[0][1], agg.rejected
    assert agg.accept(_update({"x": np.ones(2, np.float32)}, 20), _ctx(engine, "site-2", prev=prev))


def test_site_absent_from_the_data_check_is_refused():
    agg, engine = _aggregator(sites=("site-1",))
    prev = {"x": np.zeros(2, np.float32)}
    assert not agg.accept(_update({"x": np.ones(2, np.float32)}, 5), _ctx(engine, "site-9", prev=prev))
    assert "did not pass the data check" in agg.rejected[0][1]


def _round(agg, engine, updates: dict, prev: dict, rnd: int):
    from nvflare.apis.dxo import from_shareable

    for site, w in updates.items():
        assert agg.accept(_update({"x": np.asarray(w, np.float32)}, 20), _ctx(engine, site, rnd, prev=prev))
    return from_shareable(agg.aggregate(_ctx(engine, rnd=rnd, prev=prev)))


def test_aggregate_refuses_outliers_and_records_missing_sites():
    from fedpartial.fl.keys import META_CLIPPED, META_MISSING, META_REJECTED

    agg, engine = _aggregator()
    prev = {"x": np.ones(2, np.float32)}  # ||x|| = 1.41: the first round bounds changes by 25 x 1.41 = 35.4
    updates = {"site-1": [1.1, 1.0], "site-2": [1.0, 1.2], "site-3": [41.0, 1.0]}  # site-4 never answers
    out = _round(agg, engine, updates, prev, rnd=0)
    np.testing.assert_allclose(out.data["x"], [1.05, 1.1], rtol=1e-6)  # the two honest sites only
    assert out.meta[META_MISSING] == ["site-4"] and list(out.meta[META_REJECTED]) == ["site-3"]
    assert "changed by 40, more than 25 x its own norm in the global model" in out.meta[META_REJECTED]["site-3"]
    assert out.meta[META_CLIPPED] == []
    # round 1: the last step (0.05, 0.1), norm 0.112, is the scale: 25 x 0.112 = 2.8 (the 4 % floor is 0.06)
    prev = {"x": np.array([1.05, 1.1], np.float32)}
    out = _round(agg, engine, {"site-1": [1.1, 1.2], "site-2": [1.05, 4.0]}, prev, rnd=1)
    assert (
        list(out.meta[META_REJECTED]) == ["site-2"]
        and "its last global step (0.1118)" in out.meta[META_REJECTED]["site-2"]
    )

    clip, engine = _aggregator()
    clip.on_large_change = "clip"
    out = _round(clip, engine, updates, {"x": np.ones(2, np.float32)}, rnd=0)
    # site-3 clipped to 25 x sqrt(2): x = 1 + 40 * 35.36 / 40 -> (2.1 + 36.36) / 3, 3.2 / 3
    np.testing.assert_allclose(out.data["x"], [(1.1 + 1.0 + 1 + 25 * np.sqrt(2)) / 3, 3.2 / 3], rtol=1e-5)
    assert out.meta[META_CLIPPED] == ["site-3"] and out.meta[META_REJECTED] == {}


def test_peer_cosines_by_hand():
    """Changes from a reference 0: d1 = (1, 0), d2 = (1, 1), d3 = (-1, 0); S = (1, 1). Site 1 against the others'
    (0, 1): 0; site 2 against (0, 0): None; site 3 against (2, 1): -2 / sqrt(5). One site alone: None."""
    ref = {"w": np.zeros(2)}
    states = [{"w": np.array(v, np.float32)} for v in ([1.0, 0.0], [1.0, 1.0], [-1.0, 0.0])]
    got = peer_cosines(states, ref, ["w"])
    assert got[0] == pytest.approx(0.0, abs=1e-12) and got[1] is None
    assert got[2] == pytest.approx(-2 / np.sqrt(5))
    assert peer_cosines(states[:1], ref, ["w"]) == [None]
    with np.errstate(over="ignore", invalid="ignore"):  # a 1e30 change: no cosine, so it can keep no one
        assert peer_cosines([*states[:2], {"w": np.full(2, 1e30, np.float32)}], ref, ["w"]) == [None] * 3
    # over two tensors as one vector: the same as concatenated
    split = [{"a": s["w"][:1], "b": s["w"][1:]} for s in states]
    assert peer_cosines(split, {"a": np.zeros(1), "b": np.zeros(1)}, ["a", "b"])[2] == pytest.approx(got[2])


def test_honest_sites_turning_back_together_are_kept_and_a_reversed_one_among_them_is_not():
    """Late in a run training can oscillate: every honest site's change points against the model's last step
    (cosine -1 here) but with the others (cosine > 0): none is refused. The same round with site-3 reversed
    (2 x global - local): site-3 points against the others too and is refused, naming both cosines."""
    from fedpartial.fl.keys import META_REJECTED

    sites = ("site-1", "site-2", "site-3")
    agg, engine = _aggregator(sites=sites)
    prev = {"x": np.ones(4, np.float32)}
    out = _round(agg, engine, {s: [1.1, 1.1, 1.1, 1.1] for s in sites}, prev, rnd=0)  # last step +0.1
    prev = {"x": out.data["x"]}
    back = [
        prev["x"] - np.array(d, np.float32)
        for d in ([0.05, 0.04, 0.06, 0.05], [0.04, 0.05, 0.05, 0.06], [0.06, 0.05, 0.04, 0.05])
    ]
    out = _round(agg, engine, dict(zip(sites, back)), prev, rnd=1)
    assert out.meta[META_REJECTED] == {}, out.meta[META_REJECTED]
    prev = {"x": out.data["x"]}  # last step now about -0.05: sites that go on down agree with it
    down = [prev["x"] - np.array(d, np.float32) for d in ([0.05, 0.04, 0.06, 0.05], [0.04, 0.05, 0.05, 0.06])]
    updates = {"site-1": down[0], "site-2": down[1], "site-3": 2 * prev["x"] - down[0]}
    out = _round(agg, engine, updates, prev, rnd=2)
    assert list(out.meta[META_REJECTED]) == ["site-3"], out.meta[META_REJECTED]
    assert "and against the other sites' changes, cosine -0.9" in out.meta[META_REJECTED]["site-3"]


def test_two_site_rounds_judge_each_update_alone():
    """With two contributors nothing is compared with the other update: two honest updates 100 x apart are both
    averaged; a reversed update (2 x global - local) is refused by the direction check, a 1e30 one by size."""
    from fedpartial.fl.keys import META_REJECTED

    agg, engine = _aggregator(sites=("site-1", "site-2"))
    prev = {"x": np.ones(4, np.float32)}
    out = _round(agg, engine, {"site-1": [1.001] * 4, "site-2": [1.1] * 4}, prev, rnd=0)
    assert out.meta[META_REJECTED] == {}
    np.testing.assert_allclose(out.data["x"], [1.0505] * 4, rtol=1e-6)
    prev = {"x": out.data["x"]}  # last step +0.0505 per value
    honest = prev["x"] + np.array([0.05, 0.04, 0.06, 0.05], np.float32)
    out = _round(agg, engine, {"site-1": honest, "site-2": 2 * prev["x"] - honest}, prev, rnd=1)
    assert list(out.meta[META_REJECTED]) == ["site-2"], out.meta[META_REJECTED]
    assert "points against the model's last step (cosine -0.99" in out.meta[META_REJECTED]["site-2"]
    prev = {"x": out.data["x"]}
    out = _round(agg, engine, {"site-1": prev["x"] + 0.01, "site-2": np.full(4, 1e30)}, prev, rnd=2)
    assert list(out.meta[META_REJECTED]) == ["site-2"] and "changed by" in out.meta[META_REJECTED]["site-2"]
    # the direction check can be switched off; the step survives a checkpoint
    state = agg.checkpoint_state()
    again, engine = _aggregator(sites=("site-1", "site-2"))
    again.min_cosine = None
    again.restore_checkpoint(state)
    np.testing.assert_allclose(again._step["x"], agg._step["x"])
    out = _round(again, engine, {"site-1": prev["x"] + 0.01, "site-2": prev["x"] - 0.01}, prev, rnd=3)
    assert out.meta[META_REJECTED] == {}


def test_bad_bound_settings_are_config_errors():
    from fedpartial.fl.aggregator import PartialLabelAggregator

    assert "on_large_change" in PartialLabelAggregator(on_large_change="ignore").config_error
    assert "min_cosine" in PartialLabelAggregator(min_cosine=2).config_error
    assert PartialLabelAggregator().config_error is None


# ------------------------------------------------------------------------------------------ the site
def test_site_refuses_a_non_finite_global_model():
    from fedpartial.fl.executor import PartialLabelExecutor

    with pytest.raises(ValueError, match="refusing the received global model"):
        PartialLabelExecutor._check_received({"a": np.ones(2, np.float32), "b": np.array([np.nan], np.float32)})
    PartialLabelExecutor._check_received({"a": np.ones(2, np.float32), "n": np.array(3)})


def test_errors_leaving_a_site_name_paths_relative_to_the_data_root(tmp_path):
    from fedpartial.data.site_config import SiteData
    from fedpartial.fl.executor import PartialLabelExecutor

    ex = PartialLabelExecutor(dataset="ich_phantom")
    root = tmp_path / "hospital" / "data"
    cfg = tmp_path / "local" / "fedpartial_data.json"
    ex.site_data = SiteData("site-1", "ich_phantom", root, root / "train.csv", None, None, origin=f"site-config:{cfg}")
    msg = ex._relative(f"cannot read image {root}/scans/1.png; manifest {cfg.parent}/train.csv")
    assert msg == "cannot read image scans/1.png; manifest train.csv" and str(tmp_path) not in msg


def test_summary_sent_to_sites_carries_no_configuration():
    from fedpartial.fl.data_check import shared_summary

    summary = {
        "classes": CLASSES,
        "sites": {
            "site-1": {
                "n_train": 3,
                "annotated": [True, False],
                "positives": [1, 0],
                "negatives": [2, 0],
                "n_val": 0,
                "n_test": 0,
                "origin": "site-config:/secret/hospital/fedpartial_data.json",
                "vocabulary": {"columns": {"x": "a"}},
                "synthetic": False,
                "classes": CLASSES,
                "eval_sets": {},
            }
        },
    }
    out = shared_summary(summary)
    assert "origin" not in out["sites"]["site-1"] and "vocabulary" not in out["sites"]["site-1"]
    assert "/secret" not in json.dumps(out) and out["sites"]["site-1"]["positives"] == [1, 0]
    assert "origin" in summary["sites"]["site-1"]  # the server's own copy is untouched


def test_min_count_drops_small_per_class_statistics_by_hand():
    from fedpartial.fl.data_check import suppress_small_counts

    meta = {
        "fedmlp_p0": np.ones((3, 2), np.float32),
        "fedmlp_p1": np.full((3, 2), 2, np.float32),
        "fedmlp_proto_counts": np.array([[10, 4], [0, 5], [1, 7]]),
        "fedlsm_q": np.array([0.0, 4.5, 5.0]),
        "other": [1, 2],
    }
    out, dropped = suppress_small_counts(meta, 5)
    # P1 of class 0 (4 images) and P0 of class 2 (1 image) dropped; counts of 0 and >= 5 kept
    assert out["fedmlp_proto_counts"].tolist() == [[10, 0], [0, 5], [0, 7]]
    assert out["fedmlp_p1"][0].tolist() == [0, 0] and out["fedmlp_p1"][1].tolist() == [2, 2]
    assert out["fedmlp_p0"][2].tolist() == [0, 0] and out["fedmlp_p0"][0].tolist() == [1, 1]
    assert out["fedlsm_q"].tolist() == [0.0, 0.0, 5.0]
    assert sorted(dropped) == ["fedlsm_q[1]", "fedmlp_p0[2]", "fedmlp_p1[0]"]
    assert meta["fedmlp_proto_counts"][0, 1] == 4 and out["other"] == [1, 2]  # the input is not modified
    assert suppress_small_counts(meta, 1)[1] == []


# ------------------------------------------------------------------------------------------ manifests
@pytest.fixture
def site(tmp_path):
    from PIL import Image

    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (8, 8), (i * 50, 0, 0)).save(root / "img" / f"{i}.png")
    (tmp_path / "outside.png").write_bytes((root / "img" / "0.png").read_bytes())
    return root


def _read(root, rows, **kw):
    f = root / "m.csv"
    f.write_text("image,a,b\n" + "\n".join(rows) + "\n")
    return read_manifest(f, CLASSES, data_root=root, site="site-1", verify_images=True, duplicates="error", **kw)


@pytest.mark.parametrize("path", ["../outside.png", "img/../../outside.png", "/etc/hostname"])
def test_paths_outside_the_data_root_are_refused(site, path):
    with pytest.raises(ManifestError, match="outside the site's data root") as e:
        _read(site, ["img/0.png,1,0", f"{path},0,1"])
    assert e.value.row == 3 and str(site.parent) not in str(e.value).replace(str(site / "m.csv"), "")


def test_symlink_escaping_the_data_root_is_refused(site):
    os.symlink(site.parent / "outside.png", site / "img" / "link.png")
    with pytest.raises(ManifestError, match="outside the site's data root"):
        _read(site, ["img/0.png,1,0", "img/link.png,0,1"])
    os.symlink(site / "img" / "1.png", site / "inside.png")  # a link that stays inside is fine
    assert len(_read(site, ["img/0.png,1,0", "inside.png,0,1", f"{site}/img/2.png,1,1"])) == 3


def test_duplicate_and_conflicting_rows(site):
    with pytest.raises(ManifestError, match=r"listed twice \(lines 2 and 4\); keep") as e:
        _read(site, ["img/0.png,1,0", "img/1.png,0,1", "img/0.png,1,0"])
    assert e.value.row == 4
    with pytest.raises(ManifestError, match="lines 2 and 3.*conflicting labels"):
        _read(site, ["img/0.png,1,0", "img/./0.png,0,0"])


def test_truncated_png_and_corrupt_dicom_fail_the_data_check(site):
    data = (site / "img" / "2.png").read_bytes()
    (site / "img" / "2.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ManifestError, match="not a readable image: img/2.png") as e:
        _read(site, ["img/0.png,1,0", "img/2.png,0,1"])
    assert e.value.row == 3 and str(site / "img") not in str(e.value)
    (site / "img" / "bad.dcm").write_bytes(b"\0" * 128 + b"DICM" + os.urandom(200))
    with pytest.raises(ManifestError, match="not a readable image: img/bad.dcm"):
        _read(site, ["img/0.png,1,0", "img/bad.dcm,0,1"])
    assert len(_read(site, ["img/0.png,1,0", "img/1.png,0,1"])) == 2


def test_truncated_dicom_pixel_data_is_found():
    pytest.importorskip("pydicom")
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian

    from fedpartial.data.transforms import ImageLoadError, check_image_header

    def write(path, n_bytes):
        meta = FileMetaDataset()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = "1.2.840.10008.5.1.4.1.1.2", "1.2.3.4"
        ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
        ds.Rows, ds.Columns, ds.BitsAllocated, ds.SamplesPerPixel = 4, 4, 16, 1
        ds.BitsStored, ds.HighBit, ds.PixelRepresentation, ds.PhotometricInterpretation = 16, 15, 0, "MONOCHROME2"
        ds.PixelData = b"\1" * n_bytes
        ds.save_as(str(path), enforce_file_format=True)
        return path

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        check_image_header(write(Path(d) / "ok.dcm", 32))
        with pytest.raises(ImageLoadError, match="truncated"):
            check_image_header(write(Path(d) / "short.dcm", 8))


# ------------------------------------------------------------------------------------------ jobs
def test_num_rounds_below_one_is_an_error_before_training():
    from fedpartial.fl.selection import ScatterAndGather

    with pytest.raises(ValueError, match="num_rounds must be an integer >= 1"):
        ScatterAndGather(min_clients=3, num_rounds=0)
    sag = ScatterAndGather(min_clients=5, num_rounds=2, max_missing=1)
    assert sag._min_clients == 4 and sag.max_missing == 1
    with pytest.raises(ValueError, match="max_missing"):
        ScatterAndGather(min_clients=2, num_rounds=2, max_missing=2)


def test_new_job_tolerates_a_missing_site(tmp_path):
    from fedpartial.job_layout import harden_job
    from fedpartial.tools.new_job import main

    assert main([str(tmp_path / "j"), "--method", "fedavg", "--dataset", "ich_phantom", "--sites", "4"]) == 0
    cfg = json.loads((tmp_path / "j/app/config/config_fed_server.json").read_text())
    wf = {w["id"]: w["args"] for w in cfg["workflows"]}
    assert cfg["max_missing_sites"] == 1 and cfg["min_clients"] == 4
    assert wf["scatter_and_gather"]["max_missing"] == "{max_missing_sites}"
    assert (
        wf["scatter_and_gather"]["train_timeout"] > 0 and wf["scatter_and_gather"]["wait_time_after_min_received"] > 0
    )
    assert wf["data_check"]["timeout"] > 0 and wf["cross_site_validate"]["validation_timeout"] <= 1800
    client = json.loads((tmp_path / "j/app/config/config_fed_client.json").read_text())
    assert client["task_result_filters"][0]["filters"][0]["args"] == {"min_count": 5}
    before = {p.name: p.read_text() for p in (tmp_path / "j/app/config").iterdir()}
    harden_job(tmp_path / "j")  # idempotent
    assert before == {p.name: p.read_text() for p in (tmp_path / "j/app/config").iterdir()}
    assert (
        main(
            [
                str(tmp_path / "k"),
                "--method",
                "fedavg",
                "--dataset",
                "ich_phantom",
                "--sites",
                "4",
                "--max-missing",
                "0",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "k/app/config/config_fed_server.json").read_text())["max_missing_sites"] == 0
    with pytest.raises(ValueError, match="num_rounds"):
        main([str(tmp_path / "z"), "--method", "fedavg", "--dataset", "ich_phantom", "--sites", "4", "--rounds", "0"])


def test_every_shipped_job_is_hardened():
    from fedpartial.job_layout import DATA_CHECK_TIMEOUT, TRAIN_TIMEOUT
    from fedpartial.tools.build_jobs import training_jobs

    repo = Path(__file__).resolve().parents[1]
    for job in training_jobs(repo / "jobs"):  # the statistics jobs run NVFlare's statistics workflow instead
        server = job / "app/config/config_fed_server.json"
        cfg = json.loads(server.read_text())
        wf = {w["path"].rsplit(".", 1)[-1]: w["args"] for w in cfg["workflows"]}
        assert 0 <= cfg["max_missing_sites"] < cfg["min_clients"], server
        assert wf["ScatterAndGather"]["train_timeout"] == TRAIN_TIMEOUT, server
        assert wf["BroadcastAndProcess"]["timeout"] == DATA_CHECK_TIMEOUT, server
        client = json.loads((server.parent / "config_fed_client.json").read_text())
        assert any(f["path"].endswith("MinCountFilter") for e in client["task_result_filters"] for f in e["filters"])


def test_compact_results_keep_the_refused_updates():
    """``run_jobs.py --compact`` (the tables' input) keeps each round's ``rejected``."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("run_jobs_compact", REPO / "benchmarks" / "run_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = {
        "method": "fedavg",
        "rounds": [
            {"round": 0, "val": {"macro": {"auc": 0.5}}, "test": None, "rejected": {"site-2": "round 0: too large"}},
            {"round": 1},
        ],
    }
    curves = mod.compact(res)["curves"]
    assert curves[0]["rejected"] == {"site-2": "round 0: too large"} and curves[1]["rejected"] == {}


@pytest.mark.parametrize("policy", ["stop", "train_without"])
def test_a_class_annotated_only_at_an_absent_site_follows_the_policy(policy):
    """site-3 (the only annotator of class b) does not answer the data check; max_missing 1 lets the job go on
    without it: ``stop`` fails the check naming the class and the absent site, ``train_without`` warns and goes on,
    recording the class. A class no site annotates at all (nothing absent) always stops."""
    from fedpartial.fl.data_check import DataSummaryProcessor

    proc = DataSummaryProcessor(classes=CLASSES, max_missing=1, class_without_annotator=policy)
    engine = _Engine({"aggregator": None}, ("site-1", "site-2", "site-3"))
    proc.system_panic = lambda reason, ctx: setattr(proc, "panicked", reason)
    for site in ("site-1", "site-2"):
        proc._sites[site] = {"classes": CLASSES, "annotated": [True, False], "n_train": 10, "positives": [3, 0]}
    ok = proc.final_process(_ctx(engine))
    if policy == "stop":
        assert (
            not ok
            and "class(es) ['b'] are annotated by none of the sites present (site-1, site-2), only by the "
            "absent site(s) ['site-3'] (class_without_annotator: stop"
            in proc.error
        )
    else:
        assert ok and proc.summary["unannotated_classes"] == ["b"] and proc.error is None
    strict = DataSummaryProcessor(classes=CLASSES, max_missing=0, class_without_annotator="train_without")
    strict.system_panic = lambda reason, ctx: None
    strict._sites = {s: {"classes": CLASSES, "annotated": [True, False]} for s in ("site-1", "site-2")}
    assert not strict.final_process(_ctx(_Engine({"aggregator": None}, ("site-1", "site-2"))))
    assert "annotated by no site" in strict.error
    with pytest.raises(ValueError, match="class_without_annotator"):
        DataSummaryProcessor(class_without_annotator="ignore")


def test_degradation_names_lost_sites_refused_updates_and_lost_classes():
    from fedpartial.fl.report import degradation

    per_class = {"val": {"per_class": {"a": {}, "b": {}}}}
    res = {
        "data": {"sites": {"h1": {"annotated": [0]}, "h2": {"annotated": [0]}, "h3": {"annotated": [1]}}},
        "rounds": [
            {"round": 0, "missing": [], "rejected": {}, **per_class},
            {"round": 1, "missing": ["h3"], "rejected": {"h2": "too large"}},
            {"round": 2, "missing": ["h3"], "rejected": {}},
        ],
    }
    d = degradation(res)
    assert d["missing_sites"] == {"h3": [1, 2]} and d["rejected_sites"] == {"h2": [1]}
    assert d["final_without"] == ["h3"] and d["classes_without_annotator"] == ["b"]
    assert d["reasons"] == [
        "site h3 sent no update in round(s) 1-2 of 3 (dead, slow or failed)",
        "site h2's update was refused in round(s) 1: too large",
        "the final evaluation ran without h3",
        "class(es) ['b'] had no annotating site at the end (not learnt from then on)",
    ]
    for r in res["rounds"]:
        r["missing"], r["rejected"] = [], {}
    assert degradation(res) is None


def test_final_evaluation_leaves_out_a_lost_site_only_where_sites_can_die(monkeypatch):
    """``CrossSiteEval`` skips the sites the last training round lost in a deployment (a dead hospital would hold
    the evaluation until its timeout), but not in the simulator, where such a site was only slow (leaving it out
    dropped the one site holding the test set from a loaded machine's run)."""
    from types import SimpleNamespace

    from nvflare.app_common.workflows.cross_site_model_eval import CrossSiteModelEval

    from fedpartial.fl.selection import SIMULATOR_JOB_ID, CrossSiteEval

    def start(self, fl_ctx):
        self._participating_clients = ["site-1", "site-2", "site-3"]

    monkeypatch.setattr(CrossSiteModelEval, "start_controller", start)
    aggregator = SimpleNamespace(last_missing=["site-1"])
    for job_id, expected in ((SIMULATOR_JOB_ID, ["site-1", "site-2", "site-3"]), ("4f0c-job", ["site-2", "site-3"])):
        ev = CrossSiteEval()
        ev._engine = SimpleNamespace(get_component=lambda cid: aggregator)
        ev.log_warning = lambda ctx, msg: None
        ev.start_controller(SimpleNamespace(get_job_id=lambda: job_id))
        assert ev._participating_clients == expected, job_id
        assert ev.left_out == ([] if job_id == SIMULATOR_JOB_ID else ["site-1"])


def test_a_deployed_round_does_not_wait_for_a_site_known_to_be_gone(monkeypatch):
    """Once ``min_clients - max_missing`` sites answered, a deployed round closes at once when every site still out
    is gone (never fetched the round's task, and sent nothing last round or is deemed disconnected by NVFlare);
    it waits as before for a site that fetched the task (alive, slow, or died mid-round), for a site that only
    has not fetched yet but was fine last round, and in the simulator (sites train in turns there)."""
    from types import SimpleNamespace

    from nvflare.apis.controller_spec import TaskCompletionStatus
    from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather as _SAG

    from fedpartial.fl.selection import SIMULATOR_JOB_ID, ScatterAndGather

    monkeypatch.setattr(_SAG, "_process_train_result", lambda self, ct, ctx: None)

    def round_of(answered, fetched, last_missing=(), disconnected=(), job_id="4f0c-job"):
        sag = ScatterAndGather(min_clients=4, num_rounds=3, max_missing=1)
        aggregator = SimpleNamespace(last_missing=list(last_missing))
        sag._engine = SimpleNamespace(get_component=lambda cid: aggregator)
        sag.get_client_disconnect_time = lambda name: 12.0 if name in disconnected else None
        sag.log_warning = lambda ctx, msg: None
        task = SimpleNamespace(targets=["h1", "h2", "h3", "h4"], completion_status=None, client_tasks=[])
        sag.cancel_task = lambda t, completion_status, fl_ctx=None: setattr(t, "completion_status", completion_status)
        cts = {
            n: SimpleNamespace(client=SimpleNamespace(name=n), task=task, result_received_time=None) for n in fetched
        }
        task.client_tasks = list(cts.values())
        for n in answered:
            sag._process_train_result(cts[n], SimpleNamespace(get_job_id=lambda: job_id))
            cts[n].result_received_time = 1.0
        return task.completion_status

    three = ["h1", "h2", "h3"]
    assert round_of(three, three, last_missing=["h4"]) == TaskCompletionStatus.OK
    assert round_of(three, three, disconnected=["h4"]) == TaskCompletionStatus.OK
    assert round_of(three[:2], three, last_missing=["h4"]) is None  # fewer than min_clients - max_missing answers
    assert round_of(three, three + ["h4"], last_missing=["h4"]) is None  # h4 fetched the task: alive or died now
    assert round_of(three, three) is None  # h4 not fetched yet, but nothing says it is gone: the usual wait
    assert round_of(three, three, last_missing=["h4"], job_id=SIMULATOR_JOB_ID) is None


def test_the_cosines_measured_in_one_read_equal_change_cosine(monkeypatch):
    """The server measures every update's direction in the read that checks its values: change_measures' dots and
    squares (blocks of 3 values here, a block of the reference shared by the updates) give change_cosine's value,
    computed by hand in float64; the reversed update its negative; peer_cosines for some sites only gives the full
    answer's values for those and None for the others."""
    import fedpartial.aggregation as agg

    monkeypatch.setattr(agg, "_CHUNK", 3)
    rng = np.random.default_rng(0)
    ref = {"a": rng.normal(size=7).astype(np.float32), "b": rng.normal(size=(2, 2)).astype(np.float32)}
    ref["n"] = np.array(4, np.int64)  # an integer buffer: no change measured, no direction
    step = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in ref.items() if k != "n"}
    state = {k: v + rng.normal(size=v.shape).astype(np.float32) for k, v in ref.items() if k != "n"}
    state["n"] = np.array(9, np.int64)
    reversed_ = {k: 2 * ref[k] - state[k] for k in ref}
    squares, dots, _, _ = agg.change_measures([state, reversed_], ref, step)
    assert sorted(squares) == sorted(dots) == ["a", "b"]
    d = np.concatenate([(state[k] - ref[k]).ravel() for k in step]).astype(np.float64)
    s = np.concatenate([step[k].ravel() for k in step]).astype(np.float64)
    by_hand = d @ s / np.sqrt((d @ d) * (s @ s))
    np.testing.assert_allclose(agg.cosines_from(dots, squares, agg.norms_of(step)), [by_hand, -by_hand], rtol=1e-5)
    assert agg.change_cosine(state, ref, step) == pytest.approx(by_hand, rel=1e-5)
    assert agg.change_cosine({k: v.copy() for k, v in ref.items()}, ref, step) is None  # no change: no direction
    states = [state, reversed_, {k: v + 0.5 for k, v in state.items() if k != "n"} | {"n": state["n"]}]
    full = agg.peer_cosines(states, ref, list(step))
    some = agg.peer_cosines(states, ref, list(step), which=[1])
    assert some[0] is None and some[2] is None and some[1] == pytest.approx(full[1])
