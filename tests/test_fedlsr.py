"""FedLSR: every term against values computed by hand on tiny tensors, and one local round on two views."""

from __future__ import annotations

import math

import pytest
import torch
from test_fedirm import _site as _site_mc
from test_fedmlp import _site

from fedpartial.methods import OptionError, get_method
from fedpartial.methods import fedlsr as L


def _sig(x):
    return 1 / (1 + math.exp(-x))


def _softmax(v):
    e = [math.exp(x) for x in v]
    return [x / sum(e) for x in e]


# ------------------------------------------------------------------------------------------------ L_ce


def test_single_label_sharpened_mixed_prediction_and_ce_by_hand():
    z1, z2 = torch.tensor([[1.0, 0.0, -1.0]]), torch.tensor([[0.0, 2.0, 0.0]])
    lam, T = 0.3, 0.5
    p = [lam * a + (1 - lam) * b for a, b in zip(_softmax([1.0, 0.0, -1.0]), _softmax([0.0, 2.0, 0.0]))]
    ps = [x**2 / sum(y**2 for y in p) for x in p]  # p^(1/T) normalised
    s = L.sharpened_log_probs(z1, z2, lam, T, "multiclass")
    assert s.exp()[0].tolist() == pytest.approx(ps, abs=1e-6)
    labels, mask = torch.tensor([[1.0, 0.0, 0.0]]), torch.ones(1, 3, dtype=torch.bool)
    assert L.ce_term(s, labels, mask, "multiclass").item() == pytest.approx(-math.log(ps[0]), abs=1e-6)
    # the released code feeds the probabilities to nn.CrossEntropyLoss (a second softmax)
    code = L.ce_term(s, labels, mask, "multiclass", parity="code").item()
    assert code == pytest.approx(-math.log(_softmax(ps)[0]), abs=1e-6)
    # an unlabelled row (its class is not annotated here) does not enter L_ce
    rows = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    s2 = torch.cat([s, s])
    assert L.ce_term(s2, rows, torch.ones(2, 3, dtype=torch.bool), "multiclass").item() == pytest.approx(
        -math.log(ps[0]), abs=1e-6
    )


def test_multi_label_binary_sharpening_and_ce_by_hand():
    z1, z2 = torch.tensor([[1.0, -0.5]]), torch.tensor([[-1.0, 0.5]])
    lam, T = 0.25, 0.5
    p = [lam * _sig(a) + (1 - lam) * _sig(b) for a, b in ((1.0, -1.0), (-0.5, 0.5))]
    ps = [x**2 / (x**2 + (1 - x) ** 2) for x in p]
    s = L.sharpened_log_probs(z1, z2, lam, T, "multilabel")
    assert torch.sigmoid(s)[0].tolist() == pytest.approx(ps, abs=1e-6)
    labels, mask = torch.tensor([[1.0, 0.0]]), torch.tensor([[True, False]])  # class 1 not annotated: stored 0
    e0, e1 = -math.log(ps[0]), -math.log(1 - ps[1])
    assert L.ce_term(s, labels, mask, "multilabel", "negatives").item() == pytest.approx((e0 + e1) / 2, abs=1e-6)
    assert L.ce_term(s, labels, mask, "multilabel", "partial").item() == pytest.approx(e0, abs=1e-6)
    pw = torch.tensor([4.0, 1.0])  # FedMLP's N / n_c on the positive term
    assert L.ce_term(s, labels, mask, "multilabel", "negatives", pw).item() == pytest.approx(
        (4 * e0 + e1) / 2, abs=1e-6
    )
    # FedMLP's code: BCE-with-logits applied to the probability p_s
    c0, c1 = -math.log(_sig(ps[0])), -math.log(1 - _sig(ps[1]))
    assert L.ce_term(s, labels, mask, "multilabel", parity="code").item() == pytest.approx((c0 + c1) / 2, abs=1e-6)


def test_inverse_frequency_weights_by_hand():
    labels = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 0, 0], [0, 1.0, 0]])
    mask = torch.tensor([[True, True, False]] * 4)
    assert L.inverse_frequency(labels, mask).tolist() == pytest.approx([2.0, 4.0, 1.0])  # N / n_c, 1 without positives


# ------------------------------------------------------------------------------------------------ L_sd, L_e


def test_js_divergence_by_hand():
    q1, q2 = torch.tensor([[0.7, 0.3]]), torch.tensor([[0.4, 0.6]])
    m = [0.55, 0.45]
    js = 0.5 * sum(a * math.log(a / c) for a, c in zip([0.7, 0.3], m)) + 0.5 * sum(
        b * math.log(b / c) for b, c in zip([0.4, 0.6], m)
    )
    assert L.js_term(q1, q2, "multiclass").item() == pytest.approx(js, abs=1e-6)
    assert L.js_term(q1, q2, "multiclass", parity="code").item() == pytest.approx(js / 2, abs=1e-6)  # mean over C
    assert L.js_term(q1, q1, "multiclass").item() == pytest.approx(0.0, abs=1e-7)
    # multi-label: Bernoulli JS per entry, mean over entries
    b1, b2 = torch.tensor([[0.7, 0.2]]), torch.tensor([[0.4, 0.2]])
    bern = js  # entry 0 is the same pair of Bernoulli distributions; entry 1 is identical on both views
    assert L.js_term(b1, b2, "multilabel").item() == pytest.approx(bern / 2, abs=1e-6)
    pos_only = 0.5 * (0.7 * math.log(0.7 / 0.55) + 0.4 * math.log(0.4 / 0.55))  # FedMLP's element-wise terms
    assert L.js_term(b1, b2, "multilabel", parity="code").item() == pytest.approx(pos_only / 2, abs=1e-6)


def test_distill_probs_and_entropy_by_hand():
    z = torch.tensor([[1.0, 0.0]])
    q = L.distill_probs(z, 1 / 3, "multiclass")
    assert q[0].tolist() == pytest.approx(_softmax([3.0, 0.0]), abs=1e-6)
    q2 = torch.tensor([[0.5, 0.5]])
    h1 = -sum(x * math.log(x) for x in q[0].tolist())
    assert L.entropy_term(q, q2, "multiclass").item() == pytest.approx((h1 + math.log(2)) / 2, abs=1e-6)
    # the notebook: entropy of softmax(q1), view 1 twice
    sq = _softmax(q[0].tolist())
    assert L.entropy_term(q, q2, "multiclass", parity="code").item() == pytest.approx(
        -sum(x * math.log(x) for x in sq), abs=1e-6
    )
    qb = L.distill_probs(torch.tensor([[0.3]]), 1 / 3, "multilabel")
    assert qb.item() == pytest.approx(_sig(0.9), abs=1e-6)
    hb = -(_sig(0.9) * math.log(_sig(0.9)) + (1 - _sig(0.9)) * math.log(1 - _sig(0.9)))
    assert L.entropy_term(qb, torch.tensor([[0.5]]), "multilabel").item() == pytest.approx(
        (hb + math.log(2)) / 2, abs=1e-6
    )


def test_sd_weight_ramp_and_total_loss_by_hand():
    assert L.sd_weight(0, 0.4, 10) == 0.0
    assert L.sd_weight(5, 0.4, 10) == pytest.approx(0.2)
    assert L.sd_weight(10, 0.4, 10) == pytest.approx(0.4) and L.sd_weight(50, 0.4, 10) == pytest.approx(0.4)
    z1, z2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    labels, mask = torch.tensor([[1.0, 0.0]]), torch.ones(1, 2, dtype=torch.bool)
    loss, parts = L.fedlsr_loss(z1, z2, labels, mask, 0.5, 0.2, "multiclass", lambda_e=0.6)
    assert loss.item() == pytest.approx(parts["ce"] + 0.2 * parts["sd"] + 0.6 * parts["entropy"], abs=1e-6)
    # p = (0.5, 0.5) -> p_s = (0.5, 0.5): L_ce = ln 2; q1, q2 = softmax(3 z): JS of (a, b) and (b, a)
    a, b = _softmax([3.0, 0.0])
    js = a * math.log(a / 0.5) + b * math.log(b / 0.5)
    assert parts["ce"] == pytest.approx(math.log(2), abs=1e-6) and parts["sd"] == pytest.approx(js, abs=1e-6)
    assert parts["entropy"] == pytest.approx(-(a * math.log(a) + b * math.log(b)), abs=1e-6)
    _, no_e = L.fedlsr_loss(z1, z2, labels, mask, 0.5, 0.2, "multiclass", lambda_e=0.0)
    assert no_e["entropy"] == 0.0


# ------------------------------------------------------------------------------------------------ the site


def test_one_round_on_two_different_views_of_the_same_images():
    ctx = _site("s", [True, False, True], n=16)
    tr = get_method("fedlsr").make_trainer(ctx, {"views": ["weak", "weak"], "t_w": 4, "class_weighting": "inverse"})
    seen = []
    orig = L.fedlsr_loss

    def spy(z1, z2, labels, mask, *a, **k):
        seen.append((z1.detach().clone(), z2.detach().clone()))
        return orig(z1, z2, labels, mask, *a, **k)

    L_fn, L.fedlsr_loss = L.fedlsr_loss, spy
    try:
        out = tr.train_round(2, 20, {})
    finally:
        L.fedlsr_loss = L_fn
    assert out.steps == 2 and seen and not torch.allclose(seen[0][0], seen[0][1])  # two distinct draws per batch
    assert out.meta["fedlsr_sd_weight"] == pytest.approx(0.2) and out.meta["fedlsr_sd"] > 0
    assert 0 < out.meta["fedlsr_mix"] < 1 and math.isfinite(out.loss)
    # single-label, default t_w = 0.2 x rounds
    tr2 = get_method("fedlsr").make_trainer(_site_mc("m", True, n=16), {})
    assert tr2.t_w(50) == 10
    out2 = tr2.train_round(5, 50, {})
    assert out2.meta["fedlsr_sd_weight"] == pytest.approx(0.2) and out2.meta["fedlsr_entropy"] > 0


def test_options_are_checked():
    m = get_method("fedlsr")
    with pytest.raises(OptionError, match="views"):
        m.make_trainer(_site("x", [True, False], n=4, C=2), {"views": ["weak", "blur"]})
    with pytest.raises(OptionError, match="sharpen_t"):
        m.make_trainer(_site("x", [True, False], n=4, C=2), {"sharpen_t": 0.0})
    with pytest.raises(OptionError, match="gama"):
        m.split_options({"gama": 0.4})
