"""FedLSM (fedpartial.methods.fedlsm): each equation against values computed by hand on tiny tensors, the AWPA
rule with its zero-count fallback and ablation modes, and 3-round end-to-end runs of fake sites (both tasks)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_sites import FakeData, FakeDataset, fake_site
from test_fedmlp import _site

from fedpartial.methods import Contribution, TrainOptions, get_method
from fedpartial.methods import fedlsm as L
from fedpartial.models import PartialLabelNet

LN2 = math.log(2.0)


def h2(p: float) -> float:
    """binary entropy in nats, by hand"""
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


# ------------------------------------------------------------------------------------------ UE


def test_softmax_entropy_eq3():
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    # -2 * 0.5 ln 0.5 = ln 2;  one-hot -> 0 (0 log 0 = 0);  uniform over 4 -> ln 4 = 2 ln 2
    assert torch.allclose(L.softmax_entropy(probs), torch.tensor([LN2, 0.0, 2 * LN2]), atol=1e-6)


def test_multilabel_entropy_only_unknown_classes_normalised():
    # class 0 is annotated (ignored), U = {1, 2}
    probs = torch.tensor([[0.5, 0.9, 0.5], [0.5, 0.0, 1.0], [0.9, 0.5, 0.5]])
    unknown = torch.tensor([False, True, True])
    # row 0: mean(h(0.9), h(0.5)) / ln 2 = (0.325083 / 0.693147 + 1) / 2 = 0.734498
    # row 1: certain on U -> 0;  row 2: both 0.5 -> 1 (the maximum)
    expected = torch.tensor([(h2(0.9) / LN2 + 1.0) / 2, 0.0, 1.0])
    assert torch.allclose(L.multilabel_entropy(probs, unknown), expected, atol=1e-6)
    assert abs(expected[0].item() - 0.734498) < 1e-5
    # released code: sum_{c in U} -p ln p = 0.9*0.105361 + 0.5*0.693147 = 0.441398, / (|U|/e = 2/e) = 0.599924
    code = L.multilabel_entropy(probs, unknown, kind="plogp")
    assert code[0].item() == pytest.approx((0.9 * -math.log(0.9) + 0.5 * LN2) * math.e / 2, abs=1e-6)
    assert code[0].item() == pytest.approx(0.599924, abs=1e-5)
    # no unknown class (a site annotating everything): no uncertainty
    assert torch.equal(L.multilabel_entropy(probs, torch.zeros(3, dtype=torch.bool)), torch.zeros(3))
    with pytest.raises(ValueError):
        L.multilabel_entropy(probs, unknown, kind="other")


def test_pool_sizes_counts_and_fractions():
    assert L.pool_sizes(100, 0.05, 0.2) == (5, 20)  # fractions
    assert L.pool_sizes(100, 5, 20) == (5, 20)  # counts
    assert L.pool_sizes(10, 3, 20) == (3, 7)  # the confident pool gets what is left
    assert L.pool_sizes(10, 30, 2) == (10, 0)
    assert L.pool_sizes(10, 0.3, 0.5) == (3, 5)
    with pytest.raises(ValueError):
        L.pool_sizes(10, -1, 2)


def test_split_pools_by_entropy():
    scores = torch.tensor([0.3, 0.9, 0.1, 0.5, 0.7, 0.2])
    # ascending: 2 (0.1), 5 (0.2), 0 (0.3), 3 (0.5), 4 (0.7), 1 (0.9)
    conf, med, unc = L.split_pools(scores, n_uncertain=2, n_confident=2)
    assert conf.tolist() == [2, 5] and med.tolist() == [0, 3] and unc.tolist() == [4, 1]
    # ties keep the lower index first
    conf, med, unc = L.split_pools(torch.tensor([0.5, 0.5, 0.1]), 0, 2)
    assert conf.tolist() == [2, 0] and med.tolist() == [1] and unc.tolist() == []
    with pytest.raises(ValueError):
        L.split_pools(scores, 4, 3)


# ------------------------------------------------------------------------------------------ pseudo labels


def _mc_batch():
    # 3 classes, the site annotates class 0 only (U = {1, 2})
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False]] * 4)
    teacher = torch.tensor(
        [
            [0.10, 0.80, 0.10],  # labelled row: its label wins
            [0.02, 0.96, 0.02],  # unlabelled, 0.96 >= 0.95 on class 1 in U -> pseudo 1
            [0.30, 0.40, 0.30],  # unlabelled, not confident -> nothing
            [0.97, 0.02, 0.01],
        ]
    )  # unlabelled, confident on class 0 which is NOT in U
    return labels, mask, teacher


def test_multiclass_targets_threshold_and_unknown_classes():
    labels, mask, teacher = _mc_batch()
    t, lab, pseudo = L.multiclass_targets(labels, mask, teacher, 0.95, unknown=torch.tensor([False, True, True]))
    assert lab.tolist() == [True, False, False, False]
    assert pseudo.tolist() == [False, True, False, False]
    assert t.tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0]]
    # released code: any class may be a pseudo label
    t, _, pseudo = L.multiclass_targets(labels, mask, teacher, 0.95, unknown=None)
    assert pseudo.tolist() == [False, True, False, True] and t[3].tolist() == [1, 0, 0]
    # the lower UDE threshold tau_l = 0.85 does not change row 2 (max 0.4) but 0.35 does
    _, _, pseudo = L.multiclass_targets(labels, mask, teacher, 0.35, unknown=torch.tensor([False, True, True]))
    assert pseudo.tolist() == [False, True, True, False]


def test_pseudo_ce_eq4_normalised_by_unlabelled_rows():
    labels, mask, teacher = _mc_batch()
    t, lab, pseudo = L.multiclass_targets(labels, mask, teacher, 0.95, unknown=torch.tensor([False, True, True]))
    logits = torch.zeros(4, 3)
    logits[1] = torch.tensor([0.0, math.log(3.0), 0.0])  # softmax class 1 = 3 / (1 + 3 + 1) = 0.6
    # one pseudo-labelled row, N_U = 3 unlabelled rows: -ln(0.6) / 3
    assert L.pseudo_ce(logits, t, pseudo, n_unlabelled=3).item() == pytest.approx(-math.log(0.6) / 3, abs=1e-6)
    assert L.pseudo_ce(logits, t, torch.zeros(4, dtype=torch.bool), 3).item() == 0.0


def test_multilabel_targets_positive_negative_thresholds():
    labels = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False, False, False]])
    teacher = torch.tensor([[0.01, 0.99, 0.90, 0.003, 0.007]])
    t, known, pseudo = L.multilabel_targets(labels, mask, teacher, tau_p=0.85, tau_n=0.005)
    # annotated entries keep their labels whatever the teacher says; 0.90 >= 0.85 -> 1; 0.003 <= 0.005 -> 0;
    # 0.007 is in between -> unlabelled
    assert t.tolist() == [[1, 0, 1, 0, 0]]
    assert known.tolist() == [[True, True, True, True, False]]
    assert pseudo.tolist() == [[False, False, True, True, False]]
    # the code's tau_n = 0.01 also makes 0.007 a negative
    _, known, _ = L.multilabel_targets(labels, mask, teacher, tau_p=0.85, tau_n=0.01)
    assert known.tolist() == [[True] * 5]
    # the UDE thresholds for uncertain samples (0.7 / 0.01) are lower / higher
    _, _, pseudo = L.multilabel_targets(labels, mask, torch.tensor([[0.5, 0.5, 0.75, 0.5, 0.5]]), 0.7, 0.01)
    assert pseudo.tolist() == [[False, False, True, False, False]]


def test_negative_positive_ratio_and_weighted_bce():
    # class 0: 8 / 2 = 4; class 1 has no positive and class 2 no negative -> 1
    w = L.negative_positive_ratio(torch.tensor([2.0, 0.0, 5.0]), torch.tensor([8.0, 10.0, 0.0]))
    assert w.tolist() == [4.0, 1.0, 1.0]
    logits = torch.zeros(2, 2)  # sigmoid 0.5: BCE ln 2 for either target
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    known = torch.tensor([[True, True], [True, False]])
    cw = torch.tensor([3.0, 1.0])
    # positive-term weight: (3 ln2 + ln2 + ln2) / B=2
    assert L.weighted_bce(logits, targets, known, cw, "positive").item() == pytest.approx(5 * LN2 / 2, abs=1e-6)
    # whole entry weighted (released code): (3 ln2 + ln2 + 3 ln2) / 2
    assert L.weighted_bce(logits, targets, known, cw, "entry").item() == pytest.approx(7 * LN2 / 2, abs=1e-6)
    assert L.weighted_bce(logits, targets, known, None).item() == pytest.approx(3 * LN2 / 2, abs=1e-6)
    # a soft target 0.25 at sigmoid 0.75: -(0.25 ln 0.75 + 0.75 ln 0.25)
    soft = L.weighted_bce(torch.tensor([[math.log(3.0)]]), torch.tensor([[0.25]]), torch.tensor([[True]]))
    assert soft.item() == pytest.approx(-(0.25 * math.log(0.75) + 0.75 * math.log(0.25)), abs=1e-6)


# ------------------------------------------------------------------------------------------ EMA, MixUp


def test_ema_update_parameters_and_buffers():
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.BatchNorm1d(1))
    student = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.BatchNorm1d(1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.fill_(1.0)
        for p in student.parameters():
            p.fill_(3.0)
        student[1].running_mean.fill_(2.0)
        student[1].num_batches_tracked.fill_(7)
    L.ema_update(teacher, student, decay=0.9)
    # 0.9 * 1 + 0.1 * 3 = 1.2;  running mean 0.9 * 0 + 0.1 * 2 = 0.2;  counter copied
    assert all(torch.allclose(p, torch.full_like(p, 1.2)) for p in teacher.parameters())
    assert teacher[1].running_mean.item() == pytest.approx(0.2)
    assert teacher[1].num_batches_tracked.item() == 7
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in student.parameters())  # student untouched


def test_mixup_eq6_and_soft_ce():
    x_l, x_h = torch.full((1, 1, 2, 2), 2.0), torch.zeros(1, 1, 2, 2)
    y_l, y_h = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    x, y = L.mixup(x_l, y_l, x_h, y_h, lam=0.25)
    assert torch.allclose(x, torch.full_like(x, 0.5))  # 0.25 * 2 + 0.75 * 0
    assert y.tolist() == [[0.25, 0.75]]
    # CE with soft labels at uniform logits: -(0.25 ln 0.5 + 0.75 ln 0.5) = ln 2; rows without labels skipped
    logits = torch.zeros(2, 2)
    targets = torch.cat([y, torch.tensor([[1.0, 0.0]])])
    assert L.soft_ce(logits, targets, torch.tensor([True, False])).item() == pytest.approx(LN2, abs=1e-6)
    assert L.soft_ce(logits, targets, torch.tensor([False, False])).item() == 0.0


# ------------------------------------------------------------------------------------------ AWPA


def test_awpa_weights_with_zero_count_fallback():
    q = np.array([[10.0, 0.0, 0.0], [30.0, 5.0, 0.0]])
    w = L.awpa_weights(q, [100.0, 300.0])
    # class 0: 10/40, 30/40; class 1: 0/5, 5/5; class 2: nobody -> n_k / n = 100/400, 300/400
    assert np.allclose(w, [[0.25, 0.0, 0.25], [0.75, 1.0, 0.75]])
    with pytest.raises(ValueError):
        L.awpa_weights(np.array([[-1.0]]), [1.0])


def _states():
    s1 = {
        "body.w": np.array([1.0]),
        "classifier.weight": np.array([[1.0], [2.0], [3.0]]),
        "classifier.bias": np.array([1.0, 2.0, 3.0]),
    }
    s2 = {
        "body.w": np.array([5.0]),
        "classifier.weight": np.array([[5.0], [6.0], [7.0]]),
        "classifier.bias": np.array([5.0, 6.0, 7.0]),
    }
    prev = {
        "body.w": np.array([0.0]),
        "classifier.weight": np.array([[9.0], [9.0], [9.0]]),
        "classifier.bias": np.array([9.0, 9.0, 9.0]),
    }
    c1 = Contribution("site-1", s1, 100.0, {"annotated": [True, False, True], L.META_Q: [10.0, 0.0, 0.0]})
    c2 = Contribution("site-2", s2, 300.0, {"annotated": [True, True, False], L.META_Q: [30.0, 5.0, 0.0]})
    return prev, [c1, c2]


def test_rule_adaptive_masked_fedavg():
    prev, cons = _states()
    keys = {"classifier": ["classifier.weight", "classifier.bias"]}
    w, meta = L.FedLSMRule().aggregate(prev, cons, keys, 0)
    assert meta == {}
    assert w["body.w"][0] == pytest.approx(0.25 * 1 + 0.75 * 5)  # feature extractor by n_k = 4
    # rows: class 0: 0.25*1 + 0.75*5 = 4; class 1: site-2 only = 6; class 2: no q -> n_k: 0.25*3 + 0.75*7 = 6
    assert np.allclose(w["classifier.weight"][:, 0], [4.0, 6.0, 6.0])
    assert np.allclose(w["classifier.bias"], [4.0, 6.0, 6.0])
    # masked (Ours*): class 1 from site-2 (6), class 2 from site-1 (3)
    w, _ = L.FedLSMRule(awpa="masked").aggregate(prev, cons, keys, 0)
    assert np.allclose(w["classifier.weight"][:, 0], [4.0, 6.0, 3.0])
    # fedavg: every row by n_k
    w, _ = L.FedLSMRule(awpa="fedavg").aggregate(prev, cons, keys, 0)
    assert np.allclose(w["classifier.weight"][:, 0], [4.0, 5.0, 6.0])
    with pytest.raises(ValueError):
        L.FedLSMRule(awpa="nope")
    bad = [Contribution("site-3", cons[0].weights, 1.0, {"annotated": [True, True, True]})]
    with pytest.raises(ValueError, match="site-3"):
        L.FedLSMRule().aggregate(prev, bad, keys, 0)


# ------------------------------------------------------------------------------------------ trainer pieces


def _mc_site(name, annotated, n=30, C=3, seed=0, model=None, tmp: Path | None = None):
    """A single-label fake site: one-hot rows, labelled only where the class is annotated here."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, C, (n,), generator=g)
    full = torch.nn.functional.one_hot(y, C).float()
    images = torch.randn(n, 3, 16, 16, generator=g) * 0.3
    for c in range(min(C, 3)):
        images[:, c] += full[:, c : c + 1, None]
    annotated = np.asarray(annotated, bool)
    mask = torch.as_tensor(annotated)[None, :].expand(n, C).clone()
    labels = full * mask
    model = model or PartialLabelNet("small_cnn", C, 3, width=4)
    train = {"lr": 1e-3, "batch_size": 10, "local_steps": 3}
    return fake_site(name, "multiclass", annotated, images, labels, mask, model, train, seed, tmp)


def test_estimated_counts_labelled_plus_pseudo_positives():
    tr = L.FedLSMTrainer(_mc_site("x", [True, False, False]))
    labels, mask, teacher = _mc_batch()
    t, known, _ = tr.targets(labels, mask, teacher)
    # one labelled positive of class 0, one pseudo positive of class 1 (row 3's class 0 is not in U)
    assert tr.estimated_counts(labels, mask, t, known).tolist() == [1.0, 1.0, 0.0]
    ml = L.FedLSMTrainer(_site("y", [True, False, False], n=4, C=3))
    labels = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False]] * 3)
    teacher = torch.tensor([[0.5, 0.9, 0.001], [0.5, 0.9, 0.9], [0.99, 0.5, 0.001]])
    t, known, _ = ml.targets(labels, mask, teacher)
    # class 0: 2 labelled positives (the teacher's 0.99 on an annotated entry does not count);
    # class 1: 2 pseudo positives (0.9 >= 0.85); class 2: 1 pseudo positive
    assert ml.estimated_counts(labels, mask, t, known).tolist() == [2.0, 2.0, 1.0]


def test_class_weights_from_the_server_summary():
    ctx = _site("y", [True, False, False], n=4, C=3)
    ctx.summary = {
        "classes": ["c0", "c1", "c2"],
        "sites": {
            "a": {"positives": [2, 1, 0], "negatives": [6, 3, 0]},
            "b": {"positives": [0, 1, 5], "negatives": [0, 3, 15]},
        },
    }
    tr = L.FedLSMTrainer(ctx)
    # class 0: 6/2 = 3; class 1: (3+3)/(1+1) = 3; class 2: 15/5 = 3 -> change one to see the sum
    ctx.summary["sites"]["b"]["negatives"][0] = 2  # class 0: (6 + 2) / 2 = 4
    assert tr.class_weights(torch.zeros(4, 3), torch.ones(4, 3, dtype=torch.bool)).tolist() == [4.0, 3.0, 3.0]
    assert L.FedLSMTrainer(_mc_site("x", [True, False, False])).class_weights(None, None) is None


def test_registered_with_options_and_validation():
    method = get_method("fedlsm")
    assert method.trainer is L.FedLSMTrainer and method.rule is L.FedLSMRule
    with pytest.raises(ValueError):
        L.FedLSMTrainer(_mc_site("x", [True, False, False]), entropy="x")
    with pytest.raises(ValueError):
        L.FedLSMTrainer(_mc_site("x", [True, False, False]), tau=1.5)
    # one method_args dict: each side takes its own options, an unknown key is an error
    trainer_args, rule_args = method.split_options({"awpa": "masked", "tau": 0.9})
    assert trainer_args == {"tau": 0.9} and rule_args == {"awpa": "masked"}
    with pytest.raises(ValueError, match="'awpa_mode'.*did you mean 'awpa'"):
        method.split_options({"awpa_mode": "masked"})
    tr = method.make_trainer(_mc_site("x", [True, False, False]), {"awpa": "masked"})
    assert tr.keeps_optimizer_state is True  # FedLSM's default: the optimiser state persists


# ------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("task", ["multiclass", "multilabel"])
def test_end_to_end_three_rounds_with_state(task, tmp_path):
    torch.manual_seed(0)
    # thresholds loose enough for an untrained net (sigmoid outputs near 0.5): pseudo labels must appear
    opts = dict(
        tau=0.3, tau_l=0.2, tau_p=0.5, tau_n=0.5, tau_lp=0.5, tau_ln=0.5, n_uncertain=0.2, n_confident=0.3, n_mix=2
    )

    def make(i):
        if task == "multiclass":
            return _mc_site(f"site-{i + 1}", [[True, True, False], [False, True, True]][i], seed=i + 1, tmp=tmp_path)
        ctx = _site(f"site-{i + 1}", [[True, True, False], [False, True, True]][i], n=30, seed=i + 1, tmp=tmp_path)
        ctx.train = TrainOptions(lr=1e-3, batch_size=10, local_steps=3)
        return ctx

    ctxs = [make(0), make(1)]
    trainers = [L.FedLSMTrainer(c, **opts) for c in ctxs]
    rule = L.FedLSMRule()
    global_w = {k: v.detach().clone() for k, v in ctxs[0].model.state_dict().items()}
    keys = ctxs[0].model.parameter_groups()
    for rnd in range(3):
        if rnd == 2:  # a fresh process takes over site-1: the Adam state comes back from the saved file
            path = tmp_path / "trainer_state.pt"
            torch.save(trainers[0].state_dict(), path)
            ctxs[0] = make(0)
            trainers[0] = L.FedLSMTrainer(ctxs[0], **opts)
            trainers[0].load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
        cons = []
        for ctx, tr in zip(ctxs, trainers):
            ctx.model.load_state_dict(global_w)
            out = tr.train_round(rnd, 3, {})
            assert out.steps == 3 and math.isfinite(out.loss)
            # pools: 20% of 30 uncertain, 30% confident, the rest medium
            assert out.meta[L.META_POOLS] == [9, 15, 6]
            q = np.asarray(out.meta[L.META_Q])
            assert q.shape == (3,) and (q >= 0).all()
            cons.append(
                Contribution(
                    ctx.site,
                    {k: v.detach().numpy().copy() for k, v in ctx.model.state_dict().items()},
                    30.0,
                    {**out.meta, "annotated": ctx.annotated.tolist()},
                )
            )
        # Adam state persists: step count = 3 steps per round x rounds so far (also across the restart)
        adam_steps = trainers[0].optimizer.state_dict()["state"][0]["step"]
        assert int(adam_steps) == 3 * (rnd + 1)
        weights, _ = rule.aggregate(None, cons, keys, rnd)
        global_w = {k: torch.as_tensor(v) for k, v in weights.items()}
    # loose thresholds: pseudo labels and mixed samples were used
    assert sum(c.meta[L.META_PSEUDO] for c in cons) > 0 and sum(c.meta[L.META_UDE_PAIRS] for c in cons) > 0


# ------------------------------------------------------------------------------------------ simulator


@pytest.mark.integration
@pytest.mark.parametrize("job", ["fedlsm_isic"])  # fedlsm_cxr14: same glue; multi-label rounds in process below
def test_job_three_rounds_in_the_simulator(job, tmp_path, data_cache):  # and in test_method_zoo.py
    """3 rounds of each FedLSM job through `nvflare simulator` on tiny real data: every site contributes every
    round, the AWPA rule aggregates, the Adam state survives as site state, and results.json holds the
    best-on-validation model's test metrics (the paper's layout)."""
    from test_jobs_simulator import TINY

    from conftest import HAM_WITHOUT_TABLE, copy_job, real_data, results_of, run_simulator, server_log

    kind = "ham10000" if job == "fedlsm_isic" else "cxr14"
    real_data("ham10000" if kind == "ham10000" else "nih_cxr14_1000")
    from fedpartial.data.presets import deep_merge

    n = 3  # sites, each missing 3 classes (the table's 5 sites: its configuration check in test_jobs_simulator.py)
    args = {
        **deep_merge(TINY[kind], {"dataset": {"prepare": HAM_WITHOUT_TABLE}}),
        "train": {"batch_size": 16, "local_steps": 2},
    }
    job_dir = copy_job(job, tmp_path / job, num_rounds=3, executor_args=args, sites=n)
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=n, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert res["method"] == "fedlsm" and res["num_rounds"] == 3
    num_classes = len(res["rounds"][0]["val"]["per_class"])
    for r in res["rounds"]:
        assert len(r["sites"]) == n and r["val"]["macro"]["auc"] is not None
        for site, stats in r["site_stats"].items():  # the round's counters, per site, in results.json
            assert isinstance(stats["fedlsm_pseudo"], int) and stats["fedlsm_pseudo"] >= 0, (r["round"], site)
            assert len(stats["fedlsm_pools"]) == 3 and len(stats["fedlsm_q"]) == num_classes, (r["round"], site)
    assert res["best"] is not None
    assert "fedlsm_pseudo" in (ws / "site-1" / "log.txt").read_text()  # and in each site's round log line
    best = res["final"]["best_FL_global_model.pt"]["test"]
    metrics = ("auc", "accuracy", "f1", "precision", "recall") if kind == "ham10000" else ("auc",)
    assert all(best["macro"][m] is not None for m in metrics)
    log = server_log(ws)
    assert "with rule FedLSMRule" in log
    for i in range(1, n + 1):
        state = torch.load(ws / f"site-{i}/simulate_job/fedpartial_state/trainer_state.pt", weights_only=False)
        assert int(state["optimizer"]["state"][0]["step"]) == 3 * 2  # 3 rounds x 2 local steps, one Adam


def test_fresh_sample_order_every_round_not_a_replay():
    """The released code rebuilds its samplers with the same seed every round (a site replays the same images);
    here each round draws its own permutation of the pseudo-label pool."""
    ctx = _mc_site("site-1", [True, True, False], n=40, seed=3)
    ctx.train = {"lr": 1e-3, "batch_size": 10, "local_steps": 2}
    seen: list[int] = []

    class Recording(FakeDataset):
        def __getitem__(self, i):
            seen.append(int(i))
            return super().__getitem__(i)

    data = ctx.data
    data.dataset = lambda split, views: (Recording if "strong" in views.values() else FakeDataset)(
        data.images, data.labels, data.mask, views
    )
    tr = L.FedLSMTrainer(ctx, n_mix=0, n_uncertain=0, n_confident=0)
    orders = []
    for rnd in range(2):
        seen.clear()
        tr.train_round(rnd, 2, {})
        orders.append(list(seen))
    assert len(orders[0]) == len(orders[1]) == 20  # 2 steps x 10 samples, all from the pool
    assert orders[0] != orders[1]


# ------------------------------------------------------------------------------------------ behaviour


def test_uncertain_samples_get_pseudo_labels_with_the_lower_thresholds():
    """UDE (Eq. 6): confident samples are labelled with tau_p / tau_n (0.85 / 0.005), uncertain ones with the
    lower tau_lp / tau_ln (0.7 / 0.01); mixed labels lam y_l + (1 - lam) y_h where both sides have a label."""
    tr = L.FedLSMTrainer(_site("y", [True, False, False], n=4, C=3))
    label = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False]])
    conf = {"weak": torch.full((1, 1, 2, 2), 2.0), "label": label, "mask": mask}
    unc = {"weak": torch.zeros(1, 1, 2, 2), "label": torch.zeros(1, 3), "mask": mask}
    q = torch.tensor([[0.5, 0.75, 0.008]])  # the same teacher output on both sides
    x, y, known = tr.ude_batch(conf, unc, q, q, lam=0.25)
    # confident side: 0.75 < 0.85 and 0.008 > 0.005 -> classes 1, 2 unlabelled; uncertain side: 0.75 >= 0.7 -> 1,
    # 0.008 <= 0.01 -> 0; only class 0 (annotated on both) is known on both sides
    assert known.tolist() == [[True, False, False]]
    assert torch.allclose(x, torch.full_like(x, 0.5))  # 0.25 * 2 + 0.75 * 0
    assert y.tolist() == [[0.25, 0.75 * 1.0, 0.0]]  # class 0: 0.25 * 1 + 0.75 * 0; class 1: 0.25 * 0 + 0.75 * 1
    # the same sample on the confident side with a teacher above the pseudo-pool thresholds is known on both
    _, _, known = tr.ude_batch(conf, unc, torch.tensor([[0.5, 0.9, 0.001]]), q, lam=0.25)
    assert known.tolist() == [[True, True, True]]
    # single-label: tau_l = 0.85 for the uncertain row, tau = 0.95 for the confident one
    mc = L.FedLSMTrainer(_mc_site("x", [True, False, False]))
    zero = {"weak": torch.zeros(1, 1, 2, 2), "label": torch.zeros(1, 3), "mask": mask}
    p = torch.tensor([[0.05, 0.9, 0.05]])
    _, y, known = mc.ude_batch(zero, zero, torch.tensor([[0.02, 0.96, 0.02]]), p, lam=0.5)
    assert known.tolist() == [True] and y.tolist() == [[0.0, 1.0, 0.0]]  # 0.9 >= tau_l only for the uncertain row
    _, _, known = mc.ude_batch(zero, zero, p, p, lam=0.5)
    assert known.tolist() == [False]  # 0.9 < tau = 0.95 on the confident side


class _MarkedViews(FakeDataset):
    """Every view kind is a constant image (its marker), so a forward pass shows which view it saw."""

    MARK = {"eval": 0.0, "flip": 1.0, "weak": 2.0, "strong": 3.0}

    def __getitem__(self, i):
        item = super().__getitem__(i)
        item.update({k: torch.full_like(self.images[i], self.MARK[v]) for k, v in self.views.items()})
        return item


class _ViewData(FakeData):
    def dataset(self, split, views):
        return _MarkedViews(self.images, self.labels, self.mask, views)


class _Probe(PartialLabelNet):
    """Records (per-sample input mean, first parameter tensor) at every forward pass (a deepcopy records apart)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen: list = []

    def forward(self, x):
        self.seen.append((x.detach().mean((1, 2, 3)).clone(), next(self.parameters()).detach().clone()))
        return super().forward(x)


@pytest.mark.parametrize("weak_view,mark", [("flip", 1.0), ("weak", 2.0)])
def test_teacher_sees_the_weak_view_student_the_strong_one_and_the_ema_moves(weak_view, mark, monkeypatch):
    """The EMA teacher gets the weak view (horizontal flip by default), the student the strong view; the teacher
    starts as the received model and moves by EMA after every step of the round."""
    from fedpartial.methods.fedlsm import trainer as lsm_trainer

    torch.manual_seed(0)
    ctx = _site("s", [True, False, False], n=30, seed=1, model=_Probe("small_cnn", 3, 3, width=4))
    ctx.data = _ViewData(ctx.data.images, ctx.data.labels, ctx.data.mask)
    ctx.train = TrainOptions(lr=0.05, batch_size=10, local_steps=3, inference_batch_size=30)  # one uncertainty pass
    teachers = []
    real = lsm_trainer.frozen_copy

    def copy_of(model):
        teachers.append(real(model))
        teachers[-1].seen = []  # the copy's own record starts empty
        return teachers[-1]

    monkeypatch.setattr(lsm_trainer, "frozen_copy", copy_of)
    received = next(ctx.model.parameters()).detach().clone()
    tr = L.FedLSMTrainer(ctx, weak_view=weak_view, n_uncertain=0.2, n_confident=0.3, n_mix=2, ema=0.5)
    ctx.model.seen.clear()
    tr.train_round(0, 1, {})
    (teacher,) = teachers
    assert len(teacher.seen) == 3  # one teacher pass per step
    assert all(torch.all(x == mark) for x, _ in teacher.seen)  # weak views only
    student = [x for x, _ in ctx.model.seen[1:]]  # [0] is the uncertainty pass on the eval view
    assert torch.all(ctx.model.seen[0][0] == 0.0) and len(student) == 3
    for x in student:  # pseudo-pool rows: the strong view; the 2 mixed rows: mixes of two weak views
        assert torch.all(x[:-2] == 3.0) and torch.allclose(x[-2:], torch.full((2,), mark))
    w = [p for _, p in teacher.seen]
    assert torch.equal(w[0], received)  # the teacher starts as the received model
    assert not torch.equal(w[1], w[0]) and not torch.equal(w[2], w[1])  # and moves within the round


@pytest.mark.parametrize("mode", ["dataset", "seen"])
def test_estimated_class_counts_in_both_modes(mode):
    """q_c^k = labelled positives + pseudo positives, over all local images ("dataset", Eq. 7) or over the images
    of the batches trained this round ("seen", released code). tau_p = 0 makes every unannotated entry a
    positive pseudo label, so the counts are known by hand."""
    ctx = _site("s", [True, False, False], n=20, seed=5)
    ctx.train = TrainOptions(lr=1e-3, batch_size=8, local_steps=2)
    seen: list[int] = []
    data = ctx.data

    class Recording(FakeDataset):
        def __getitem__(self, i):
            seen.append(int(i))
            return super().__getitem__(i)

    data.dataset = lambda split, views: (Recording if "strong" in views.values() else FakeDataset)(
        data.images, data.labels, data.mask, views
    )
    tr = L.FedLSMTrainer(ctx, tau_p=0.0, tau_n=0.0, n_mix=0, n_uncertain=0, n_confident=0, q_counts=mode)
    q = np.asarray(tr.train_round(0, 1, {}).meta[L.META_Q])
    pos = data.labels[:, 0]
    if mode == "dataset":  # class 0: its labelled positives among the 20; classes 1, 2: all 20 images
        assert q.tolist() == [float(pos.sum()), 20.0, 20.0]
    else:  # 2 steps x 8 images seen: class 0 the labelled positives among them; classes 1, 2: 16
        assert len(seen) == 16
        assert q.tolist() == [float(pos[seen].sum()), 16.0, 16.0]


def test_entry_weighting_counts_every_zero_as_a_negative_and_ude_is_unweighted():
    """class_weighting 'entry' (released code, missing labels stored as 0): w_c = (sum_k n_k - pos_c) / pos_c;
    'positive' uses the annotated negatives. L_UDE carries no class weights by default (ude_weighting)."""
    ctx = _site("y", [True, False, False], n=4, C=3)
    ctx.summary = {
        "classes": ["c0", "c1", "c2"],
        "sites": {
            "a": {"n_train": 8, "positives": [2, 1, 0], "negatives": [6, 3, 0]},
            "b": {"n_train": 12, "positives": [0, 1, 4], "negatives": [0, 3, 8]},
        },
    }
    # annotated counts: class 0: 6 / 2 = 3; class 1: 6 / 2 = 3; class 2: 8 / 4 = 2
    assert L.FedLSMTrainer(ctx).class_weights(None, None).tolist() == [3.0, 3.0, 2.0]
    # every zero of the 20 images: class 0: (20 - 2) / 2 = 9; class 1: (20 - 2) / 2 = 9; class 2: (20 - 4) / 4 = 4
    code = L.FedLSMTrainer(ctx, class_weighting="entry")
    assert code.class_weights(None, None).tolist() == [9.0, 9.0, 4.0]
    # without a summary: the site's own table, missing entries as zeros: 4 rows, class 0 labels [1, 0, 0, 0]
    ctx.summary = None
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False]] * 4)
    assert code.class_weights(labels, mask).tolist() == [3.0, 1.0, 1.0]  # 3 / 1; no positive -> 1
    # UDE: logits 0 -> ln 2 per known entry, / 2 rows; class weights [3, 1] would make it (3 + 1) ln2 / 2
    logits, t = torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    known = torch.tensor([[True, True], [False, False]])
    w = torch.tensor([3.0, 1.0])
    assert L.FedLSMTrainer(ctx).ude_loss(logits, t, known, w).item() == pytest.approx(LN2, abs=1e-6)
    weighted = L.FedLSMTrainer(ctx, ude_weighting="class").ude_loss(logits, t, known, w)
    assert weighted.item() == pytest.approx(2 * LN2, abs=1e-6)


# ------------------------------------------------------------------------------------------ work per step


def test_ema_update_is_the_per_tensor_update_bit_for_bit():
    """The EMA runs over lists of tensors (``torch._foreach_*``): the numbers of ``t.mul_(decay).add_(s, alpha=1 -
    decay)`` tensor by tensor, parameters and BatchNorm statistics; the step counter copied."""
    import copy

    torch.manual_seed(0)
    student = PartialLabelNet("small_cnn", 3, 3, width=4)
    teacher = copy.deepcopy(student)
    with torch.no_grad():
        for t in student.state_dict().values():
            t.add_(torch.randn_like(t.float()).to(t.dtype)) if t.is_floating_point() else t.fill_(5)
    expected = {k: v.clone() for k, v in teacher.state_dict().items()}
    for k, s in student.state_dict().items():
        if s.is_floating_point():
            expected[k].mul_(0.999).add_(s, alpha=1.0 - 0.999)
        else:
            expected[k].copy_(s)
    L.ema_update(teacher, student, 0.999)
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in expected.items())
    assert int(teacher.state_dict()["encoder.body.1.num_batches_tracked"]) == 5


def test_teacher_runs_only_on_the_rows_whose_targets_read_it():
    """A labelled single-label row keeps its label (Eq. 4) and an annotated multi-label entry its label (Eq. 5):
    the teacher's output is read on the unlabelled rows (single-label) or the rows with an unannotated entry
    (multi-label) only. The teacher (eval mode) runs on those rows only (none: no pass; a lone row with a second
    one), and gives them the probabilities of a pass over the whole batch; the other rows hold zeros."""
    from fedpartial.methods.common import frozen_copy

    mc = L.FedLSMTrainer(_mc_site("x", [True, False, False]))
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False]] * 4)
    assert mc.teacher_rows(labels, mask).tolist() == [False, True, True, False]
    ml = L.FedLSMTrainer(_site("y", [True, False, False], n=4))
    assert ml.teacher_rows(labels, mask).tolist() == [True] * 4
    assert ml.teacher_rows(labels, torch.ones(4, 3, dtype=torch.bool)).tolist() == [False] * 4  # all annotated

    torch.manual_seed(1)
    teacher = frozen_copy(PartialLabelNet("small_cnn", 3, 3, width=4))
    with torch.no_grad():
        for m in teacher.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    batches: list[int] = []
    teacher.register_forward_pre_hook(lambda _m, args: batches.append(len(args[0])))
    x = torch.randn(6, 3, 16, 16)
    with torch.no_grad():
        whole = torch.softmax(teacher(x), 1)
    batches.clear()
    for read, passed in (([0, 2, 5], 3), ([4], 2), ([], None), ([0, 1, 2, 3, 4, 5], 6)):
        rows = torch.zeros(6, dtype=torch.bool)
        rows[read] = True
        with torch.no_grad():
            tp = mc.teacher_probs(teacher, x, rows)
        assert tp.shape == (6, 3) and tp.dtype == torch.float32
        assert torch.allclose(tp[rows], whole[rows], rtol=0.0, atol=1e-6)
        assert torch.all(tp[~rows] == 0)
        assert batches == ([] if passed is None else [passed])
        batches.clear()
    # a data layer whose fetcher makes every view: the trainer's fetcher leaves out the views not asked for
    fetch = mc.fetcher({"weak": "flip", "strong": "strong"}, 3)
    assert set(fetch([0, 1], keys=("weak",))) == {"weak", "label", "mask", "index"}
    assert set(fetch([0, 1])) == {"weak", "strong", "label", "mask", "index"}
