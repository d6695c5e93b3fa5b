"""FedMLP (fedpartial.methods.fedmlp): every equation against hand-computed values on tiny tensors, the server
rule, the parity switch, and a 3-round end-to-end run of two fake sites."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_sites import fake_site

from fedpartial.methods import Contribution, get_method
from fedpartial.methods import fedmlp as M
from fedpartial.models import PartialLabelNet

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------ Eq. 3


def test_logit_adjust_matches_eq3():
    # logits l = [0, ln 3]  ->  y = sigmoid(l) = [0.5, 0.75]
    # pi1 = [0.25, 0.5], pi0 = [0.75, 0.5]
    # Eq. 3, class 0: 0.5*0.25 / (0.5*0.25 + 0.5*0.75) = 0.125 / 0.5 = 0.25
    # Eq. 3, class 1: pi1 = pi0 -> unchanged 0.75
    logits = torch.tensor([[0.0, math.log(3.0)]])
    pi1, pi0 = torch.tensor([0.25, 0.5]), torch.tensor([0.75, 0.5])
    adj = M.logit_adjust(logits, pi1, pi0)
    assert torch.allclose(torch.sigmoid(adj), torch.tensor([[0.25, 0.75]]), atol=1e-6)
    # as a logit: 0 + ln(0.25/0.75) = -ln 3
    assert adj[0, 0].item() == pytest.approx(-math.log(3.0), abs=1e-6)
    # pi0 defaults to 1 - pi1
    assert torch.allclose(M.logit_adjust(logits, pi1), adj)
    # temperature 2: l' = 0 + 2 ln(1/3) -> sigmoid = 1/(1+9) = 0.1
    # (= Eq. 3 with pi^2: 0.5*0.0625 / (0.5*0.0625 + 0.5*0.5625) = 0.0625/0.625 = 0.1)
    assert torch.sigmoid(M.logit_adjust(logits, pi1, pi0, tau=2.0))[0, 0].item() == pytest.approx(0.1, abs=1e-6)
    # tau = 0 disables the adjustment
    assert torch.equal(M.logit_adjust(logits, pi1, pi0, tau=0.0), logits)


def test_class_rates_and_summary_rates():
    # class 0: labelled entries [1, 0, 0, 1] -> pi1 = 2/4 = 0.5
    # class 1: labelled entries [1, 0, 0, -] -> pi1 = 1/3
    # class 2: nothing labelled -> 0.5 (no adjustment)
    labels = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    pi1, pi0 = M.class_rates(labels, mask)
    assert torch.allclose(pi1, torch.tensor([0.5, 1 / 3, 0.5]), atol=1e-6)
    assert torch.allclose(pi0, 1 - pi1)
    # global: class 0: (3 + 1) / (3 + 1 + 5 + 7) = 4/16 = 0.25; class 1: 2 / (2 + 6) = 0.25; class 2: none -> 0.5
    summary = {
        "classes": ["a", "b", "c"],
        "sites": {
            "s1": {"n_train": 8, "annotated": [True, True, False], "positives": [3, 2, 0], "negatives": [5, 6, 0]},
            "s2": {"n_train": 8, "annotated": [True, False, False], "positives": [1, 0, 0], "negatives": [7, 0, 0]},
        },
    }
    g1, _ = M.summary_rates(summary, 3)
    assert torch.allclose(g1, torch.tensor([0.25, 0.25, 0.5]), atol=1e-6)


# ------------------------------------------------------------------------------------------------ Eq. 4


def test_wpc_loss_hand_values():
    # C = 2, B = 2, logits 0 -> p = 0.5, BCE = ln 2 per entry.
    logits = torch.zeros(2, 2)
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mask = torch.tensor([[True, False], [True, True]])
    # no adjustment: sample 1: ln2 / C = ln2/2; sample 2: 2 ln2 / 2 = ln2 -> mean = 0.75 ln 2
    assert M.wpc_loss(logits, labels, mask).item() == pytest.approx(0.75 * LN2, abs=1e-6)
    # the released code's balance: mean over the 3 labelled entries = ln 2
    assert M.wpc_loss(logits, labels, mask, reduction="entries").item() == pytest.approx(LN2, abs=1e-6)
    with pytest.raises(ValueError):
        M.wpc_loss(logits, labels, mask, reduction="samples")
    # with Eq. 3, pi1 = [0.25, 0.5]: class 0 adjusted prob = 0.25, class 1 stays 0.5
    # sample 1: y=1 on class 0 -> -ln 0.25 = ln 4                       -> ln4 / 2
    # sample 2: y=0 on class 0 -> -ln 0.75 = ln(4/3); y=1 class 1 -> ln 2 -> (ln(4/3) + ln 2) / 2
    # mean = (ln 4 + ln(4/3) + ln 2) / 4 = ln(32/3) / 4
    pi1 = torch.tensor([0.25, 0.5])
    assert M.wpc_loss(logits, labels, mask, pi1, 1 - pi1).item() == pytest.approx(math.log(32 / 3) / 4, abs=1e-6)
    # gradient flows only through labelled entries
    lg = torch.zeros(2, 2, requires_grad=True)
    M.wpc_loss(lg, labels, mask).backward()
    assert lg.grad[0, 1].item() == 0.0 and lg.grad[0, 0].item() != 0.0


def test_consistency_loss_only_on_mask():
    # entries (0,1): (0.9-0.5)^2 = 0.16 and (1,1): (0.2-0.4)^2 = 0.04 -> mean 0.10; (0,0), (1,0) ignored
    p_local = torch.tensor([[0.1, 0.9], [0.7, 0.2]])
    p_global = torch.tensor([[0.8, 0.5], [0.0, 0.4]])
    mask = torch.tensor([[False, True], [False, True]])
    assert M.consistency_loss(p_local, p_global, mask).item() == pytest.approx(0.10, abs=1e-6)
    assert M.consistency_loss(p_local, p_global, torch.zeros(2, 2, dtype=torch.bool)).item() == 0.0


# ------------------------------------------------------------------------------------------------ Eq. 5


def test_class_prototypes_hand_values():
    # f0 = [1,0], f1 = [3,0], f2 = [0,2], f3 = [0,4]
    feats = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    # class 1: entry of f3 not annotated; class 2: missing at this site (no entry)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    p0, p1, counts = M.class_prototypes(feats, labels, mask)
    # class 0: P1 = mean(f0, f1) = [2, 0]; P0 = mean(f2, f3) = [0, 3]
    # class 1: P1 = mean(f1, f2) = [1.5, 1]; P0 = f0 = [1, 0] (f3 unannotated)
    # class 2: no sample -> zero rows, counts 0
    assert torch.allclose(p1, torch.tensor([[2.0, 0.0], [1.5, 1.0], [0.0, 0.0]]))
    assert torch.allclose(p0, torch.tensor([[0.0, 3.0], [1.0, 0.0], [0.0, 0.0]]))
    assert counts.tolist() == [[2, 2], [1, 2], [0, 0]]


# ------------------------------------------------------------------------------------------------ Eq. 6


def _three_sites():
    # site A annotates {0, 1}; B annotates {0} (its class-1 rows are garbage and must be ignored);
    # C annotates {1} (its class-0 rows are garbage) and has no positive of class 1 (count 0).
    p0 = torch.tensor(
        [
            [[0.0, 0.0], [2.0, 2.0]],  # A
            [[2.0, 0.0], [100.0, 100.0]],  # B
            [[50.0, 50.0], [4.0, 0.0]],
        ]
    )  # C
    p1 = torch.tensor([[[4.0, 0.0], [0.0, 4.0]], [[0.0, 2.0], [100.0, 100.0]], [[50.0, 50.0], [9.0, 9.0]]])
    counts = torch.tensor([[[5, 5], [5, 5]], [[5, 5], [7, 7]], [[3, 3], [6, 0]]])
    annotated = torch.tensor([[True, True], [True, False], [False, True]])
    n = torch.tensor([100.0, 300.0, 600.0])
    return p0, p1, counts, annotated, n


def test_aggregate_prototypes_over_annotating_sites():
    p0, p1, counts, annotated, n = _three_sites()
    g0, g1, valid = M.aggregate_prototypes(p0, p1, counts, annotated)
    # uniform (Eq. 6): class 0 over {A, B}: P0 = ([0,0] + [2,0]) / 2 = [1, 0]; P1 = ([4,0] + [0,2]) / 2 = [2, 1]
    #                  class 1 over {A, C}: P0 = ([2,2] + [4,0]) / 2 = [3, 1]; P1 = A only (C has count 0) = [0, 4]
    assert torch.allclose(g0, torch.tensor([[1.0, 0.0], [3.0, 1.0]]))
    assert torch.allclose(g1, torch.tensor([[2.0, 1.0], [0.0, 4.0]]))
    assert valid.all()
    # n_k weights (released code): class 0: P0 = (100*[0,0] + 300*[2,0]) / 400 = [1.5, 0]
    #                                       P1 = (100*[4,0] + 300*[0,2]) / 400 = [1, 1.5]
    #                              class 1: P0 = (100*[2,2] + 600*[4,0]) / 700 = [26/7, 2/7]; P1 = [0, 4]
    g0, g1, _ = M.aggregate_prototypes(p0, p1, counts, annotated, n)
    assert torch.allclose(g0, torch.tensor([[1.5, 0.0], [26 / 7, 2 / 7]]), atol=1e-6)
    assert torch.allclose(g1, torch.tensor([[1.0, 1.5], [0.0, 4.0]]), atol=1e-6)
    # a class nobody annotates: zero rows, not valid
    g0, g1, valid = M.aggregate_prototypes(p0, p1, counts, torch.tensor([[True, False]] * 3))
    assert valid.tolist() == [[True, True], [False, False]] and torch.equal(g0[1], torch.zeros(2))


# ------------------------------------------------------------------------------------------------ Eq. 7


def test_prototype_scores_hand_values():
    feats = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0], [3.0, 4.0]])
    # class 0: P0 = [1,0], P1 = [0,1]
    #   f=[1,0]: 1 - 0 = 1; f=[1,1]: 1/sqrt2 - 1/sqrt2 = 0; f=[0,2]: 0 - 1 = -1; f=[3,4]: 3/5 - 4/5 = -0.2
    # class 1: P0 = [0,5], P1 = [5,0] (cosine ignores the scale): the negatives of class 0's scores
    p0 = torch.tensor([[1.0, 0.0], [0.0, 5.0]])
    p1 = torch.tensor([[0.0, 1.0], [5.0, 0.0]])
    z = M.prototype_scores(feats, p0, p1)
    expected = torch.tensor([[1.0, -1.0], [0.0, 0.0], [-1.0, 1.0], [-0.2, 0.2]])
    assert torch.allclose(z, expected, atol=1e-6)


# ------------------------------------------------------------------------------------------------ Eq. 8-9


def test_select_pseudo_labels_residual_pool_and_accumulation():
    # Reading of Eq. 8-9 + "In later rounds, Z only includes residual samples": every round the shares tau0 /
    # tau1 are taken of the not-yet-tagged negative (Z >= 0) / positive (Z < 0) candidates, rounded down.
    z = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, -0.1, -0.2, -0.3, -0.4, 0.0])
    tags = torch.full((10, 1), -1, dtype=torch.int8)
    tags[0, 0] = 0  # tagged in an earlier round: never re-selected, never revised
    # round 1: negative candidates (untagged, Z >= 0) = {1, 2, 3, 4, 9} (5) -> floor(0.4*5) = 2 -> largest Z: 1, 2
    #          positive candidates (Z < 0)          = {5, 6, 7, 8} (4)    -> floor(0.5*4) = 2 -> smallest Z: 8, 7
    neg, pos = M.select_pseudo_labels(z[:, None], tags >= 0, 0.4, 0.5)
    assert torch.nonzero(neg[:, 0]).flatten().tolist() == [1, 2]
    assert torch.nonzero(pos[:, 0]).flatten().tolist() == [7, 8]
    tags = M.accumulate_pseudo_labels(tags, neg, pos)
    assert tags[:, 0].tolist() == [0, 0, 0, -1, -1, -1, -1, 1, 1, -1]
    # round 2 (same scores): residual negatives {3, 4, 9} -> floor(0.4*3) = 1 -> 3
    #                        residual positives {5, 6}    -> floor(0.5*2) = 1 -> 6 (Z = -0.2 < -0.1)
    # (a share of the whole pool would give floor(0.4*6) = 2 negatives here: the residual reading differs)
    neg, pos = M.select_pseudo_labels(z[:, None], tags >= 0, 0.4, 0.5)
    assert torch.nonzero(neg[:, 0]).flatten().tolist() == [3]
    assert torch.nonzero(pos[:, 0]).flatten().tolist() == [6]
    tags = M.accumulate_pseudo_labels(tags, neg, pos)
    assert tags[:, 0].tolist() == [0, 0, 0, 0, -1, -1, 1, 1, 1, -1]
    # 1-D scores and per-class shares; a zero share selects nothing; accumulate never overwrites
    # 1-D scores: 6 candidates with Z >= 0 = {0,1,2,3,4,9} -> floor(0.2*6) = floor(1.2) = 1 -> index 0;
    # a zero positive share selects nothing
    n1, p1 = M.select_pseudo_labels(z, torch.zeros(10, dtype=torch.bool), 0.2, 0.0)
    assert torch.nonzero(n1).flatten().tolist() == [0] and not p1.any()


def test_select_pseudo_labels_floor_and_per_class_shares():
    z = torch.tensor([[0.9, -0.9], [0.8, -0.8], [0.7, 0.7], [0.6, 0.6], [0.5, 0.5], [-0.1, -0.1]])
    none = torch.zeros(6, 2, dtype=torch.bool)
    # class 0: 5 negative candidates, share 0.2 -> floor(1.0) = 1 -> index 0; 1 positive candidate, share 0.5 -> 0
    # class 1: 3 negative candidates {2,3,4}, share 0.5 -> floor(1.5) = 1 -> index 2;
    #          3 positive candidates {0,1,5}, share 1.0 -> all three
    neg, pos = M.select_pseudo_labels(z, none, torch.tensor([0.2, 0.5]), torch.tensor([0.5, 1.0]))
    assert neg.tolist() == [
        [True, False],
        [False, False],
        [False, True],
        [False, False],
        [False, False],
        [False, False],
    ]
    assert pos.tolist() == [[False, True], [False, True], [False, False], [False, False], [False, False], [False, True]]
    tags = torch.full((6, 2), -1, dtype=torch.int8)
    tags[0, 1] = 0
    out = M.accumulate_pseudo_labels(tags, neg, pos)
    assert out[0, 1].item() == 0  # the earlier tag stays even though pos selects it


# ------------------------------------------------------------------------------------------------ Eq. 10


def test_learning_degree_hand_values():
    # L = 0.3, R = 0.7 (strict): col 0 [0.1 y, 0.3 n, 0.5 n, 0.7 n, 0.9 y] -> 2/5 = 0.4
    #                            col 1 [0.29 y, 0.71 y, 0.2 y, 0.8 y, 0.31 n] -> 4/5 = 0.8
    probs = torch.tensor([[0.1, 0.29], [0.3, 0.71], [0.5, 0.2], [0.7, 0.8], [0.9, 0.31]])
    assert torch.allclose(M.learning_degree(probs, 0.3, 0.7), torch.tensor([0.4, 0.8]))


def test_aggregate_learning_degree_over_missing_sites_with_fallback():
    # missing: A misses {0}, B misses {0, 1}, C misses nothing (its degrees must not count); class 2 missed nowhere
    degrees = torch.tensor([[0.2, 0.9, 0.3], [0.6, 0.4, 0.3], [0.99, 0.99, 0.99]])
    missing = torch.tensor([[True, False, False], [True, True, False], [False, False, False]])
    n = torch.tensor([100.0, 300.0, 1000.0])
    d = M.aggregate_learning_degree(degrees, n, missing)
    # class 0: (100*0.2 + 300*0.6) / 400 = 200/400 = 0.5; class 1: B only = 0.4; class 2: fallback 1
    assert torch.allclose(d, torch.tensor([0.5, 0.4, 1.0], dtype=torch.float64))


def test_selection_ratios_self_adaptive_and_fixed():
    d = torch.tensor([0.5, 1.0])
    t0, t1 = M.selection_ratios(d, 0.005, 0.01)
    # tau0 = d * T0 = [0.0025, 0.005]; tau1 = d * T1 = [0.005, 0.01]
    assert torch.allclose(t0, torch.tensor([0.0025, 0.005], dtype=torch.float64))
    assert torch.allclose(t1, torch.tensor([0.005, 0.01], dtype=torch.float64))
    t0, t1 = M.selection_ratios(d, 0.005, 0.01, adaptive=False)
    assert t0.tolist() == [0.005, 0.005] and t1.tolist() == [0.01, 0.01]


# ------------------------------------------------------------------------------------------------ server rule


def _contribution(site, w, n, annotated, p0, p1, counts, degree):
    meta = {
        "annotated": list(annotated),
        M.META_P0: np.asarray(p0, np.float32),
        M.META_P1: np.asarray(p1, np.float32),
        M.META_COUNTS: np.asarray(counts, np.int64),
        M.META_DEGREE: np.asarray(degree, np.float64),
    }
    return Contribution(site=site, weights={"w": np.asarray(w, np.float32)}, n=n, meta=meta)


def test_rule_prototypes_degree_and_previous_kept():
    p0, p1, counts, annotated, n = _three_sites()
    # degrees: A misses nothing (its values 0.0 must not count); B misses class 1 (0.4); C misses class 0 (0.7)
    deg = [[0.0, 0.0], [0.9, 0.4], [0.7, 0.9]]
    cons = [
        _contribution(s, [i + 1.0], float(n[i]), annotated[i].tolist(), p0[i], p1[i], counts[i], deg[i])
        for i, s in enumerate("ABC")
    ]
    rule = M.FedMLPRule()
    weights, meta = rule.aggregate(None, cons, {}, 0)
    # FedAvg: (100*1 + 300*2 + 600*3) / 1000 = 2.5
    assert weights["w"][0] == pytest.approx(2.5)
    assert np.allclose(meta[M.META_GLOBAL_P0], [[1.0, 0.0], [3.0, 1.0]])
    assert np.allclose(meta[M.META_GLOBAL_P1], [[2.0, 1.0], [0.0, 4.0]])
    assert meta[M.META_GLOBAL_VALID] == [[True, True], [True, True]]
    # d_0^G = C only (0.7); d_1^G = B only (0.4)
    assert meta[M.META_GLOBAL_DEGREE] == pytest.approx([0.7, 0.4])
    # round 1: only B contributes (annotates class 0 only, new class-0 prototypes, misses class 1 with 0.2)
    b = _contribution(
        "B",
        [5.0],
        300.0,
        [True, False],
        [[6.0, 0.0], [0.0, 0.0]],
        [[0.0, 6.0], [0.0, 0.0]],
        [[4, 4], [0, 0]],
        [0.3, 0.2],
    )
    _, meta = rule.aggregate(None, [b], {}, 1)
    assert np.allclose(meta[M.META_GLOBAL_P0], [[6.0, 0.0], [3.0, 1.0]])  # class 1 kept from round 0
    assert np.allclose(meta[M.META_GLOBAL_P1], [[0.0, 6.0], [0.0, 4.0]])
    # class 0 is missed by no contributor this round: previous 0.7 kept; class 1: B's 0.2
    assert meta[M.META_GLOBAL_DEGREE] == pytest.approx([0.7, 0.2])
    # before any prototype was sent (warm-up), the rule sends no meta
    assert (
        M.FedMLPRule().aggregate(None, [Contribution("A", {"w": np.ones(1)}, 1.0, {"annotated": [True]})], {}, 0)[1]
        == {}
    )


def test_rule_meta_serialisable_by_nvflare():
    fobs = pytest.importorskip("nvflare.fuel.utils.fobs")
    from nvflare.app_common.decomposers import common_decomposers

    common_decomposers.register()
    p0, p1, counts, annotated, n = _three_sites()
    cons = [
        _contribution(s, [1.0], float(n[i]), annotated[i].tolist(), p0[i], p1[i], counts[i], [0.5, 0.5])
        for i, s in enumerate("ABC")
    ]
    _, meta = M.FedMLPRule().aggregate(None, cons, {}, 0)
    back = fobs.loads(fobs.dumps(meta))
    assert np.allclose(back[M.META_GLOBAL_P0], meta[M.META_GLOBAL_P0])
    assert back[M.META_GLOBAL_VALID] == meta[M.META_GLOBAL_VALID]


# ------------------------------------------------------------------------------------------------ fake site


def _site(name, annotated, n=24, C=3, seed=0, tmp: Path | None = None, model=None):
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, C, generator=g) < 0.5).float()
    images = torch.randn(n, 3, 16, 16, generator=g) * 0.3
    for c in range(min(C, 3)):  # some class signal: class c brightens channel c
        images[:, c] += labels[:, c : c + 1, None]
    annotated = np.asarray(annotated, bool)
    mask = torch.as_tensor(annotated)[None, :].expand(n, C).clone()
    labels = labels * mask  # missing entries stored as 0
    model = model or PartialLabelNet("small_cnn", C, 3, width=4)
    train = {"lr": 1e-3, "batch_size": 8, "local_epochs": 1}
    return fake_site(name, "multilabel", annotated, images, labels, mask, model, train, seed, tmp)


def _tiny_ctx(annotated=(True, False)):
    return _site("x", annotated, n=4, C=len(annotated))


# ------------------------------------------------------------------------------------------------ parity switch


def test_parity_switch_loss_cr_and_threshold():
    logits = torch.zeros(2, 2)
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    lab = torch.tensor([[True, False], [True, True]])
    pi1 = torch.tensor([0.25, 0.5])
    paper = M.FedMLPTrainer(_tiny_ctx())  # the default balance: Eq. 4
    code = M.FedMLPTrainer(_tiny_ctx(), parity="code")
    # paper: WPC + Eq. 3 = ln(32/3)/4 (see test_wpc_loss_hand_values)
    assert paper.supervised_loss(logits, labels, lab, pi1, 1 - pi1).item() == pytest.approx(
        math.log(32 / 3) / 4, abs=1e-6
    )
    # code: plain BCE averaged over the 3 labelled entries, no adjustment: 3 ln2 / 3 = ln 2
    assert code.supervised_loss(logits, labels, lab, pi1, 1 - pi1).item() == pytest.approx(LN2, abs=1e-6)
    # wpc off (Table 3 FedAvg term): Eq. 1 over all 4 entries, missing as 0: logits 0 -> ln 2 each -> ln 2;
    # with logits [[0, 2], ...] the unlabelled (0,1) entry counts as a negative: softplus(2) enters the mean
    nowpc = M.FedMLPTrainer(_tiny_ctx(), wpc=False)
    lg = torch.tensor([[0.0, 2.0], [0.0, 0.0]])
    expected = (3 * LN2 + math.log1p(math.exp(2.0))) / 4
    assert nowpc.supervised_loss(lg, labels, lab, pi1, 1 - pi1).item() == pytest.approx(expected, abs=1e-6)
    # wpc off is honoured under parity code too (it was ignored there): the same Eq. 1 value
    code_nowpc = M.FedMLPTrainer(_tiny_ctx(), parity="code", wpc=False)
    assert code_nowpc.supervised_loss(lg, labels, lab, pi1, 1 - pi1).item() == pytest.approx(expected, abs=1e-6)
    # the released code's balance: the same terms as Eq. 4 averaged over the 3 labelled entries, not / C per sample
    per_term = M.FedMLPTrainer(_tiny_ctx(), loss_balance="per_term")
    assert per_term.supervised_loss(logits, labels, lab, pi1, 1 - pi1).item() == pytest.approx(
        math.log(32 / 3) / 3, abs=1e-6
    )
    # consistency: the paper only in stage 2 (Sec. 2.2: stage 1 is L_WPC alone), the code only in the warm-up;
    # cr_warmup=True / False overrides the stage-1 choice
    assert not paper.use_cr(False) and paper.use_cr(True)
    assert code.use_cr(False) and not code.use_cr(True)
    assert M.FedMLPTrainer(_tiny_ctx(), cr_warmup=True).use_cr(False)
    assert not M.FedMLPTrainer(_tiny_ctx(), parity="code", cr_warmup=False).use_cr(False)
    assert not M.FedMLPTrainer(_tiny_ctx(), cr=False).use_cr(True)
    # self-adaptive threshold: paper yes, code / st=False fixed fractions
    assert paper.adaptive and not code.adaptive and not M.FedMLPTrainer(_tiny_ctx(), st=False).adaptive
    assert paper.feature_view == "eval" and code.feature_view == "weak"
    # server: paper = uniform Eq. 6, code = n_k weights
    assert M.FedMLPRule().proto_weighting == "uniform"
    assert M.FedMLPRule(parity="code").proto_weighting == "samples"
    with pytest.raises(ValueError):
        M.FedMLPTrainer(_tiny_ctx(), parity="nope")


def test_registered_and_multilabel_only():
    method = get_method("fedmlp")
    assert method.trainer is M.FedMLPTrainer and method.rule is M.FedMLPRule
    ctx = _tiny_ctx()
    ctx.task = "multiclass"
    with pytest.raises(ValueError):
        M.FedMLPTrainer(ctx)


def test_global_rates_from_summary():
    ctx = _tiny_ctx()
    ctx.summary = {
        "classes": ["c0", "c1"],
        "sites": {
            "a": {"n_train": 4, "annotated": [True, False], "positives": [1, 0], "negatives": [3, 0]},
            "b": {"n_train": 4, "annotated": [False, True], "positives": [0, 3], "negatives": [0, 1]},
        },
    }
    t = M.FedMLPTrainer(ctx, global_rates=True)
    pi1, _ = t.rates(torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.bool))
    # class 0: 1/4; class 1: 3/4
    assert torch.allclose(pi1, torch.tensor([0.25, 0.75]))


# ------------------------------------------------------------------------------------------------ end to end


def test_end_to_end_three_rounds(tmp_path):
    torch.manual_seed(0)
    opts = dict(warmup_rounds=1, T0=0.5, T1=0.5, L=0.5, R=0.5)  # L = R = 0.5: d ~ 1, so tau ~ 0.5 on 24 samples
    ctxs = [
        _site("site-1", [True, True, False], seed=1, tmp=tmp_path),
        _site("site-2", [False, True, True], seed=2, tmp=tmp_path),
    ]
    trainers = [M.FedMLPTrainer(c, **opts) for c in ctxs]
    rule = M.FedMLPRule()
    global_w = {k: v.detach().clone() for k, v in ctxs[0].model.state_dict().items()}
    meta: dict = {}
    tags_after: dict[int, torch.Tensor] = {}
    for rnd in range(3):
        if rnd == 2:  # a fresh process takes over site-1: state saved / restored through a file
            path = tmp_path / "trainer_state.pt"
            torch.save(trainers[0].state_dict(), path)
            ctxs[0] = _site("site-1", [True, True, False], seed=1, tmp=tmp_path)
            trainers[0] = M.FedMLPTrainer(ctxs[0], **opts)
            trainers[0].load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
            assert torch.equal(trainers[0].pseudo_labels, tags_after[1])
        cons = []
        for ctx, tr in zip(ctxs, trainers):
            ctx.model.load_state_dict(global_w)
            out = tr.train_round(rnd, 3, meta)
            assert out.steps == 3 and math.isfinite(out.loss)
            cons.append(
                Contribution(
                    ctx.site,
                    {k: v.detach().numpy().copy() for k, v in ctx.model.state_dict().items()},
                    24.0,
                    {**out.meta, "annotated": ctx.annotated.tolist()},
                )
            )
            if rnd == 0:  # end of the warm-up: prototypes and degrees in the meta
                assert out.meta[M.META_P0].shape == (3, 32) and out.meta[M.META_P1].shape == (3, 32)
                assert out.meta[M.META_COUNTS].shape == (3, 2) and out.meta[M.META_DEGREE].shape == (3,)
                missing = ~ctx.annotated
                assert (out.meta[M.META_COUNTS][missing] == 0).all()  # no prototype of a missing class
                assert out.meta["fedmlp_stage"] == 1 and int((tr.pseudo_labels >= 0).sum()) == 0
            else:
                assert out.meta["fedmlp_stage"] == 2
        weights, meta = rule.aggregate(None, cons, {}, rnd)
        global_w = {k: torch.as_tensor(v) for k, v in weights.items()}
        assert M.META_GLOBAL_P0 in meta and len(meta[M.META_GLOBAL_DEGREE]) == 3
        if rnd == 0:
            # class 0 only from site-1, class 2 only from site-2
            assert np.allclose(meta[M.META_GLOBAL_P0][0], cons[0].meta[M.META_P0][0])
            assert np.allclose(meta[M.META_GLOBAL_P1][2], cons[1].meta[M.META_P1][2])
        tags_after[rnd] = trainers[0].pseudo_labels.clone()
    for tr, ctx in zip(trainers, ctxs):
        tags = tr.pseudo_labels
        # pseudo labels only on the missing class, some were made in stage 2
        assert int((tags[:, torch.as_tensor(ctx.annotated)] >= 0).sum()) == 0
        assert int((tags >= 0).sum()) > 0
    # permanence: every tag of round 1 survives (same value) after the restart and round 2
    before, after = tags_after[1], tags_after[2]
    assert int((before >= 0).sum()) > 0
    assert torch.equal(after[before >= 0], before[before >= 0])
    assert int((after >= 0).sum()) >= int((before >= 0).sum())


def test_training_loader_drops_a_trailing_single_image_batch():
    """33 images in batches of 8: BatchNorm cannot train on the last batch of 1, so it is dropped; the
    evaluation-order loader (features, prototypes) keeps every image."""
    from fedpartial.methods.baselines import SupervisedTrainer

    ctx = _site("s", (True, True, True), n=33)
    trainer = SupervisedTrainer(ctx)
    assert [len(b["index"]) for b in trainer.loader({"image": "weak"})] == [8, 8, 8, 8]
    assert sum(len(b["index"]) for b in trainer.loader({"image": "eval"}, shuffle=False)) == 33
    out = trainer.train_round(0, 1, {})  # would raise "Expected more than 1 value per channel" otherwise
    assert out.steps == 4
    ctx = _site("s", (True, True, True), n=34)
    assert [len(b["index"]) for b in SupervisedTrainer(ctx).loader({"image": "weak"})] == [8, 8, 8, 8, 2]


# ------------------------------------------------------------------------------------------------ behaviour


def _tags_from(state: dict, ctx, p0, p1, degree, T0, T1, tags=None, adaptive=True) -> torch.Tensor:
    """The tags Eq. 7-9 give with the features of the model whose weights are ``state`` (eval view = the cached
    image of the fake site), computed outside the trainer from the tested pure functions: ``(N, C)`` int8."""
    model = PartialLabelNet("small_cnn", ctx.num_classes, 3, width=4)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        feats = model.features(ctx.data.images)
    n, C = feats.shape[0], ctx.num_classes
    tags = torch.full((n, C), -1, dtype=torch.int8) if tags is None else tags
    missing = ~torch.as_tensor(ctx.annotated)
    tau0, tau1 = M.selection_ratios(torch.as_tensor(degree, dtype=torch.float64), T0, T1, adaptive=adaptive)
    neg, pos = M.select_pseudo_labels(M.prototype_scores(feats, p0, p1), tags >= 0, tau0 * missing, tau1 * missing)
    return M.accumulate_pseudo_labels(tags, neg & missing, pos & missing)


def _global_meta(p0, p1, degree):
    C = p0.shape[0]
    return {
        M.META_GLOBAL_P0: p0.numpy(),
        M.META_GLOBAL_P1: p1.numpy(),
        M.META_GLOBAL_VALID: [[True, True]] * C,
        M.META_GLOBAL_DEGREE: list(degree),
    }


def test_stage2_tags_use_the_received_global_models_features():
    """Z (Eq. 7) is computed with the features of the RECEIVED global model: the trainer's tags equal the tags
    recomputed from the received weights, and differ from those of the model after local training."""
    torch.manual_seed(0)
    ctx = _site("s", [True, False, False], n=24, seed=3)
    ctx.train = {"lr": 0.05, "batch_size": 8, "local_epochs": 3}  # local training moves the features a lot
    received = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    p0, p1 = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    tr = M.FedMLPTrainer(ctx, warmup_rounds=0, T0=0.5, T1=0.5)
    out = tr.train_round(0, 1, _global_meta(p0, p1, [1.0, 1.0, 1.0]))
    expected = _tags_from(received, ctx, p0, p1, [1.0] * 3, 0.5, 0.5)
    assert int((expected >= 0).sum()) > 10 and out.meta["fedmlp_new_pseudo"] == int((expected >= 0).sum())
    assert torch.equal(tr.pseudo_labels, expected)
    trained = _tags_from(ctx.model.state_dict(), ctx, p0, p1, [1.0] * 3, 0.5, 0.5)
    assert not torch.equal(trained, expected)  # the locally trained model would tag other samples


def test_consistency_target_is_the_frozen_received_model_on_untagged_missing_entries(monkeypatch):
    """CR (Sec. 2.4): the target of every step is the received global model in eval mode (not the model being
    trained), and the mask holds only the missing entries without a pseudo label (annotated and tagged out)."""
    from fedpartial.methods.common import frozen_copy
    from fedpartial.methods.fedmlp import trainer as mlp_trainer

    torch.manual_seed(0)
    ctx = _site("s", [True, False, False], n=16, seed=4)
    ctx.train = {"lr": 0.05, "batch_size": 8, "local_epochs": 1}
    tr = M.FedMLPTrainer(ctx, warmup_rounds=0, mld=False)  # stage 2 (CR on in the paper), no new tags
    tr._ensure_pseudo_labels(16)
    tr.pseudo_labels[:6, 1] = 1  # pseudo labels of earlier rounds
    tr.pseudo_labels[3:10, 2] = 0
    received = frozen_copy(ctx.model)
    calls, batches = [], []
    real = mlp_trainer.consistency_loss
    monkeypatch.setattr(
        mlp_trainer,
        "consistency_loss",
        lambda pl, pg, m: calls.append((pg.detach().clone(), m.clone())) or real(pl, pg, m),
    )
    orig = tr.batches

    def recording(views, rnd):
        for b in orig(views, rnd):
            batches.append({k: v.clone() if torch.is_tensor(v) else v for k, v in b.items()})
            yield b

    tr.batches = recording
    tr.train_round(0, 1, {})
    assert len(batches) == 2 and len(calls) == 4  # two batches x two weak views
    seen_tagged = 0
    for i, (target, mask) in enumerate(calls):
        b, key = batches[i // 2], ("image", "image_2")[i % 2]
        with torch.no_grad():
            assert torch.allclose(target, torch.sigmoid(received(b[key])), atol=1e-5)
        tagged = tr.pseudo_labels[b["index"].long()] >= 0
        assert torch.equal(mask, ~(b["mask"].bool() | tagged))
        assert not mask[:, 0].any()  # the annotated class never
        seen_tagged += int(tagged.sum())
    assert seen_tagged > 0  # tagged entries were in the batches and left out


def test_learning_degree_scales_the_selection_end_to_end():
    """Two sites, warm-up of 1 round with L / R such that d_c^G is neither 0 nor 1: the server's d_c^G (Eq. 10)
    multiplies T0 / T1 in the next round, so each site's new tags are those of tau = d_c^G * T (not of T)."""
    torch.manual_seed(0)
    opts = dict(warmup_rounds=1, T0=0.9, T1=0.9, L=0.49, R=0.51)
    ctxs = [_site("site-1", [True, False, False], seed=1), _site("site-2", [False, True, True], seed=2)]
    trainers = [M.FedMLPTrainer(c, **opts) for c in ctxs]
    rule = M.FedMLPRule()
    global_w = {k: v.detach().clone() for k, v in ctxs[0].model.state_dict().items()}
    meta: dict = {}
    totals = [0, 0]  # tags with tau = T (no learning degree), tags made
    for rnd in range(2):
        cons = []
        for ctx, tr in zip(ctxs, trainers):
            ctx.model.load_state_dict(global_w)
            if rnd == 1:
                p0 = torch.as_tensor(np.asarray(meta[M.META_GLOBAL_P0]))
                p1 = torch.as_tensor(np.asarray(meta[M.META_GLOBAL_P1]))
                d = meta[M.META_GLOBAL_DEGREE]
                expected = _tags_from(global_w, ctx, p0, p1, d, 0.9, 0.9)
                fixed = _tags_from(global_w, ctx, p0, p1, d, 0.9, 0.9, adaptive=False)
            out = tr.train_round(rnd, 2, meta)
            if rnd == 1:
                assert torch.equal(tr.pseudo_labels, expected)
                assert out.meta["fedmlp_tau0"] == pytest.approx([0.9 * v * m for v, m in zip(d, ~ctx.annotated)])
                totals[0] += int((fixed >= 0).sum())
                totals[1] += int((expected >= 0).sum())
            cons.append(
                Contribution(
                    ctx.site,
                    {k: v.detach().numpy().copy() for k, v in ctx.model.state_dict().items()},
                    24.0,
                    {**out.meta, "annotated": ctx.annotated.tolist()},
                )
            )
        weights, meta = rule.aggregate(None, cons, {}, rnd)
        global_w = {k: torch.as_tensor(v) for k, v in weights.items()}
        if rnd == 0:
            d = np.asarray(meta[M.META_GLOBAL_DEGREE])
            # every class is missing at one site: d_c^G is that site's d_c^k (here [1, 1, 0.29]: one class below 1)
            assert ((d > 0.05) & (d < 0.95)).any(), d
            assert d[0] == pytest.approx(cons[1].meta[M.META_DEGREE][0]) and d[1] == pytest.approx(
                cons[0].meta[M.META_DEGREE][1]
            )
    assert totals[0] > totals[1] > 0  # tau = T would have tagged more


def test_missing_class_rates_follow_prevalence_not_the_tag_ratio():
    """Eq. 3's pi for a class the site does not annotate is its prevalence (data summary, else positive tags
    over the site's samples), not positives / tags: with only negative tags the tag ratio is 0, pi clamps to
    1e-4 and the adjusted logit shifts by ln(1e-4 / (1 - 1e-4)) ~ -9.2, so negative pseudo labels get no gradient."""
    ctx = _site("x", [True, False], n=10, C=2)
    labels = torch.zeros(10, 2)
    labels[:3, 0] = 1.0  # class 0 annotated: 3 positives of 10
    mask = torch.zeros(10, 2, dtype=torch.bool)
    mask[:, 0] = True
    mask[:4, 1] = True  # class 1 missing here: 4 negative tags, no positive tag
    tr = M.FedMLPTrainer(ctx)
    # no summary: class 0 = 3/10; class 1 = (0 + 1) / (10 + 2) = 1/12
    pi1, pi0 = tr.rates(labels, mask)
    assert torch.allclose(pi1, torch.tensor([0.3, 1 / 12]), atol=1e-6) and torch.allclose(pi0, 1 - pi1)
    # with the summary: class 1 = 6 positives / (6 + 24) annotated entries elsewhere = 0.2; class 0 stays local
    ctx.summary = {
        "classes": ["c0", "c1"],
        "sites": {
            "x": {"n_train": 10, "annotated": [True, False], "positives": [3, 0], "negatives": [7, 0]},
            "y": {"n_train": 30, "annotated": [False, True], "positives": [0, 6], "negatives": [0, 24]},
        },
    }
    pi1, _ = tr.rates(labels, mask)
    assert torch.allclose(pi1, torch.tensor([0.3, 0.2]), atol=1e-6)
    # the earlier reading (missing_rates: tags): 0 positives of 4 tags -> clamped to 1e-4
    old, _ = M.FedMLPTrainer(ctx, missing_rates="pseudo_labels").rates(labels, mask)
    assert old[1].item() == pytest.approx(1e-4)
    # the gradient of Eq. 4 on one negative pseudo entry at logit 0 is sigmoid(ln(pi1/pi0)) / C = pi1 / C
    for rate, grad in ((pi1, 0.2 / 2), (old, 1e-4 / 2)):
        lg = torch.zeros(1, 2, requires_grad=True)
        M.wpc_loss(lg, torch.zeros(1, 2), torch.tensor([[False, True]]), rate, 1 - rate).backward()
        assert lg.grad[0, 1].item() == pytest.approx(grad, rel=1e-4)


def test_aggregator_fallback_keeps_fedmlp_prototypes_and_tagging_goes_on():
    """After a round in which nothing usable arrived (every site sat out, or nothing came), the server sends
    the last FedMLP meta again (prototypes, d_c^G), so stage-2 tagging does not pause at the sites."""
    from nvflare.apis.dxo import DXO, DataKind, from_shareable
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext
    from test_framework import _ctx

    from fedpartial.fl.aggregator import PartialLabelAggregator
    from fedpartial.fl.keys import META_GROUPS, META_N_TRAIN, META_WEIGHT

    g = torch.Generator().manual_seed(0)
    annotated = {"site-1": [True, False, False], "site-2": [False, True, True]}
    agg = PartialLabelAggregator("fedmlp")

    def send(fl_ctx, site, weight):
        peer = FLContext()
        peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=True, sticky=False)
        fl_ctx.set_peer_context(peer)
        counts = np.asarray([[5, 5] if a else [0, 0] for a in annotated[site]], np.int64)
        meta = {
            META_N_TRAIN: 24,
            META_WEIGHT: weight,
            META_GROUPS: {"classifier": []},
            "annotated": annotated[site],
            M.META_P0: torch.randn(3, 32, generator=g).numpy(),
            M.META_P1: torch.randn(3, 32, generator=g).numpy(),
            M.META_COUNTS: counts,
            M.META_DEGREE: np.full(3, 0.5),
        }
        assert agg.accept(DXO(DataKind.WEIGHTS, {"w": np.ones(1, np.float32)}, meta).to_shareable(), fl_ctx)

    fl_ctx = _ctx({"w": np.zeros(1, np.float32)}, 5)
    for site in annotated:
        send(fl_ctx, site, 1.0)
    first = from_shareable(agg.aggregate(fl_ctx)).meta
    assert M.META_GLOBAL_P0 in first
    fl_ctx = _ctx({"w": np.ones(1, np.float32)}, 6)
    for site in annotated:
        send(fl_ctx, site, 0.0)  # every site sits the round out: no usable update
    sat_out = from_shareable(agg.aggregate(fl_ctx)).meta
    empty = from_shareable(agg.aggregate(_ctx({"w": np.ones(1, np.float32)}, 7))).meta  # nothing arrived
    for meta in (sat_out, empty):
        for key in (M.META_GLOBAL_P0, M.META_GLOBAL_P1, M.META_GLOBAL_VALID, M.META_GLOBAL_DEGREE):
            assert np.array_equal(np.asarray(meta[key]), np.asarray(first[key])), key
    # a site in stage 2 receiving the fallback meta tags as usual
    tr = M.FedMLPTrainer(_site("site-1", annotated["site-1"], seed=1), warmup_rounds=0, T0=0.5, T1=0.5)
    assert tr.train_round(7, 8, empty).meta["fedmlp_new_pseudo"] > 0


def test_tag_audit_counts_and_precisions_by_hand():
    """fedpartial.tools.tag_audit: pseudo labels of the missing classes against the true labels, by hand."""
    from fedpartial.tools.tag_audit import summarise, tag_quality

    tags = np.array([[1, 1, -1], [1, 0, 0], [-1, 0, 1], [0, -1, 1]])
    truth = np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 0, 1]])
    missing = np.array([False, True, True])  # class 0 annotated: its tags (there are none in practice) not counted
    c = tag_quality(tags, truth, missing)
    assert c["entries"].tolist() == [0, 4, 4] and c["true_pos"].tolist() == [0, 1, 3]
    assert c["pos_tags"].tolist() == [0, 1, 2] and c["pos_correct"].tolist() == [0, 0, 2]  # row 0 class 1 is wrong
    assert c["neg_tags"].tolist() == [0, 2, 1] and c["neg_correct"].tolist() == [0, 1, 1]  # row 2 class 1 wrong
    rows = summarise(c, ["a", "b", "c"])
    assert [r["class"] for r in rows] == ["b", "c"]  # no missing entry of class a
    b, cc = rows
    assert (
        b["prevalence"] == 0.25 and b["pos_precision"] == 0.0 and b["neg_precision"] == 0.5 and b["pos_recall"] == 0.0
    )
    assert cc["prevalence"] == 0.75 and cc["pos_precision"] == 1.0 and cc["neg_precision"] == 1.0
    assert cc["pos_recall"] == 2 / 3
    with pytest.raises(ValueError, match="shape"):
        tag_quality(tags[:2], truth, missing)


def test_selection_counts_carry_the_fraction_so_small_sites_still_tag():
    """Eq. 8-9 on a small site: 30 positive candidates at tau1 = 1 % is 0.3 of a tag per round; rounded down every
    round it never tags (the reading this project had: FedMLP on 88-image CXR sites tagged nothing in 25 rounds);
    with the fraction carried it tags one every 3-4 rounds, 0.3 per round on average."""
    n_neg, n_pos = torch.tensor([50, 0]), torch.tensor([30, 10])
    k0, k1, carry = M.selection_counts(n_neg, n_pos, 0.005, torch.tensor([0.01, 0.5]))
    assert k0.tolist() == [0, 0] and k1.tolist() == [0, 5]
    assert torch.allclose(carry, torch.tensor([[0.25, 0.0], [0.3, 0.0]], dtype=torch.float64))
    total, carry = 0, torch.zeros(2, 2, dtype=torch.float64)
    for r in range(10):  # same pools every round (the pool shrinks in practice)
        k0, k1, carry = M.selection_counts(n_neg, n_pos, 0.005, 0.01, carry)
        total += int(k1[0])
        if r == 2:
            assert total == 0  # 0.3, 0.6, 0.9
        if r == 3:
            assert total == 1 and abs(float(carry[1, 0]) - 0.2) < 1e-9  # 1.2 -> one tag, 0.2 carried
    assert total == 3 and int(k0.sum()) <= 1  # 10 x 0.3 = 3; negatives 10 x 0.25 = 2.5 -> 2 over the rounds
    floor_total = sum(int(M.selection_counts(n_neg, n_pos, 0.005, 0.01)[1][0]) for _ in range(10))
    assert floor_total == 0


def test_schedule_share_matches_the_paper_schedule_total():
    """T' = 1 - (1 - T)^(S / S'): tagging T' for S' rounds leaves the same untagged share as T for S rounds."""
    t = M.schedule_share(0.01, 450, 25)
    assert abs((1 - t) ** 25 - 0.99**450) < 1e-12 and abs(t - (1 - 0.99**18)) < 1e-12
    assert M.schedule_share(0.01, None, 25) == 0.01 and M.schedule_share(0.01, 450, 0) == 0.01
    assert M.schedule_share(0.01, 25, 25) == pytest.approx(0.01)


def test_fedmlp_small_site_tags_with_carry_not_with_floor_and_T_rounds_compresses_the_schedule():
    """The trainer's stage 2 on a site whose tau * #candidates < 1 every round (24 images, T = 2 %): rounding down
    (the default, as the released code) never tags; the carried fraction (site state) does; ``T_rounds`` (the
    schedule T is meant for) tags more in a short job."""
    g = torch.Generator().manual_seed(0)
    p0, p1 = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    tagged = {}
    for name, opts in (
        ("floor", {}),
        ("carry", {"pseudo_label_rounding": "carry"}),
        ("schedule", {"pseudo_label_rounding": "carry", "T_rounds": 100}),
    ):
        torch.manual_seed(0)
        ctx = _site("s", [True, False, False], n=24, seed=3)
        tr = M.FedMLPTrainer(ctx, warmup_rounds=0, T0=0.02, T1=0.02, st=False, cr=False, **opts)
        for rnd in range(6):
            tr.train_round(rnd, 6, _global_meta(p0, p1, [1.0] * 3))
        tagged[name] = int((tr.pseudo_labels >= 0).sum())
        if name == "carry":
            again = M.FedMLPTrainer(_site("s", [True, False, False], n=24, seed=3), warmup_rounds=0)
            again.load_state_dict(tr.state_dict())
            assert (
                torch.equal(again.pseudo_label_carry, tr.pseudo_label_carry) and float(tr.pseudo_label_carry.sum()) > 0
            )
    assert tagged["floor"] == 0 and tagged["carry"] > 0 and tagged["schedule"] > 2 * tagged["carry"], tagged


def test_a_channels_last_model_exports_contiguous_arrays_of_the_state_dicts_shapes():
    """``train.channels_last`` (the executor's default) lays conv weights out channels-last; what the site sends
    must still be C-contiguous arrays with the state dict's exact shapes (0-d BatchNorm counters stay 0-d: a
    (1,) counter is refused by the server's shape check)."""
    model = PartialLabelNet("small_cnn", 3, 3, width=4).to(memory_format=torch.channels_last)
    assert not model.encoder.body[0].weight.is_contiguous()  # the layout is really channels-last
    tr = M.FedMLPTrainer(_site("s", [True, False, False], model=model), warmup_rounds=1)
    out = tr.export()
    state = model.state_dict()
    assert set(out) == set(state)
    for k, v in out.items():
        assert v.shape == tuple(state[k].shape) and v.flags.c_contiguous, k
        assert np.array_equal(v, state[k].numpy()), k


def test_renamed_fedmlp_options_are_refused_with_a_pointer():
    """``tau`` is ``la_tau`` (the logit-adjustment temperature, beside the selection ratios tau0 / tau1) and
    ``tag_rounding`` is ``pseudo_label_rounding``: the old names stop the job naming the new ones."""
    from fedpartial.methods import OptionError, get_method

    method = get_method("fedmlp")
    for old, new in (("tau", "la_tau"), ("tag_rounding", "pseudo_label_rounding")):
        with pytest.raises(OptionError, match=f"'{old}' was renamed '{new}'"):
            method.split_options({old: 1.0 if old == "tau" else "floor"}, "job fedmlp_ich")
    assert method.split_options({"la_tau": 0.5})[0] == {"la_tau": 0.5}


def test_rule_prototypes_survive_a_checkpoint_through_the_sent_meta(tmp_path):
    """The rule's prototypes are stored once (the meta sent with the model): a fresh rule given that meta keeps a
    class's prototype in a round where no contributing site annotates it, as the rule that never stopped does."""
    from fedpartial.fl.aggregator import to_builtin
    from fedpartial.fl.checkpoint import from_safe, read_file, write_private
    from fedpartial.methods import Contribution

    C, D = 3, 2

    def site(name: str, annotated: list[bool], value: float) -> Contribution:
        a = np.asarray(annotated)
        return Contribution(
            site=name,
            weights={"w": np.zeros(1, np.float32)},
            n=10,
            meta={
                "annotated": a.tolist(),
                M.META_P0: np.full((C, D), value, np.float32) * a[:, None],
                M.META_P1: np.full((C, D), value + 1, np.float32) * a[:, None],
                M.META_COUNTS: np.repeat(a[:, None].astype(np.int64) * 5, 2, 1),
                M.META_DEGREE: np.full(C, 0.5),
            },
        )

    prev, groups = {"w": np.zeros(1, np.float32)}, {"classifier": []}
    round0 = [site("a", [True, True, False], 1.0), site("b", [False, True, True], 3.0)]
    round1 = [site("a", [True, False, False], 5.0), site("b", [False, False, False], 0.0)]
    straight = M.FedMLPRule()
    _, sent = straight.aggregate(prev, round0, groups, 0)
    _, expected = straight.aggregate(prev, round1, groups, 1)
    assert straight.state_dict() == {}  # nothing stored beside the meta
    write_private({"rule": straight.state_dict(), "meta": to_builtin(sent)}, tmp_path / "ckpt.pt")
    fresh = M.FedMLPRule()
    fresh.load_state_dict(read_file(tmp_path / "ckpt.pt")["rule"])
    fresh.load_sent_meta(from_safe(read_file(tmp_path / "ckpt.pt")["meta"]))
    _, got = fresh.aggregate(prev, round1, groups, 1)
    # class 0 from round 1 (5 / 6), classes 1 and 2 kept from round 0 (mean 2 / 3 and 3 / 4)
    assert np.asarray(got[M.META_GLOBAL_P0])[:, 0].tolist() == [5.0, 2.0, 3.0]
    assert np.asarray(got[M.META_GLOBAL_P1])[:, 0].tolist() == [6.0, 3.0, 4.0]
    for key in (M.META_GLOBAL_P0, M.META_GLOBAL_P1, M.META_GLOBAL_VALID, M.META_GLOBAL_DEGREE):
        assert np.array_equal(np.asarray(got[key]), np.asarray(expected[key])), key
    lost = M.FedMLPRule()  # without the sent meta the kept classes are gone
    _, without = lost.aggregate(prev, round1, groups, 1)
    assert not np.array_equal(np.asarray(without[M.META_GLOBAL_VALID]), np.asarray(expected[M.META_GLOBAL_VALID]))
