"""FedPU: the PU risk by hand on a tiny batch (paper form, the non-negative correction, the
released code's MPULoss_V2), the class priors (site counts, data summary, none), the trainer's loss and
counters, the single-label-only guard, and the job."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fedlsm import _mc_site
from test_fedmlp import _site

from fedpartial.methods import fedpu as P
from fedpartial.methods import get_method

REPO = Path(__file__).resolve().parents[1]

# rows A (class 0), B (class 1) labelled; C, D unlabelled (their class, 2, is not annotated at this site)
PROBS = [[0.5, 0.25, 0.25], [0.2, 0.6, 0.2], [0.1, 0.3, 0.6], [0.5, 0.1, 0.4]]
LABELS = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 0], [0, 0, 0]])
MASK = torch.tensor([[True, True, False]] * 4)
POSITIVE = torch.tensor([True, True, False])
PRIOR = torch.tensor([0.3, 0.2, 0.5])


def _logits():
    return torch.log(torch.tensor(PROBS)).requires_grad_(True)  # softmax(log p) = p


def nl(p):  # "not class i" loss -log(1 - p_i)
    return -math.log(1 - p)


def test_row_classes_and_not_class_loss_by_hand():
    y = P.row_classes(LABELS, MASK)
    assert y.tolist() == [0, 1, -1, -1]
    lbar = P.not_class_loss(torch.log(torch.tensor(PROBS)))
    expected = torch.tensor([[nl(p) for p in row] for row in PROBS])
    assert torch.allclose(lbar, expected, atol=1e-6)


def test_pu_risk_by_hand():
    logits = _logits()
    y = P.row_classes(LABELS, MASK)
    risk, terms = P.pu_risk(logits, y, POSITIVE, PRIOR)
    # class 0: mean over U (C, D) of -log(1 - p0) minus pi_0 times the mean over L_0 (A)
    t0 = (nl(0.1) + nl(0.5)) / 2 - 0.3 * nl(0.5)
    t1 = (nl(0.3) + nl(0.1)) / 2 - 0.2 * nl(0.6)
    assert terms.tolist() == pytest.approx([t0, t1, 0.0], abs=1e-6)  # class 2 is not positive here
    assert float(risk.detach()) == pytest.approx(t0 + t1, abs=1e-6)
    # the prior matters: with pi = 0 the risk is the unlabelled rows' "not i" loss alone
    r0, _ = P.pu_risk(logits, y, POSITIVE, torch.zeros(3))
    assert float(r0.detach()) == pytest.approx((nl(0.1) + nl(0.5) + nl(0.3) + nl(0.1)) / 2, abs=1e-6)
    # gradient: raising p_0 of the unlabelled row C raises the risk; of the labelled positive A lowers it
    risk.backward()
    assert logits.grad[2, 0] > 0 and logits.grad[0, 0] < 0
    # unlabelled: all -> U is every row of the batch, the labelled ones included
    r_all, t_all = P.pu_risk(_logits(), y, POSITIVE, PRIOR, all_rows=True)
    a0 = (nl(0.5) + nl(0.2) + nl(0.1) + nl(0.5)) / 4 - 0.3 * nl(0.5)
    a1 = (nl(0.25) + nl(0.6) + nl(0.3) + nl(0.1)) / 4 - 0.2 * nl(0.6)
    assert t_all.tolist() == pytest.approx([a0, a1, 0.0], abs=1e-6)
    assert float(r_all.detach()) == pytest.approx(a0 + a1, abs=1e-6)


def test_non_negative_correction_clamps_a_negative_class_term():
    y = P.row_classes(LABELS, MASK)
    prior = torch.tensor([1.0, 0.2, 0.0])  # pi_0 = 1 overstates the class-0 images hidden in U
    t0 = (nl(0.1) + nl(0.5)) / 2 - 1.0 * nl(0.5)
    t1 = (nl(0.3) + nl(0.1)) / 2 - 0.2 * nl(0.6)
    assert t0 < 0 < t1
    plain, terms = P.pu_risk(_logits(), y, POSITIVE, prior)
    assert float(plain.detach()) == pytest.approx(t0 + t1, abs=1e-6)
    logits = _logits()
    nn_risk, nn_terms = P.pu_risk(logits, y, POSITIVE, prior, non_negative=True)
    assert float(nn_risk.detach()) == pytest.approx(t1, abs=1e-6)  # max(0, t0) + max(0, t1)
    assert float(nn_terms[0].detach()) == pytest.approx(t0, abs=1e-6)  # the raw term is returned (counted as clamped)
    nn_risk.backward()
    # the clamped class-0 term sends no gradient: p_0 of the labelled row A (only in term 0) is untouched
    # except through the softmax coupling with term 1, which is the same as term 1's own gradient
    only_t1 = _logits()
    u = P.not_class_loss(only_t1)
    ((u[2, 1] + u[3, 1]) / 2 - 0.2 * u[1, 1]).backward()
    assert torch.allclose(logits.grad, only_t1.grad, atol=1e-6)


def test_released_code_form_by_hand():
    y = P.row_classes(LABELS, MASK)
    eps = 1e-6

    def code_nl(p):
        return -math.log(1 - p + eps)

    pu3 = sum(code_nl(PROBS[r][i]) for r in (2, 3) for i in (0, 1)) / 2 / 2
    pu1 = sum(code_nl(PROBS[r][i]) for r in (0, 1) for i in (0, 1)) * 0.3 / 2 / (3 - 2)  # pi of the first positive
    pu2 = (
        -sum(float(PRIOR[c]) * code_nl(PROBS[r][c] if c == yc else 0.0) for r, yc in ((0, 0), (1, 1)) for c in range(3))
        / 2
    )
    got = P.pu_risk_code(_logits(), y, POSITIVE, PRIOR).detach()
    assert float(got) == pytest.approx(pu1 + pu2 + pu3, abs=1e-6)
    # it differs from the paper form (pu1, and pu3 divided by |P|)
    assert float(got) != pytest.approx(float(P.pu_risk(_logits(), y, POSITIVE, PRIOR)[0].detach()), abs=1e-3)
    # every class positive: no pu1 term
    allpos = torch.ones(3, dtype=torch.bool)
    pu3_all = sum(code_nl(PROBS[r][i]) for r in (2, 3) for i in range(3)) / 2 / 3
    assert float(P.pu_risk_code(_logits(), y, allpos, PRIOR).detach()) == pytest.approx(pu3_all + pu2, abs=1e-6)


def test_class_priors_unlabelled_site_summary():
    labels = torch.tensor([[1.0, 0, 0], [1.0, 0, 0], [0, 1.0, 0], [0, 0, 0], [0, 0, 0]])
    mask = torch.tensor([[True, True, False]] * 5)
    assert P.class_priors("site", labels, mask, None, 3).tolist() == pytest.approx([0.4, 0.2, 0.0])
    # the share of each class in U: none of the annotated classes among the unlabelled rows; every row: site shares
    assert P.class_priors("unlabelled", labels, mask, None, 3).tolist() == [0.0, 0.0, 0.0]
    assert P.class_priors("unlabelled", labels, mask, None, 3, all_rows=True).tolist() == pytest.approx([0.4, 0.2, 0.0])
    summary = {
        "sites": {
            "a": {"positives": [2, 1, 0], "negatives": [3, 4, 0]},
            "b": {"positives": [1, 0, 5], "negatives": [0, 0, 5]},
        }
    }
    # positives / (positives + negatives) over the sites annotating each class: 3/6, 1/5, 5/10
    assert P.class_priors("summary", labels, mask, summary, 3).tolist() == pytest.approx([0.5, 0.2, 0.5])


def test_trainer_loss_is_ce_plus_weighted_pu_risk():
    tr = get_method("fedpu").make_trainer(_mc_site("s", [True, True, False]), {"pu_weight": 2.0})
    tr.prior = PRIOR.clone()
    loss = tr.label_loss(_logits(), {"label": LABELS, "mask": MASK})
    ce = -(math.log(0.5) + math.log(0.6)) / 2  # softmax over all classes on the labelled rows A, B
    risk = (nl(0.1) + nl(0.5)) / 2 - 0.3 * nl(0.5) + (nl(0.3) + nl(0.1)) / 2 - 0.2 * nl(0.6)
    assert float(loss.detach()) == pytest.approx(ce + 2.0 * risk, abs=1e-6)
    code = get_method("fedpu").make_trainer(_mc_site("s", [True, True, False]), {"form": "code"})
    code.prior = PRIOR.clone()
    y = P.row_classes(LABELS, MASK)
    assert float(code.label_loss(_logits(), {"label": LABELS, "mask": MASK}).detach()) == pytest.approx(
        ce + float(P.pu_risk_code(_logits(), y, POSITIVE, PRIOR).detach()), abs=1e-6
    )


def test_round_counters_priors_and_training(tmp_path):
    ctx = _mc_site("s", [True, True, False], tmp=tmp_path)  # 30 rows, 3 steps of 10 = one pass
    labels, mask = ctx.data.labels, ctx.data.mask
    unlabelled = int(((labels * mask).sum(1) == 0).sum())
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    tr = get_method("fedpu").make_trainer(ctx, {"non_negative": True, "prior": "site"})
    out = tr.train_round(0, 2, {})
    assert out.steps == 3
    assert out.meta[P.META_UNLABELLED] == unlabelled > 0
    counts = (labels * mask).sum(0)
    assert out.meta[P.META_PRIOR].tolist() == pytest.approx((counts / 30).tolist())  # the site's labelled shares
    default = get_method("fedpu").make_trainer(ctx, {})
    default.start_round(1, {})
    assert default.prior.tolist() == [0.0, 0.0, 0.0]  # FedPU's prior: the share of each class in U
    assert np.isfinite(out.meta[P.META_CE]) and np.isfinite(out.meta[P.META_PU])
    assert 0 <= out.meta[P.META_CLAMPED] <= 2 * 3  # at most |P| terms per step
    assert any(not torch.equal(before[k], v) for k, v in ctx.model.state_dict().items())


def test_summary_priors_and_fallback_with_a_warning(caplog):
    ctx = _mc_site("s", [True, True, False])
    tr = get_method("fedpu").make_trainer(ctx, {"prior": "summary"})
    with caplog.at_level(logging.WARNING, logger="fedpartial"):
        site_prior = tr.priors()  # no summary received: the site's own shares, with a warning
    assert "no data summary" in caplog.text
    assert site_prior.tolist() == pytest.approx(((ctx.data.labels * ctx.data.mask).sum(0) / 30).tolist())
    ctx.summary = {"sites": {"a": {"positives": [1, 3, 0], "negatives": [3, 1, 0]}}}
    assert tr.priors().tolist() == pytest.approx([0.25, 0.75, 0.0])
    # a site leaving one of its classes blank on some rows: the zero prior in U may be wrong, say so
    ctx.data.mask[:3, 1] = False
    with caplog.at_level(logging.WARNING, logger="fedpartial"):
        get_method("fedpu").make_trainer(ctx, {}).priors()
    assert "leaves ['c1'] blank" in caplog.text


def test_single_label_only_and_options_checked():
    with pytest.raises(ValueError, match="does not support task 'multilabel'"):
        get_method("fedpu").make_trainer(_site("s", [True, False, True]), {})
    with pytest.raises(ValueError, match="pu_weight"):
        get_method("fedpu").make_trainer(_mc_site("s", [True, True, False]), {"pu_weight": -1.0})
    with pytest.raises(ValueError, match="prior"):
        get_method("fedpu").make_trainer(_mc_site("s", [True, True, False]), {"prior": "none"})


def test_job_runs_fedpu_on_ham10000():
    job = REPO / "jobs" / "fedpu_ham10000"
    client = json.loads((job / "app/config/config_fed_client.json").read_text())
    server = json.loads((job / "app/config/config_fed_server.json").read_text())
    assert client["method"] == server["method"] == "fedpu"
    args = client["executors"][0]["executor"]["args"]
    assert args["dataset"]["preset"] == "ham10000"
    get_method("fedpu").split_options(args["method_args"])  # every key is a FedPU option
