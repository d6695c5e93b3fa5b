"""CBAFed: the class-balanced adaptive thresholds, the class share, the fixed pseudo labels
(single- and multi-label) and the residual weight connection by hand; the trainer's counts from the received
model, the warm-up, an unlabelled site left out of the round, the local residual connection; the rule's trained-sample
weights, global residual connection and its state; the job."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fedlsm import _mc_site
from test_fedmlp import _site

from fedpartial.methods import Contribution, get_method
from fedpartial.methods import cbafed as C
from fedpartial.methods.common import whole_set_pass
from fedpartial.models import PartialLabelNet

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ maths


def test_class_thresholds_and_share_by_hand():
    share = torch.tensor([0.5, 0.3, 0.2])
    s = statistics.stdev([0.5, 0.3, 0.2])  # unbiased, 1/(C-1)
    tau = C.class_thresholds(share, 0.45, 0.55, 0.95)
    assert tau.tolist() == pytest.approx([0.5 + 0.45 - s, 0.3 + 0.45 - s, 0.55], abs=1e-6)  # the last one floored
    assert C.class_thresholds(share, 0.84, 0.0, 0.95).tolist() == pytest.approx([0.95, 0.95, 0.2 + 0.84 - s], abs=1e-6)
    assert C.class_thresholds(torch.tensor([1.0]), 0.84, 0.0, 0.95).tolist() == pytest.approx([0.95])  # C = 1: std 0
    assert C.class_share(torch.tensor([2.0, 6.0, 0.0, 2.0])).tolist() == pytest.approx([0.2, 0.6, 0.0, 0.2])
    assert C.class_share(torch.zeros(4)).tolist() == pytest.approx([0.25] * 4)


def test_multiclass_fixed_pseudo_labels_by_hand():
    probs = torch.tensor([[0.9, 0.05, 0.05], [0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.05, 0.05, 0.9]])
    labels = torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    mask = torch.tensor([[True, False, False]] * 4)  # only class 0 annotated: rows 1-3 are not class 0
    tau = torch.tensor([0.9, 0.25, 0.8])
    targets, known = C.multiclass_pseudo(probs, labels, mask, tau)
    # row 0 labelled; row 1: best unannotated class is 1 (0.3 > 0.25), although class 0 has the largest probability;
    # row 2: 0.7 <= 0.8 -> none; row 3: 0.9 > 0.8 -> class 2
    assert known.tolist() == [True, True, False, True]
    assert targets.tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 1]]


def test_multilabel_fixed_pseudo_labels_by_hand():
    probs = torch.tensor([[0.3, 0.9], [0.6, 0.1], [0.2, 0.5]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, False]] * 3)
    tau = torch.tensor([0.99, 0.8])
    targets, known = C.multilabel_pseudo(probs, labels, mask, tau)
    # class 1 unannotated: 0.9 > 0.8 positive, 0.1 < 0.2 negative, 0.5 neither; class 0 keeps its labels
    assert known.tolist() == [[True, True], [True, True], [True, False]]
    assert targets.tolist() == [[1, 1], [0, 0], [0, 0]]


def test_mix_states_by_hand():
    new = {"w": torch.tensor([1.0, 1.0]), "n": torch.tensor(3)}
    res = {"w": torch.tensor([3.0, 5.0]), "n": torch.tensor(1)}
    out = C.mix_states(new, res, 0.25)
    assert out["w"].tolist() == pytest.approx([2.5, 4.0])  # 0.25 new + 0.75 residual
    assert int(out["n"]) == 3  # integer buffers from the new model


# ------------------------------------------------------------------------------------------ trainer


def test_warmup_counts_then_pseudo_labels_from_the_received_model(tmp_path):
    ctx = _site("s", [True, False, True], n=16, tmp=tmp_path)
    ctx.train = {"lr": 1e-2, "batch_size": 8, "local_epochs": 1}
    tr = get_method("cbafed").make_trainer(ctx, {"warmup_rounds": 1})
    assert (tr.tau_base, tr.tau_min) == (0.45, 0.55)  # multi-label defaults (FedMLP's version)
    share = [0.5, 0.1, 0.4]
    warm = tr.train_round(0, 3, {C.META_SHARE: share})  # round 0 < warmup_rounds: labels only
    assert warm.meta[C.META_COUNTS].tolist() == [16, 0, 16] and warm.meta[C.META_TRAINED] == 32
    assert C.META_TAU not in warm.meta and warm.meta[C.META_PSEUDO] == 0

    received = whole_set_pass(ctx.model, tr.loader({"image": "eval"}, shuffle=False), 16, "multilabel")[1]
    out = tr.train_round(1, 3, {C.META_SHARE: share})
    tau = C.class_thresholds(torch.tensor(share), 0.45, 0.55, 0.95)
    assert out.meta[C.META_TAU].tolist() == pytest.approx(tau.tolist())
    p1 = received[:, 1]  # the fixed pseudo labels come from the model the site received this round
    pos, neg = int((p1 > tau[1]).sum()), int((p1 < 1 - tau[1]).sum())
    assert out.meta[C.META_PSEUDO] == pos + neg
    assert out.meta[C.META_COUNTS].tolist() == [16, pos + neg, 16]
    assert out.meta[C.META_PSEUDO_POSITIVES].tolist() == [0, pos, 0]
    assert out.meta[C.META_PSEUDO_RATE] == pytest.approx((pos + neg) / 16)


def test_single_label_counts_and_an_unlabelled_site_sits_out_the_warmup(tmp_path):
    ctx = _mc_site("s", [True, False, False], tmp=tmp_path)
    tr = get_method("cbafed").make_trainer(ctx, {"warmup_rounds": 0, "tau_base": 0.0, "tau_max": 0.4})
    assert tr.tau_min == 0.0
    share = [0.4, 0.3, 0.3]
    received = whole_set_pass(ctx.model, tr.loader({"image": "eval"}, shuffle=False), 30, "multiclass")[1]
    out = tr.train_round(0, 2, {C.META_SHARE: share})
    targets, known = C.multiclass_pseudo(
        received, ctx.data.labels, ctx.data.mask, C.class_thresholds(torch.tensor(share), 0.0, 0.0, 0.4)
    )
    assert out.meta[C.META_COUNTS].tolist() == (targets * known[:, None]).sum(0).tolist()
    assert out.meta[C.META_TRAINED] == int(known.sum()) and out.steps == 3

    blind = _mc_site("u", [False, False, False], tmp=tmp_path)  # an unlabelled site (CBAFed's unlabelled client)
    assert get_method("cbafed").trainer.accepts_unlabelled
    idle = get_method("cbafed").make_trainer(blind, {"warmup_rounds": 2}).train_round(0, 3, {C.META_SHARE: share})
    assert idle.weight == 0.0 and idle.steps == 0 and idle.meta[C.META_TRAINED] == 0


def test_local_residual_connection_by_hand(tmp_path):
    def run(epochs, every):
        ctx = _site("s", [True, True, True], n=8, tmp=tmp_path)
        torch.manual_seed(0)
        ctx.model = PartialLabelNet("small_cnn", 3, 3, width=4)
        ctx.train = {"lr": 5e-2, "batch_size": 8, "local_epochs": epochs}
        tr = get_method("cbafed").make_trainer(
            ctx, {"local_residual_every": every, "local_residual_keep": 0.75, "view": "eval"}
        )
        out = tr.train_round(0, 1, {})
        return {k: v.clone() for k, v in ctx.model.state_dict().items()}, out

    w0, _ = run(1, 0)  # after epoch 0
    w1, _ = run(2, 0)  # after epoch 1, no residual
    mixed, out = run(2, 1)  # after epoch 1: 0.75 * w0 + 0.25 * w1
    assert out.meta[C.META_LOCAL_RESIDUALS] == 1
    for k, v in mixed.items():
        if torch.is_floating_point(v):
            assert torch.allclose(v, 0.75 * w0[k] + 0.25 * w1[k], atol=1e-6), k
    assert any(not torch.allclose(mixed[k], w1[k]) for k in mixed if torch.is_floating_point(mixed[k]))


# ------------------------------------------------------------------------------------------ rule


def _c(site, w, trained, n=10.0, counts=(1.0, 1.0)):
    return Contribution(
        site=site,
        weights={"w": np.array(w, np.float32), "n": np.asarray(1, np.int64)},
        n=n,
        meta={C.META_COUNTS: list(counts), C.META_TRAINED: trained},
    )


def test_rule_share_weights_and_global_residual_by_hand():
    rule = get_method("cbafed").make_rule({})
    out, meta = rule.aggregate(None, [_c("a", [0, 0], 1.0, counts=(1, 3)), _c("b", [2, 2], 3.0, counts=(2, 4))], {}, 0)
    assert out["w"].tolist() == pytest.approx([1.5, 1.5])  # weights 1 : 3 (samples trained on), not n_k
    assert meta[C.META_SHARE].tolist() == pytest.approx([0.3, 0.7]) and meta[C.META_RESIDUAL] == 0
    out, meta = rule.aggregate(None, [_c("a", [4, 4], 1.0), _c("b", [4, 4], 1.0)], {}, 3)
    assert out["w"].tolist() == pytest.approx([4, 4]) and meta[C.META_RESIDUAL] == 0  # 3 % 5 != 0
    out, meta = rule.aggregate(None, [_c("a", [4, 4], 1.0), _c("b", [4, 4], 1.0)], {}, 5)
    assert out["w"].tolist() == pytest.approx([2.75, 2.75]) and meta[C.META_RESIDUAL] == 1  # 0.5 * 4 + 0.5 * 1.5
    assert int(out["n"]) == 1 and out["w"].dtype == np.float32
    restored = get_method("cbafed").make_rule({})
    restored.load_state_dict(rule.state_dict())  # the residual model survives a restart of the rule
    out, _ = restored.aggregate(None, [_c("a", [0, 0], 1.0), _c("b", [0, 0], 1.0)], {}, 10)
    assert out["w"].tolist() == pytest.approx([1.375, 1.375])  # 0.5 * 0 + 0.5 * 2.75
    plain = get_method("cbafed").make_rule({"weighting": "samples", "residual_every": 0})
    out, _ = plain.aggregate(None, [_c("a", [0, 0], 1.0, n=30.0), _c("b", [2, 2], 3.0, n=10.0)], {}, 0)
    assert out["w"].tolist() == pytest.approx([0.5, 0.5])  # n_k weights 3 : 1
    with pytest.raises(ValueError, match="class counts"):
        rule.aggregate(None, [Contribution(site="x", weights={"w": np.zeros(2, np.float32)}, n=1.0, meta={})], {}, 1)


def test_job_runs_cbafed_on_ich():
    job = REPO / "jobs" / "cbafed_ich"
    client = json.loads((job / "app/config/config_fed_client.json").read_text())
    server = json.loads((job / "app/config/config_fed_server.json").read_text())
    assert client["method"] == server["method"] == "cbafed"
    args = client["executors"][0]["executor"]["args"]
    assert args["dataset"]["preset"] == "ich_phantom"
    get_method("cbafed").split_options(args["method_args"])
