"""FPSL (class-weighted partial BCE + task-dependent aggregation) and FedAvg(*) + FixMatch, by hand on tiny
tensors: FPSL's loss and class weights; FixMatch's pseudo-label masking for both task types, its unsupervised
loss, the weak view as the target's source and the strong view as the loss's, and the round's counters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_fedlsm import _mc_site, _ViewData  # a single-label fake site; views as constant markers
from test_fedmlp import _site  # a multi-label fake site
from torch import nn

from fedpartial.methods import Contribution, OptionError, TrainOptions, get_method
from fedpartial.methods.fixmatch import (
    META_CANDIDATES,
    META_NEGATIVES,
    META_POSITIVES,
    META_PSEUDO,
    META_RATE,
    FixMatchTrainer,
    pseudo_labels,
    unsupervised_loss,
)
from fedpartial.methods.fpsl import META_POS_WEIGHT, FPSLTrainer, fpsl_class_weights, fpsl_loss

LN2 = math.log(2.0)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


# ------------------------------------------------------------------------------------------ FPSL


def test_fpsl_weighted_partial_bce_by_hand():
    logits = torch.tensor([[0.0, 2.0, -1.0], [1.0, 0.0, 3.0]])
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])  # class 2 not annotated (its logit 3 ignored)
    w = torch.tensor([3.0, 0.5, 7.0])
    # BCE(z, 1) = softplus(-z), BCE(z, 0) = softplus(z); positives x w_c; mean over the 4 annotated entries
    expected = (3.0 * softplus(-0.0) + softplus(2.0) + softplus(1.0) + 0.5 * softplus(-0.0)) / 4
    assert float(fpsl_loss(logits, labels, mask, w)) == pytest.approx(expected, rel=1e-6)
    unweighted = (LN2 + softplus(2.0) + softplus(1.0) + LN2) / 4
    assert float(fpsl_loss(logits, labels, mask, None)) == pytest.approx(unweighted, rel=1e-6)
    # w_c = negatives / positives over annotated entries; 1 without a positive or without a negative
    lab = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    msk = torch.tensor([[True, True, False], [True, True, False], [True, False, False], [True, False, False]])
    # class 0: 1 positive, 3 negatives -> 3; class 1: 0 positive among 2 annotated -> 1; class 2: none annotated -> 1
    assert fpsl_class_weights(lab, msk).tolist() == [3.0, 1.0, 1.0]


def test_fpsl_class_weights_global_site_none_and_single_label_loss():
    ctx = _site("s", [True, True, False], n=12, seed=3)
    labels, mask = ctx.data.labels, ctx.data.mask
    ctx.summary = {
        "sites": {
            "s": {"positives": [2, 1, 0], "negatives": [6, 1, 0]},
            "t": {"positives": [2, 0, 5], "negatives": [2, 0, 15]},
        }
    }
    tr = FPSLTrainer(ctx)
    assert tr.class_weights().tolist() == [2.0, 1.0, 3.0]  # (6 + 2) / (2 + 2), 1 / 1, 15 / 5: every site's counts
    tr.start_round(0, {})
    batch = {"label": labels[:4], "mask": mask[:4]}
    logits = torch.randn(4, 3)
    assert float(tr.label_loss(logits, batch)) == pytest.approx(
        float(fpsl_loss(logits, labels[:4], mask[:4], torch.tensor([2.0, 1.0, 3.0])))
    )
    own = fpsl_class_weights(labels, mask)
    assert torch.equal(FPSLTrainer(ctx, class_weights="site").class_weights(), own)
    assert FPSLTrainer(ctx, class_weights="none").class_weights() is None
    ctx.summary = None  # no summary: the site's own labels
    assert torch.equal(FPSLTrainer(ctx).class_weights(), own)
    # a round trains and reports the weights it used
    ctx.summary = {"sites": {"s": {"positives": [2, 1, 0], "negatives": [6, 1, 0]}}}
    out = FPSLTrainer(ctx).train_round(0, 1, {})
    assert out.steps > 0 and np.allclose(out.meta[META_POS_WEIGHT], [3.0, 1.0, 1.0])
    # single-label: CE with the softmax over the annotated classes, labelled rows only, no weights
    mc = FPSLTrainer(_mc_site("m", [True, True, False]))
    assert mc.class_weights() is None
    lg = torch.tensor([[1.0, 0.0, 5.0], [0.0, 0.0, 0.0]])
    lb = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 is not labelled here
    mk = torch.tensor([[True, True, False], [True, True, False]])
    # row 1: -log(e^1 / (e^1 + e^0)), class 2's logit 5 is outside the restricted softmax
    assert float(mc.label_loss(lg, {"label": lb, "mask": mk})) == pytest.approx(softplus(-1.0), rel=1e-6)


@pytest.mark.parametrize("task,args", [("multiclass", {}), ("multilabel", {"class_weights": "none"})])
def test_fpsl_trains_as_fedavg_masked_where_it_has_no_class_weights(task, args):
    """Single-label FPSL (and multi-label without weights) is fedavg_masked's local training, step for step; with
    the weights (multi-label) it is not."""
    make = _site if task == "multilabel" else _mc_site
    start = {k: v.clone() for k, v in make("a", [True, True, False], n=8).model.state_dict().items()}

    def trained(method, opts):
        ctx = make("a", [True, True, False], n=8, seed=1)
        ctx.summary = {"sites": {"a": {"positives": [1, 2, 0], "negatives": [7, 2, 0]}}}  # w = [7, 1, 1]
        ctx.train = TrainOptions(lr=1e-2, batch_size=4, local_steps=2)
        ctx.model.load_state_dict(start)
        torch.manual_seed(0)
        get_method(method).make_trainer(ctx, opts).train_round(0, 1, {})
        return ctx.model.classifier.weight.detach().clone()

    assert torch.equal(trained("fpsl", args), trained("fedavg_masked", {}))
    if task == "multilabel":
        assert not torch.equal(trained("fpsl", {}), trained("fedavg_masked", {}))


def _rows_after_aggregation(method: str) -> np.ndarray:
    """Class 1 is annotated only at site a (row 1.0), not at site b (row 5.0); equal sizes."""
    rule = get_method(method).make_rule({})
    states = [
        {"enc": np.array([0.0]), "cls": np.array([[1.0], [1.0]])},
        {"enc": np.array([2.0]), "cls": np.array([[3.0], [5.0]])},
    ]
    contribs = [
        Contribution("a", states[0], 10.0, {"annotated": [True, True]}),
        Contribution("b", states[1], 10.0, {"annotated": [True, False]}),
    ]
    out, _ = rule.aggregate(None, contribs, {"classifier": ["cls"]}, 0)
    assert out["enc"].tolist() == [1.0]
    return out["cls"][:, 0]


def test_fpsl_and_fixmatch_masked_use_the_task_dependent_aggregation_fixmatch_fedavg():
    for method in ("fpsl", "fixmatch_masked"):
        assert _rows_after_aggregation(method).tolist() == [2.0, 1.0]  # class 1: site a's row only
    assert _rows_after_aggregation("fixmatch").tolist() == [2.0, 3.0]  # FedAvg: the mean of 1 and 5


# ------------------------------------------------------------------------------------------ FixMatch masking


def test_single_label_pseudo_labels_on_unlabelled_rows_above_tau():
    probs = torch.tensor(
        [
            [0.99, 0.005, 0.005],  # labelled row: no pseudo label however confident
            [0.02, 0.96, 0.02],  # unlabelled, 0.96 >= 0.95 -> class 1
            [0.94, 0.03, 0.03],  # unlabelled, 0.94 < 0.95 -> none
            [0.01, 0.04, 0.95],
        ]
    )  # unlabelled, exactly tau -> class 2
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False]] * 4)
    targets, pseudo, cand = pseudo_labels(probs, labels, mask, "multiclass", 0.95)
    assert cand.tolist() == [False, True, True, True]
    assert pseudo.tolist() == [False, True, False, True]
    assert targets[1].tolist() == [0.0, 1.0, 0.0] and targets[3].tolist() == [0.0, 0.0, 1.0]  # hard argmax


def test_multi_label_pseudo_labels_per_unannotated_entry():
    probs = torch.tensor([[0.99, 0.97, 0.50], [0.01, 0.03, 0.94], [0.50, 0.96, 0.04]])
    mask = torch.tensor([[True, False, False]] * 3)  # class 0 annotated: never pseudo-labelled
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    targets, pseudo, cand = pseudo_labels(probs, labels, mask, "multilabel", 0.95)
    assert torch.equal(cand, ~mask)
    # p >= 0.95 -> 1, p <= 0.05 -> 0, in between (0.50, 0.94) -> none
    assert pseudo.tolist() == [[False, True, False], [False, True, False], [False, True, True]]
    assert (targets * pseudo).tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    # tau 0.9: 0.94 now qualifies
    _, pseudo9, _ = pseudo_labels(probs, labels, mask, "multilabel", 0.9)
    assert pseudo9[1].tolist() == [False, True, True]
    with pytest.raises(ValueError, match="tau must be >= 0.5"):
        FixMatchTrainer(_site("x", [True, False, False], n=4), tau=0.4)
    with pytest.raises(OptionError, match="tau"):
        get_method("fixmatch").make_trainer(_site("x", [True, False, False], n=4), {"tau": 1.5})


def test_unsupervised_and_step_loss_by_hand():
    # single-label: 3 unlabelled rows, 2 with a pseudo label: (CE_1 + CE_3) / 3
    logits_s = torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [5.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    targets = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [1.0, 0, 0], [0, 0, 1.0]])
    pseudo = torch.tensor([False, True, False, True])
    cand = torch.tensor([False, True, True, True])
    ce1 = -math.log(math.e / (math.e + 2))
    ce3 = -math.log(1 / (math.exp(2) + 2))
    assert float(unsupervised_loss(logits_s, targets, pseudo, cand, "multiclass")) == pytest.approx(
        (ce1 + ce3) / 3, rel=1e-6
    )
    # multi-label: pseudo entries (0, 1) -> 1 and (1, 1) -> 0 among 4 unannotated entries
    ls = torch.tensor([[0.0, 2.0], [0.0, -1.0]])
    tg = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    ps = torch.tensor([[False, True], [False, True]])
    cd = torch.tensor([[True, True], [True, True]])
    assert float(unsupervised_loss(ls, tg, ps, cd, "multilabel")) == pytest.approx(
        (softplus(-2.0) + softplus(-1.0)) / 4, rel=1e-6
    )
    assert float(unsupervised_loss(ls, tg, torch.zeros_like(ps), cd, "multilabel")) == 0.0
    # one step: partial BCE on the weak view's annotated entries + lambda_u * l_u on the strong view
    tr = FixMatchTrainer(_site("x", [True, False], n=4, C=2), lambda_u=0.5)
    lw = torch.tensor([[1.0, 4.0], [-1.0, 0.0]])  # weak: entry (0, 1) p = 0.982 -> 1; (1, 1) p = 0.5 -> none
    lst = torch.tensor([[9.0, -2.0], [9.0, 9.0]])  # strong: only (0, 1) counts, target 1 -> softplus(2)
    labels = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, False], [True, False]])
    loss, *_ = tr.step_loss(lw, lst, labels, mask)
    expected = (softplus(-1.0) + softplus(-1.0)) / 2 + 0.5 * softplus(2.0) / 2
    assert float(loss) == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------------------------------ views and counters


class _Affine(nn.Module):
    """``logits = mean(x) * a + b`` per class: with constant view markers the output of each view is set by hand."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(a)), nn.Parameter(torch.tensor(b))

    def forward(self, x):
        return x.mean((1, 2, 3))[:, None] * self.a + self.b

    def parameter_groups(self):
        return {"encoder": [], "norm": [], "head": [], "classifier": ["a", "b"]}


@pytest.mark.parametrize("task", ["multilabel", "multiclass"])
def test_target_from_the_weak_view_loss_on_the_strong_view_and_the_counters(task):
    """Weak view = constant 2, strong view = constant 3 (the marker dataset). Class 1 (unannotated): weak logit
    -6 * 2 + 16 = 4 (p = 0.98: a pseudo positive / the row's class), strong logit -2 (p = 0.12: not confident).
    FixMatch: target from the weak view, loss on the strong one: l_u = softplus(2) per candidate. Targets from the
    strong view would give no pseudo label (l_u = 0); the loss on the weak view softplus(-4)."""
    make = _site if task == "multilabel" else _mc_site
    ctx = make("s", [True, False], n=6, C=2, seed=2, model=_Affine([0.0, -6.0], [0.0, 16.0]))
    ctx.data = _ViewData(ctx.data.images, ctx.data.labels, ctx.data.mask)
    ctx.train = TrainOptions(optimizer="sgd", lr=0.0, momentum=0.0, batch_size=6, local_steps=1)
    out = get_method("fixmatch").make_trainer(ctx, {}).train_round(0, 1, {})
    labelled = ctx.data.labels[:, 0] > 0
    if task == "multilabel":  # class 0 logit 0 in both views: BCE ln 2 on each annotated entry
        assert out.loss == pytest.approx(LN2 + softplus(2.0), rel=1e-5)
        assert out.meta[META_CANDIDATES] == 6 and out.meta[META_PSEUDO] == 6 and out.meta[META_RATE] == 1.0
        assert out.meta[META_POSITIVES].tolist() == [0.0, 6.0] and out.meta[META_NEGATIVES].tolist() == [0.0, 0.0]
    else:  # the restricted softmax over the one annotated class: CE 0; the unlabelled rows: softmax [0, -2]
        n_u = int((~labelled).sum())
        assert 0 < n_u < 6
        assert out.loss == pytest.approx(softplus(2.0), rel=1e-5)
        assert out.meta[META_CANDIDATES] == n_u and out.meta[META_PSEUDO] == n_u
        assert out.meta[META_POSITIVES].tolist() == [0.0, float(n_u)] and META_NEGATIVES not in out.meta
    # a weak view that is not confident (logit 0.5 * 2 - 0.5 = 0.5, p = 0.62 / 0.62): no pseudo label
    with torch.no_grad():
        ctx.model.a.copy_(torch.tensor([0.0, 0.5]))
        ctx.model.b.copy_(torch.tensor([0.0, -0.5]))
    out = get_method("fixmatch").make_trainer(ctx, {}).train_round(0, 1, {})
    assert out.meta[META_PSEUDO] == 0 and out.meta[META_RATE] == 0.0 and out.meta[META_CANDIDATES] > 0


@pytest.mark.parametrize("method", ["fixmatch", "fixmatch_masked"])
@pytest.mark.parametrize("task", ["multilabel", "multiclass"])
def test_fixmatch_rounds_run_for_both_tasks_and_at_an_unlabelled_site(method, task):
    make = _site if task == "multilabel" else _mc_site
    for annotated in ([True, False, False], [False, False, False]):
        ctx = make("s", annotated, n=8, seed=4)
        ctx.train = TrainOptions(lr=1e-3, batch_size=4, local_steps=2)
        before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
        out = get_method(method).make_trainer(ctx, {"tau": 0.6}).train_round(0, 1, {})
        assert out.steps == 2 and math.isfinite(out.loss)
        assert out.meta[META_CANDIDATES] > 0 and 0.0 <= out.meta[META_RATE] <= 1.0
        assert any(not torch.equal(before[k], v) for k, v in ctx.model.state_dict().items())


def test_single_label_pseudo_labels_can_exclude_the_classes_the_site_annotates():
    from fedpartial.methods.fixmatch import pseudo_labels

    # one unlabelled row of a site annotating classes 0 and 1: its true class is 2 or 3
    probs = torch.tensor([[0.96, 0.01, 0.02, 0.01], [0.01, 0.01, 0.97, 0.01]])
    mask = torch.tensor([[True, True, False, False]] * 2)
    labels = torch.zeros(2, 4)
    t_all, p_all, cand = pseudo_labels(probs, labels, mask, "multiclass", 0.95)
    assert cand.tolist() == [True, True] and p_all.tolist() == [True, True] and t_all[0].argmax() == 0
    t_un, p_un, _ = pseudo_labels(probs, labels, mask, "multiclass", 0.95, unannotated_only=True)
    assert p_un.tolist() == [False, True]  # row 0's best unannotated class has p 0.02 < tau: no pseudo label
    assert t_un[1].argmax() == 2 and t_un[0].argmax() in (2, 3)
