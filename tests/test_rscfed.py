"""RSCFed: distance-reweighted aggregation by hand, the model distance, the sub-set sampling
(reproducible with a seed), the rule's mean of sub-consensus models and its counters, the mean-teacher pieces
(sharpening, consistency, EMA decay) by hand, the persistent teacher, both task types, and the job."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fedlsm import _mc_site
from test_fedmlp import _site

from fedpartial.methods import Contribution, get_method
from fedpartial.methods import rscfed as R

REPO = Path(__file__).resolve().parents[1]


def _state(w, nbt=0):
    return {"w": np.asarray(w, np.float32), "nbt": np.asarray(nbt, np.int64)}


# ------------------------------------------------------------------------------------------ server maths


def test_model_distance_l2_and_sum_of_norms():
    ref = {"x": np.zeros(2, np.float32), "y": np.zeros(2, np.float32), "n": np.asarray(0)}
    s = {"x": np.array([3.0, 0.0], np.float32), "y": np.array([0.0, 4.0], np.float32), "n": np.asarray(100)}
    assert R.model_distance(s, ref, "l2") == pytest.approx(5.0)  # sqrt(9 + 16); the integer buffer is left out
    assert R.model_distance(s, ref, "sum") == pytest.approx(7.0)  # 3 + 4 (the released code's model_dist)


def test_dma_weights_by_hand():
    n, d = [10.0, 30.0], [0.01, 0.003]
    # w_k ∝ (n_k / N) exp(-beta d_k / n_k): 0.25 e^-1 and 0.75 e^-0.1 with beta = 1000
    a = [0.25 * math.exp(-1.0), 0.75 * math.exp(-0.1)]
    assert R.dma_weights(n, d, 1000.0).tolist() == pytest.approx([a[0] / sum(a), a[1] / sum(a)])
    assert R.dma_weights(n, d, 0.0).tolist() == pytest.approx([0.25, 0.75])  # beta 0: FedAvg weights
    # log-space: distances that would underflow exp() still give finite weights
    w = R.dma_weights([1.0, 1.0], [1e3, 1e3 + 1.0], 1e4)
    assert np.isfinite(w).all() and w.sum() == pytest.approx(1.0) and w[0] > 0.99


def test_dma_aggregate_by_hand():
    states = [_state([0, 0], 2), _state([0, 0], 2), _state([3, 4], 8)]
    beta = 0.6 * math.log(2)  # with uniform n: factors exp(-beta d): d = 5/3, 5/3, 10/3 -> 1/2, 1/2, 1/4
    # center = uniform mean (1, 4/3): d_A = d_B = |(1, 4/3)| = 5/3, d_C = |(2, 8/3)| = 10/3
    model, w, d = R.dma_aggregate(states, [1.0, 1.0, 1.0], beta, center="uniform")
    assert d.tolist() == pytest.approx([5 / 3, 5 / 3, 10 / 3])
    assert w.tolist() == pytest.approx([0.4, 0.4, 0.2])  # (1/2, 1/2, 1/4) normalised: the far model is down-weighted
    assert model["w"].tolist() == pytest.approx([0.6, 0.8])  # 0.2 * (3, 4)
    assert model["nbt"] == 3 and model["nbt"].dtype == np.int64  # 0.4*2 + 0.4*2 + 0.2*8 = 3.2, rounded
    # center "samples" uses the n_k weights for the average the distances are measured from
    _, _, d2 = R.dma_aggregate(states, [1.0, 1.0, 2.0], 0.0, center="samples")
    assert d2.tolist() == pytest.approx([2.5, 2.5, 2.5])  # average (1.5, 2)


def test_subset_size_and_sampling_reproducible_with_a_seed():
    assert [R.subset_size(5, 0.5), R.subset_size(10, 0.5), R.subset_size(8, 6), R.subset_size(3, 6)] == [3, 5, 6, 3]
    a = R.sample_subsets(10, 3, 5, seed=7, round_num=4)
    assert a.shape == (3, 5)
    assert all(len(set(row)) == 5 and list(row) == sorted(row) for row in a)  # distinct sites, sorted
    assert np.array_equal(a, R.sample_subsets(10, 3, 5, seed=7, round_num=4))  # same seed and round: same sub-sets
    others = [R.sample_subsets(10, 3, 5, seed=7, round_num=r) for r in range(5, 10)]
    assert any(not np.array_equal(a, o) for o in others)  # the round changes them
    assert not np.array_equal(a, R.sample_subsets(10, 3, 5, seed=8, round_num=4))
    with pytest.raises(ValueError):
        R.sample_subsets(3, 1, 4, 0, 0)


def _contrib(site, w, n=1.0):
    return Contribution(site=site, weights=_state(w), n=n, meta={})


def test_rule_mean_of_sub_consensus_models_and_counters():
    contribs = [_contrib("c", [3, 4]), _contrib("a", [0, 0]), _contrib("b", [0, 0])]  # arrival order differs
    beta = 0.6 * math.log(2)
    one = get_method("rscfed").make_rule({"subsets": 1, "subset_size": 3, "beta": beta, "center": "uniform"})
    out, meta = one.aggregate(None, contribs, {}, 0)
    assert out["w"].tolist() == pytest.approx([0.6, 0.8])  # the single sub-set is the DMA example above
    assert meta[R.META_SITES] == ["a", "b", "c"]  # indices refer to the sites sorted by name
    assert meta[R.META_SUBSETS].tolist() == [[0, 1, 2]]
    assert meta[R.META_SUBSET_WEIGHTS].tolist() == [pytest.approx([0.4, 0.4, 0.2])]
    assert meta[R.META_SITE_SHARE].tolist() == pytest.approx([0.4, 0.4, 0.2]) and meta[R.META_UNSAMPLED] == 0

    rule = get_method("rscfed").make_rule({"subsets": 4, "subset_size": 2, "beta": 1.0, "seed": 3})
    out, meta = rule.aggregate(None, contribs, {}, 5)
    subsets = rule.subsets_for(3, 5)
    assert np.array_equal(meta[R.META_SUBSETS], subsets)
    states = [_state([0, 0]), _state([0, 0]), _state([3, 4])]  # a, b, c
    expected = np.mean([R.dma_aggregate([states[i] for i in s], [1.0, 1.0], 1.0)[0]["w"] for s in subsets], 0)
    assert out["w"] == pytest.approx(expected, abs=1e-6)  # the plain mean of the M sub-consensus models
    assert meta[R.META_SITE_SHARE].sum() == pytest.approx(1.0)
    again, _ = (
        get_method("rscfed")
        .make_rule({"subsets": 4, "subset_size": 2, "beta": 1.0, "seed": 3})
        .aggregate(None, list(reversed(contribs)), {}, 5)
    )
    assert np.array_equal(again["w"], out["w"])  # reproducible: same seed and round, any arrival order


def test_rule_norm_frozen_and_refused_robust_option():
    prev = {"w": np.array([9.0, 9.0], np.float32), "bn": np.array([1.0], np.float32)}
    contribs = [
        Contribution(site=s, weights={"w": np.array(v, np.float32), "bn": np.array([5.0], np.float32)}, n=1.0, meta={})
        for s, v in (("a", [0, 0]), ("b", [2, 2]))
    ]
    out, _ = (
        get_method("rscfed")
        .make_rule({"norm": "frozen", "subsets": 1, "subset_size": 2})
        .aggregate(prev, contribs, {"norm": ["bn"]}, 1)
    )
    assert out["bn"].tolist() == [1.0] and out["w"].tolist() == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="robust"):
        get_method("rscfed").make_rule({"robust": "median"})


# ------------------------------------------------------------------------------------------ site maths


def test_sharpen_ema_decay_and_consistency_by_hand():
    p = torch.tensor([[0.6, 0.4]])
    assert R.sharpen(p, 0.5, "softmax").tolist()[0] == pytest.approx([0.36 / 0.52, 0.16 / 0.52])
    assert R.sharpen(torch.tensor([[0.6]]), 0.5, "sigmoid").item() == pytest.approx(0.36 / 0.52)
    assert torch.equal(R.sharpen(p, 1.0, "softmax"), p)
    assert [R.ema_decay(0), R.ema_decay(9), R.ema_decay(10**6, 0.999)] == pytest.approx([0.0, 0.9, 0.999])

    student = torch.log(torch.tensor([[0.5, 0.5], [0.8, 0.2]]))  # softmax(log p) = p
    teacher = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    rows = torch.tensor([False, True])  # only row 2 is unlabelled
    assert R.consistency_loss(student, teacher, rows, "softmax").item() == pytest.approx(0.7**2 * 2)
    logits = torch.tensor([[0.0, math.log(3.0)]])  # sigmoid 0.5, 0.75
    t = torch.tensor([[0.1, 0.25]])
    entries = torch.tensor([[True, True]])
    assert R.consistency_loss(logits, t, entries, "sigmoid").item() == pytest.approx((0.4**2 + 0.5**2) / 2)
    assert R.consistency_loss(logits, t, torch.tensor([[False, True]]), "sigmoid").item() == pytest.approx(0.25)
    assert R.consistency_loss(logits, t, torch.zeros(1, 2, dtype=torch.bool), "sigmoid").item() == 0.0


# ------------------------------------------------------------------------------------------ trainer


def test_multilabel_round_teacher_counters_and_persistence(tmp_path):
    ctx = _site("s", [True, False, True], n=16, tmp=tmp_path)
    ctx.train = {"lr": 1e-2, "batch_size": 8, "local_steps": 1}
    tr = get_method("rscfed").make_trainer(ctx, {})
    out = tr.train_round(0, 2, {})
    assert out.meta[R.META_UNLABELLED] == 8  # one batch of 8 rows x 1 unannotated class
    assert 0.0 <= out.meta[R.META_CONFIDENT] <= 1.0 and out.meta[R.META_CONSISTENCY] >= 0
    # the first EMA step has decay min(1 - 1/1, 0.999) = 0: the teacher is the student after the step
    student = ctx.model.state_dict()
    assert all(torch.allclose(v, student[k].to(v.dtype)) for k, v in tr.teacher.state_dict().items())
    fresh = get_method("rscfed").make_trainer(ctx, {})
    fresh.load_state_dict(tr.state_dict())  # a new process restores the teacher and the step count
    assert fresh.ema_step == 1
    assert all(torch.equal(v, student[k]) for k, v in fresh.ensure_teacher().state_dict().items())


def test_consistency_term_changes_training(tmp_path):
    def run(weight):
        ctx = _site("s", [True, False, False], n=16, tmp=tmp_path, seed=1)
        torch.manual_seed(0)
        ctx.model = type(ctx.model)("small_cnn", 3, 3, width=4)
        ctx.train = {"lr": 1e-2, "batch_size": 8, "local_steps": 3}
        tr = get_method("rscfed").make_trainer(ctx, {"consistency_weight": weight})
        tr.ensure_teacher()
        with torch.no_grad():  # a teacher that disagrees with the student
            for p in tr.teacher.parameters():
                p.add_(0.5)
        tr.train_round(1, 2, {})
        return ctx.model.state_dict()

    a, b = run(0.0), run(1.0)
    assert any(not torch.allclose(a[k], b[k]) for k in a if torch.is_floating_point(a[k]))


def test_single_label_round_distils_the_unlabelled_rows(tmp_path):
    ctx = _mc_site("s", [True, False, False], tmp=tmp_path)  # 30 rows, 3 steps of 10
    tr = get_method("rscfed").make_trainer(ctx, {"sharpen": 0.5, "max_grad_norm": 5.0})
    out = tr.train_round(0, 2, {})
    unlabelled = int(((ctx.data.labels * ctx.data.mask).sum(1) == 0).sum())
    assert out.meta[R.META_UNLABELLED] == unlabelled > 0 and out.steps == 3
    assert tr.unknown(ctx.data.labels[:4], ctx.data.mask[:4]).dim() == 1  # rows, not entries
    with pytest.raises(ValueError, match="sharpen"):
        get_method("rscfed").make_trainer(ctx, {"sharpen": 0.0})
    # an unlabelled site (RSCFed's unlabelled clients): distillation only, on every row
    blind = _mc_site("u", [False, False, False], tmp=tmp_path)
    assert get_method("rscfed").trainer.accepts_unlabelled
    out = get_method("rscfed").make_trainer(blind, {}).train_round(0, 2, {})
    assert out.meta[R.META_UNLABELLED] == 30 and out.meta[R.META_SUPERVISED] == 0.0 and out.weight == 1.0


def test_job_runs_rscfed_on_ich():
    job = REPO / "jobs" / "rscfed_ich"
    client = json.loads((job / "app/config/config_fed_client.json").read_text())
    server = json.loads((job / "app/config/config_fed_server.json").read_text())
    assert client["method"] == server["method"] == "rscfed"
    args = client["executors"][0]["executor"]["args"]
    assert args["dataset"]["preset"] == "ich_phantom"
    agg = next(c for c in server["components"] if c["id"] == "aggregator")
    get_method("rscfed").make_rule(agg["args"]["method_args"])  # the server's options build
