"""FedNoRo: every equation against values computed by hand on tiny tensors, the detection on hand-built loss
vectors, DaAgg by hand, and the site / server roles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_fedirm import _site as _site_mc
from test_fedmlp import _site

from fedpartial.methods import Contribution, OptionError, get_method
from fedpartial.methods import fednoro as N


def _sig(x):
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------------------------------------ detection


def test_normalisation_fills_missing_with_column_min_then_min_max_by_hand():
    losses = np.array([[1.0, 0.2], [3.0, np.nan], [2.0, 0.6]])  # site 1 has no sample of class 1
    out = N.normalise_class_losses(losses)
    # class 0: (l - 1) / (3 - 1); class 1: NaN -> column min 0.2, then (l - 0.2) / 0.4
    assert np.allclose(out, [[0.0, 0.0], [1.0, 0.0], [0.5, 1.0]])
    # a constant column carries no information: 0, not 0/0
    assert np.allclose(N.normalise_class_losses(np.array([[1.0], [1.0]])), 0.0)


def test_gmm_marks_the_two_sites_with_clearly_higher_losses_noisy():
    losses = np.array(
        [
            [0.20, 0.30, 0.25],
            [0.90, 1.10, 0.95],  # noisy
            [0.22, 0.28, 0.27],
            [0.85, 1.05, 1.00],
        ]
    )  # noisy
    noisy, normalised = N.detect_noisy(losses)
    assert noisy.tolist() == [False, True, False, True]
    assert normalised.shape == (4, 3) and normalised.min() == 0.0 and normalised.max() == 1.0
    votes, _ = N.detect_noisy(losses, seeds=range(9))  # the released code's majority of 9 fits agrees
    assert votes.tolist() == [False, True, False, True]


def test_gmm_does_not_mark_the_sites_that_are_only_high_on_one_large_scale_class():
    # sites 0 and 1 lose about 1 nat more on class 0 (a class with large losses everywhere); sites 2 and 3 have
    # higher losses on classes 1 and 2. Per-class normalisation makes every class count the same: 2 and 3 are noisy.
    losses = np.array([[2.0, 0.10, 0.20], [2.1, 0.11, 0.21], [1.0, 0.50, 0.60], [1.1, 0.52, 0.62]])
    noisy, _ = N.detect_noisy(losses)
    assert noisy.tolist() == [False, False, True, True]
    # the example discriminates: on the raw losses the mixture would have picked sites 0 and 1
    from sklearn.mixture import GaussianMixture

    gmm = GaussianMixture(n_components=2, random_state=0).fit(losses)
    raw = gmm.predict(losses) == int(np.argmax(gmm.means_.sum(1)))
    assert raw.tolist() == [True, True, False, False]


def test_detection_needs_two_distinct_sites():
    assert N.detect_noisy(np.array([[0.3, 0.4]]))[0].tolist() == [False]
    assert N.detect_noisy(np.array([[0.3, 0.4], [0.3, 0.4]]))[0].tolist() == [False, False]


def test_class_mean_losses_by_hand():
    probs = torch.tensor([[0.8, 0.1], [0.4, 0.3], [0.5, 0.5]])
    # multi-label: class 1 is not annotated (its entries are stored as 0)
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[True, False], [True, False], [True, False]])
    out = N.class_mean_losses(probs, labels, mask, "multilabel", "negatives")
    c0 = (-math.log(0.8) - math.log(0.6) - math.log(0.5)) / 3
    c1 = (-math.log(0.9) - math.log(0.7) - math.log(0.5)) / 3  # unannotated entries count as negatives
    assert torch.allclose(out, torch.tensor([c0, c1], dtype=torch.float64))
    partial = N.class_mean_losses(probs, labels, mask, "multilabel", "partial")
    assert partial[0].item() == pytest.approx(c0) and math.isnan(partial[1].item())  # no annotated entry of c1
    assert N.class_sample_counts(labels, mask, "multilabel", "negatives").tolist() == [3, 3]
    assert N.class_sample_counts(labels, mask, "multilabel", "partial").tolist() == [3, 0]
    # single-label: CE of the labelled rows of each class; the second row is unlabelled here, class 1 has no row
    mc_probs = torch.tensor([[0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.2, 0.2, 0.6]])
    mc_labels = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    mc_mask = torch.tensor([[True, False, True], [True, False, True], [True, False, True]])
    mc = N.class_mean_losses(mc_probs, mc_labels * mc_mask, mc_mask, "multiclass")
    assert mc[0].item() == pytest.approx(-math.log(0.7)) and math.isnan(mc[1].item())
    assert mc[2].item() == pytest.approx(-math.log(0.6))
    assert N.class_sample_counts(mc_labels * mc_mask, mc_mask, "multiclass").tolist() == [1, 0, 1]


# ------------------------------------------------------------------------------------------------ LA loss


def test_la_loss_single_label_by_hand_and_absent_class_leaves_the_softmax():
    labels = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0]])
    mask = torch.ones(4, 3, dtype=torch.bool)
    adj = N.la_adjustment(labels, mask, "multiclass", tau=1.0)
    # prior (3/4, 1/4, 0): Delta = (log .75, log .25, -inf)
    assert adj[0].item() == pytest.approx(math.log(0.75)) and adj[1].item() == pytest.approx(math.log(0.25))
    assert adj[2].item() == -math.inf
    logits = torch.tensor([[2.0, 1.0, 0.5]], requires_grad=True)
    loss = N.la_loss(logits, torch.tensor([[0.0, 1.0, 0.0]]), torch.ones(1, 3, dtype=torch.bool), adj, "multiclass")
    a, b = 2 + math.log(0.75), 1 + math.log(0.25)
    assert loss.item() == pytest.approx(-(b - math.log(math.exp(a) + math.exp(b))), abs=1e-6)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2] == 0  # the absent class gets no push
    # tau 0: plain cross-entropy over every class
    plain = N.la_loss(
        logits,
        torch.tensor([[0.0, 1.0, 0.0]]),
        torch.ones(1, 3, dtype=torch.bool),
        N.la_adjustment(labels, mask, "multiclass", tau=0.0),
        "multiclass",
    )
    assert plain.item() == pytest.approx(torch.nn.functional.cross_entropy(logits, torch.tensor([1])).item())


def test_la_loss_multi_label_by_hand():
    # class 0 annotated with 1 positive of 4 -> pi = 1/4, Delta = log(1/3); class 1 not annotated -> Delta = 0
    labels = torch.tensor([[1.0, 0], [0, 0], [0, 0], [0, 0]])
    mask = torch.tensor([[True, False]] * 4)
    adj = N.la_adjustment(labels, mask, "multilabel")
    assert torch.allclose(adj, torch.tensor([math.log(1 / 3), 0.0]))
    logits = torch.tensor([[0.5, 1.0]])
    y, m = torch.tensor([[1.0, 0.0]]), torch.tensor([[True, False]])
    e0 = -math.log(_sig(0.5 + math.log(1 / 3)))  # positive, adjusted
    e1 = -math.log(1 - _sig(1.0))  # unannotated entry as a negative, not adjusted
    assert N.la_loss(logits, y, m, adj, "multilabel", "negatives").item() == pytest.approx((e0 + e1) / 2, abs=1e-6)
    assert N.la_loss(logits, y, m, adj, "multilabel", "partial").item() == pytest.approx(e0, abs=1e-6)


# ------------------------------------------------------------------------------------------------ KD term


def test_kd_single_label_by_hand_with_the_absent_class_constant():
    z = torch.tensor([[1.0, 0.0, 2.0]], requires_grad=True)
    zt = torch.tensor([[0.8, 0.0, 0.4]])
    adj = torch.tensor([math.log(0.5), math.log(0.5), -math.inf])  # class 2 absent from the site
    kd = N.kd_loss(z, zt, adj, "multiclass", temperature=0.8)
    q = torch.softmax(zt / 0.8, 1)[0].tolist()
    a, b = 1 + math.log(0.5), 0 + math.log(0.5)
    lse = math.log(math.exp(a) + math.exp(b))
    lp = [a - lse, b - lse, 0.0]  # log p~ of the absent class replaced by 0 (released code)
    expected = sum(qi * (math.log(qi) - li) for qi, li in zip(q, lp))
    assert kd.item() == pytest.approx(expected, abs=1e-6)
    kd.backward()
    assert torch.isfinite(z.grad).all() and z.grad[0, 2] == 0
    # the batch mean of the per-sample KL
    two = N.kd_loss(torch.cat([z.detach(), z.detach()]), torch.cat([zt, zt]), adj, "multiclass", 0.8)
    assert two.item() == pytest.approx(expected, abs=1e-6)


def test_kd_multi_label_bernoulli_kl_by_hand_and_entries():
    z = torch.tensor([[0.5, -1.0]])
    zt = torch.tensor([[0.8, 1.6]])
    adj = torch.tensor([math.log(1 / 3), 0.0])
    q = [_sig(0.8 / 0.8), _sig(1.6 / 0.8)]
    p = [_sig(0.5 + math.log(1 / 3)), _sig(-1.0)]
    kl = [qi * math.log(qi / pi) + (1 - qi) * math.log((1 - qi) / (1 - pi)) for qi, pi in zip(q, p)]
    assert N.kd_loss(z, zt, adj, "multilabel", 0.8).item() == pytest.approx(sum(kl) / 2, abs=1e-6)
    only = torch.tensor([[False, True]])
    assert N.kd_loss(z, zt, adj, "multilabel", 0.8, only).item() == pytest.approx(kl[1], abs=1e-6)
    # BCE with the soft target minus the teacher's entropy
    h = -(q[1] * math.log(q[1]) + (1 - q[1]) * math.log(1 - q[1]))
    bce = -(q[1] * math.log(p[1]) + (1 - q[1]) * math.log(1 - p[1]))
    assert kl[1] == pytest.approx(bce - h)
    # FedMLP's released adaptation: squared difference of sigmoids on the given entries, no adjustment
    code = N.kd_loss_code(z, zt, only, 0.8)
    assert code.item() == pytest.approx((_sig(-1.0) - q[1]) ** 2, abs=1e-7)


def test_kd_rampup_by_hand():
    assert N.kd_rampup(0, 10, 49, 0.8) == pytest.approx(0.8 * math.exp(-5))
    assert N.kd_rampup(10, 10, 49, 0.8) == pytest.approx(0.8 * math.exp(-5))
    assert N.kd_rampup(30, 10, 50, 0.8) == pytest.approx(0.8 * math.exp(-5 * 0.25))
    assert N.kd_rampup(60, 10, 49, 0.8) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        N.kd_rampup(1, 5, 5, 0.8)


# ------------------------------------------------------------------------------------------------ DaAgg


def _state(w, b):
    return {
        "w": np.array([w, 0.0], dtype=np.float32),
        "b": np.array([b], dtype=np.float32),
        "steps": np.array(7, dtype=np.int64),
    }  # integer buffers are not part of the distance


def test_model_distance_and_daagg_weights_by_hand():
    states = [_state(0.0, 0.0), _state(3.0, 4.0), _state(0.0, 1.0)]
    assert N.model_distance(states[0], states[1]) == pytest.approx(5.0)  # sqrt(3^2 + 4^2)
    assert N.model_distance(states[0], states[1], "tensor_sum") == pytest.approx(7.0)  # |3| + |4|
    d = N.noisy_distances(states, [False, True, True])  # site 0 clean
    assert d.tolist() == pytest.approx([0.0, 5.0, 1.0])
    w = N.daagg_weights([1.0, 1.0, 2.0], d)
    raw = [1.0, math.exp(-1.0), 2 * math.exp(-0.2)]  # n_k exp(-d_k / max d)
    assert w.tolist() == pytest.approx([r / sum(raw) for r in raw])
    # two clean sites: the distance to the nearest one
    assert N.noisy_distances(states, [False, True, False]).tolist() == pytest.approx([0.0, math.sqrt(18), 0.0])
    assert N.daagg_weights([1.0, 3.0], [0.0, 0.0]).tolist() == pytest.approx([0.25, 0.75])  # no distance: FedAvg


def _contrib(site, state, losses=None, n=10.0):
    meta = {"annotated": [True, True]}
    if losses is not None:
        meta[N.META_CLASS_LOSS] = losses
    return Contribution(site=site, weights=state, n=n, meta=meta)


def test_rule_detects_once_sends_the_verdict_and_aggregates_with_daagg(tmp_path):
    rule = get_method("fednoro").make_rule({})
    groups = {"classifier": [], "norm": []}
    losses = {"a": [0.2, 0.3], "b": [0.9, 1.0], "c": [0.25, 0.28], "d": [0.95, 1.1]}
    states = {"a": _state(0.0, 0.0), "b": _state(3.0, 4.0), "c": _state(0.0, 0.0), "d": _state(0.0, 1.0)}
    w, meta = rule.aggregate(None, [_contrib(s, states[s], losses[s]) for s in "abcd"], groups, 9)
    assert meta[N.META_NOISY_SITES] == ["b", "d"] and meta[N.META_CLEAN_SITES] == ["a", "c"]
    assert meta[N.META_DETECT_NOISY] == [0, 1, 0, 1] and meta[N.META_DETECTED_ROUND] == 9
    assert meta[N.META_AGG_WEIGHTS] == pytest.approx([0.25] * 4)  # the detection round is still FedAvg
    assert w["w"][0] == pytest.approx(0.75)
    # a restarted rule keeps the verdict
    fresh = get_method("fednoro").make_rule({})
    fresh.load_state_dict(rule.state_dict())
    w2, meta2 = fresh.aggregate(None, [_contrib(s, states[s]) for s in "abcd"], groups, 10)
    assert meta2[N.META_NOISY_SITES] == ["b", "d"] and N.META_DETECT_SITES not in meta2
    raw = np.array([1.0, math.exp(-1.0), 1.0, math.exp(-0.2)])  # d = (0, 5, 0, 1) / 5
    expected = raw / raw.sum()
    assert meta2[N.META_AGG_WEIGHTS] == pytest.approx(expected.tolist())
    assert meta2[N.META_DISTANCE] == pytest.approx([0.0, 1.0, 0.0, 0.2])
    assert w2["w"][0] == pytest.approx(3.0 * expected[1])
    assert w2["b"][0] == pytest.approx(4.0 * expected[1] + 1.0 * expected[3])
    # all_noisy: plain FedAvg, no detection even with loss vectors
    flat = get_method("fednoro").make_rule({"all_noisy": True})
    w3, meta3 = flat.aggregate(None, [_contrib(s, states[s], losses[s]) for s in "abcd"], groups, 3)
    assert N.META_NOISY_SITES not in meta3 and meta3[N.META_ALL_NOISY] == 1
    assert w3["w"][0] == pytest.approx(0.75) and flat.state_dict() == {}


# ------------------------------------------------------------------------------------------------ the site


def test_site_sends_the_received_models_class_losses_in_the_last_warmup_round():
    ctx = _site("s0", [True, False, True], n=16)
    tr = get_method("fednoro").make_trainer(ctx, {"warmup_rounds": 3})
    by_hand = tr.class_losses()  # the model as received
    out = tr.train_round(2, 10, {})
    assert out.meta[N.META_CLASS_LOSS] == pytest.approx(by_hand.tolist())
    assert out.meta[N.META_CLASS_COUNT] == [16, 16, 16]  # missing as negatives: every sample counts for every class
    assert out.meta[N.META_STAGE] == 1 and out.meta[N.META_NOISY] == 0 and out.meta[N.META_KD_WEIGHT] == 0.0
    assert N.META_CLASS_LOSS not in tr.train_round(1, 10, {}).meta  # earlier warm-up rounds: nothing to send


def test_site_roles_clean_noisy_and_all_noisy():
    m = get_method("fednoro")
    verdict = {N.META_NOISY_SITES: ["s1"], N.META_CLEAN_SITES: ["s0"]}
    for site, noisy in (("s0", False), ("s1", True)):
        ctx = _site_mc(site, True, n=16)
        tr = m.make_trainer(ctx, {"warmup_rounds": 2, "ramp_begin": 2, "ramp_end": 6})
        kd_calls = []
        orig = tr.extra_loss
        tr.extra_loss = lambda b, lg, f: kd_calls.append(orig(b, lg, f)) or kd_calls[-1]
        out = tr.train_round(4, 10, verdict)
        assert out.meta[N.META_STAGE] == 2 and out.meta[N.META_NOISY] == int(noisy)
        assert N.META_CLASS_LOSS not in out.meta  # the verdict arrived
        if noisy:
            assert out.meta[N.META_KD_WEIGHT] == pytest.approx(0.8 * math.exp(-5 * 0.25))
            assert all(k is not None and torch.isfinite(k) for k in kd_calls) and out.meta[N.META_LOSS_KD] > 0
        else:
            assert out.meta[N.META_KD_WEIGHT] == 0.0 and all(k is None for k in kd_calls)
    # all_noisy: distils from round 0, never sends losses
    tr = m.make_trainer(_site("s2", [True, False, False], n=16), {"all_noisy": True, "ramp_begin": 0, "ramp_end": 4})
    out = tr.train_round(0, 5, {})
    assert out.meta[N.META_NOISY] == 1 and out.meta[N.META_KD_WEIGHT] == pytest.approx(0.8 * math.exp(-5))
    assert N.META_CLASS_LOSS not in out.meta
    # stage 2 without a verdict: distil (conservative) and keep asking for a detection
    tr = m.make_trainer(_site("s3", [True, True, False], n=16), {"warmup_rounds": 1})
    out = tr.train_round(1, 5, {})
    assert out.meta[N.META_NOISY] == 1 and N.META_CLASS_LOSS in out.meta


def test_options_are_checked():
    m = get_method("fednoro")
    with pytest.raises(OptionError, match="warmup_rounds"):
        m.make_trainer(_site("x", [True, False], n=4, C=2), {"warmup_rounds": 0})
    with pytest.raises(OptionError, match="ramp_end"):
        m.make_trainer(_site("x", [True, False], n=4, C=2), {"ramp_begin": 5, "ramp_end": 5})
    with pytest.raises(OptionError, match="gmm_vote"):
        m.split_options({"gmm_vote": 9})
    t, r = m.split_options({"all_noisy": True, "gmm_votes": 9})
    assert t == {"all_noisy": True} and r == {"all_noisy": True, "gmm_votes": 9}


def test_per_class_losses_from_fewer_than_min_count_images_do_not_leave_the_site():
    from fedpartial.fl.data_check import suppress_small_counts

    meta = {"fednoro_class_loss": [0.5, 0.7, 0.9], "fednoro_class_count": [10, 3, 0]}
    out, dropped = suppress_small_counts(meta, 5)
    assert out["fednoro_class_loss"][0] == 0.5 and np.isnan(out["fednoro_class_loss"][1])
    assert list(out["fednoro_class_count"]) == [10, 0, 0] and dropped == ["fednoro_class_loss[1]"]
    assert meta["fednoro_class_loss"][1] == 0.7  # the input is not modified
