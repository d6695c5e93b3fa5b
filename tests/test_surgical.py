"""Surgical aggregation (methods/surgical), its baselines (PFL, individual) and the evaluation statistics
(fedpartial.stats), by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fake_sites import FakeData
from scipy import stats as st
from sklearn.metrics import roc_auc_score
from test_fedmlp import _site

from fedpartial.methods import Contribution, get_method
from fedpartial.methods.surgical import SurgicalTrainer, local_bce
from fedpartial.methods.surgical.trainer import META_NORM_FROM_WARMUP
from fedpartial.models import PartialLabelNet
from fedpartial.stats import (
    add_run_statistics,
    bootstrap_auc_ci,
    own_class_scores,
    paired_comparison,
    resample_counts,
    weighted_auc,
)

# ------------------------------------------------------------------------------------------ the model's head


@pytest.mark.parametrize("arch", ["small_cnn", "resnet18", "densenet121"])
def test_paper_head_for_every_backbone_and_only_the_last_dense_is_the_task_block(arch):
    net = PartialLabelNet(arch, 5, 3, head_hidden=256, head_dropout=0.3, width=4)
    g = net.parameter_groups()
    assert g["classifier"] == ["classifier.weight", "classifier.bias"]
    assert net.classifier.weight.shape == (5, 256)
    assert g["head"] == ["hidden.0.weight", "hidden.0.bias"] and net.hidden[0].in_features == net.feature_dim
    assert isinstance(net.hidden[1], torch.nn.ReLU) and net.hidden[2].p == 0.3
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 5)


# ------------------------------------------------------------------------------------------ the server rule


def _state(v: float, cls: np.ndarray | None = None) -> dict:
    """A toy state: an encoder tensor, a norm layer (weight, running mean) and a 3-class classifier."""
    return {
        "enc": np.full(2, v),
        "bn.weight": np.full(2, v),
        "bn.running_mean": np.full(2, v),
        "classifier.weight": np.full((3, 2), v) if cls is None else np.repeat(cls[:, None], 2, axis=1),
        "classifier.bias": np.full(3, v) if cls is None else cls.copy(),
    }


GROUPS = {
    "encoder": ["enc"],
    "norm": ["bn.weight", "bn.running_mean"],
    "head": [],
    "classifier": ["classifier.weight", "classifier.bias"],
}


def _con(site, state, n, annotated, **meta):
    return Contribution(site, state, float(n), {"annotated": list(annotated), **meta})


def test_representation_is_the_unweighted_mean_and_samples_is_an_option():
    cons = [_con("a", _state(0.0), 10, [1, 1, 1]), _con("b", _state(3.0), 50, [1, 1, 1])]
    out, _ = get_method("surgical").make_rule({"norm": "average"}).aggregate(_state(9.0), cons, GROUPS, 1)
    assert out["enc"] == pytest.approx([1.5, 1.5])  # (0 + 3) / 2, not (10*0 + 50*3) / 60
    out, _ = (
        get_method("surgical")
        .make_rule({"norm": "average", "site_weighting": "samples"})
        .aggregate(_state(9.0), cons, GROUPS, 1)
    )
    assert out["enc"] == pytest.approx([2.5, 2.5])


def test_task_block_rows_over_the_annotating_sites_shared_unique_absent():
    # class 0 shared by a and b, class 1 unique to c, class 2 annotated by nobody this round
    a = _con("a", _state(0.0, np.array([1.0, 7.0, 7.0])), 10, [1, 0, 0])
    b = _con("b", _state(0.0, np.array([4.0, 7.0, 7.0])), 90, [1, 0, 0])
    c = _con("c", _state(0.0, np.array([7.0, 5.0, 7.0])), 30, [0, 1, 0])
    prev = _state(0.0, np.array([-1.0, -2.0, -3.0]))
    out, _ = get_method("surgical").make_rule({}).aggregate(prev, [a, b, c], GROUPS, 1)
    assert out["classifier.bias"] == pytest.approx([2.5, 5.0, -3.0])  # mean(1, 4); c's own row; previous
    assert out["classifier.weight"][:, 0] == pytest.approx([2.5, 5.0, -3.0])
    # vanilla FL through the same pipeline: every row over every site (unweighted)
    out, _ = get_method("surgical").make_rule({"task_block": "average"}).aggregate(prev, [a, b, c], GROUPS, 1)
    assert out["classifier.bias"] == pytest.approx([4.0, 19 / 3, 7.0])


def test_fedbn_plus_norm_frozen_except_the_warmup_statistics_averaged_once():
    rule = get_method("surgical").make_rule({})  # FedBN+ by default
    prev = _state(0.0)
    cons = [_con("a", _state(2.0), 10, [1, 1, 1]), _con("b", _state(4.0), 10, [1, 1, 1])]
    out, _ = rule.aggregate(prev, cons, GROUPS, 3)
    assert out["bn.running_mean"] == pytest.approx([0, 0]) and out["bn.weight"] == pytest.approx([0, 0])
    warm = [_con(c.site, c.weights, c.n, [1, 1, 1], **{META_NORM_FROM_WARMUP: True}) for c in cons]
    out, _ = rule.aggregate(prev, warm, GROUPS, 0)
    assert out["bn.running_mean"] == pytest.approx([3, 3])
    # FedBN: the global model holds the average, the sites keep their own (see the receive test below)
    out, _ = get_method("surgical").make_rule({"norm": "local"}).aggregate(prev, cons, GROUPS, 3)
    assert out["bn.running_mean"] == pytest.approx([3, 3])


# ------------------------------------------------------------------------------------------ the site


class _ValData(FakeData):
    """_FakeData plus a validation split (the trainer's warm-up selects its epoch on it)."""

    def __init__(self, images, labels, mask, val=None):
        super().__init__(images, labels, mask)
        self.val = val
        self.manifests = {}

    def eval_loader(self, split, batch_size=128):
        assert split == "val"
        return torch.utils.data.DataLoader(FakeData(*self.val).dataset("val", {"image": "eval"}), batch_size=batch_size)


class _Manifest(SimpleNamespace):
    def __len__(self):
        return len(self.mask)


def _surgical_site(name="site-1", annotated=(True, True, False), val=True, **model_kw):
    torch.manual_seed(0)  # the model's initial weights: the same whatever ran before in this process
    ctx = _site(
        name, list(annotated), n=24, model=PartialLabelNet("small_cnn", 3, 3, width=4, head_hidden=8, **model_kw)
    )
    d = ctx.data
    v = (d.images[:12] + 0.01, d.labels[:12], torch.ones_like(d.mask[:12])) if val else None
    ctx.data = _ValData(d.images, d.labels, d.mask, v)
    if val:
        ctx.data.manifests = {"val": _Manifest(mask=v[2].numpy())}
    return ctx


@pytest.mark.parametrize("train", [["head", "classifier"], ["classifier"]])
def test_warmup_trains_only_the_task_block_with_the_representation_frozen(train):
    ctx = _surgical_site()
    tr = SurgicalTrainer(ctx, warmup_epochs=3, warmup_train=train, norm="frozen")
    groups = ctx.model.parameter_groups()
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    out = tr.train_round(0, 5, {})
    after = ctx.model.state_dict()
    params = {n for n, _ in ctx.model.named_parameters()}
    for k in groups["encoder"] + [k for k in groups["norm"] if k in params]:
        assert torch.equal(after[k], before[k]), k  # representation frozen
    assert not torch.equal(after["classifier.weight"], before["classifier.weight"])
    head_moved = not torch.equal(after["hidden.0.weight"], before["hidden.0.weight"])
    assert head_moved == ("head" in train)
    # no pretrained weights: the BN statistics were estimated on the site's images, and the server is told
    assert not torch.equal(after["encoder.body.1.running_mean"], before["encoder.body.1.running_mean"])
    assert out.meta[META_NORM_FROM_WARMUP] is True and out.meta["surgical_warmup"][0] == 3
    assert out.steps == 3 * 3 and tr.warmed_up
    assert all(p.requires_grad for p in ctx.model.parameters())  # the later rounds' strategy decides again
    # round 1 is ordinary FedBN+ training: norm statistics and affine frozen, the encoder trains
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    tr.train_round(1, 5, {})
    after = ctx.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in groups["norm"])
    assert not torch.equal(after["encoder.body.0.weight"], before["encoder.body.0.weight"])


def test_warmup_keeps_the_epoch_with_the_lowest_local_val_loss():
    """The validation labels are the training labels inverted: fitting the training set raises the validation
    loss, so the best epoch is not the last one, and the kept head must score the best epoch's loss (a warm-up
    that keeps its last epoch, or reports one epoch and keeps another, fails)."""
    ctx = _surgical_site()
    images, labels, mask = ctx.data.val
    ctx.data.val = (images, 1.0 - labels, mask)
    tr = SurgicalTrainer(ctx, warmup_epochs=4, warmup_lr=0.05)
    out = tr.train_round(0, 5, {})
    losses = out.meta["surgical_warmup_val_bce"]
    best = int(np.argmin(losses))
    assert best < 3 and losses[-1] > losses[best] + 1e-3  # the case: the loss does not fall to the last epoch
    assert out.meta["surgical_warmup"] == [4, best + 1]
    loader = ctx.data.eval_loader("val", 64)
    assert local_bce(ctx.model, loader, ctx.annotated) == pytest.approx(losses[best], rel=1e-5)
    # without val data: the last epoch
    ctx2 = _surgical_site(val=False)
    out2 = SurgicalTrainer(ctx2, warmup_epochs=2).train_round(0, 5, {})
    assert out2.meta["surgical_warmup"] == [2, 2] and "surgical_warmup_val_bce" not in out2.meta


def test_local_bce_is_over_the_sites_own_annotated_classes_by_hand():
    class Zero(torch.nn.Module):
        def forward(self, x):
            return torch.stack([torch.zeros(len(x)), torch.full((len(x),), 2.0), torch.zeros(len(x))], 1)

    batch = {
        "image": torch.zeros(2, 1),
        "label": torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]),
        "mask": torch.tensor([[True, True, True], [True, False, True]]),
    }
    # own classes 0 and 1: entries (0,0) ln2, (0,1) softplus(-2), (1,0) ln2; class 2 ignored
    expected = (2 * np.log(2) + np.log1p(np.exp(-2.0))) / 3
    assert local_bce(Zero(), [batch], np.array([True, True, False])) == pytest.approx(expected)
    assert local_bce(Zero(), [batch], np.array([False, False, False])) is None


def test_fedbn_keeps_each_sites_norm_statistics_and_pfl_its_task_block():
    ctx = _surgical_site()
    tr = get_method("surgical").make_trainer(ctx, {"norm": "local", "warmup_epochs": 1})
    tr.train_round(0, 3, {})
    tr.has_local_state = True
    groups = ctx.model.parameter_groups()
    own = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    received = {k: np.full(v.shape, 0.25, dtype=v.numpy().dtype) for k, v in own.items()}
    tr.receive(received)
    state = ctx.model.state_dict()
    assert all(torch.equal(state[k], own[k]) for k in groups["norm"])
    assert all(np.allclose(state[k].numpy(), 0.25) for k in groups["encoder"] + groups["classifier"])
    pfl = get_method("pfl").make_trainer(_surgical_site(), {})
    pfl.has_local_state = True
    cls = pfl.ctx.model.classifier.weight.detach().clone()
    pfl.receive({k: np.full(v.shape, 0.25, dtype=v.numpy().dtype) for k, v in pfl.ctx.model.state_dict().items()})
    assert torch.equal(pfl.ctx.model.classifier.weight, cls) and pfl.opts.norm == "frozen"
    ind = get_method("individual").make_trainer(_surgical_site(), {})
    ind.has_local_state = True
    mine = {k: v.clone() for k, v in ind.ctx.model.state_dict().items()}
    ind.receive({k: np.full(v.shape, 0.25, dtype=v.numpy().dtype) for k, v in mine.items()})
    assert all(torch.equal(ind.ctx.model.state_dict()[k], v) for k, v in mine.items())  # nothing taken


def test_individual_trains_batchnorm_or_freezes_it_as_the_released_code():
    """The paper's individually trained baseline is "standard deep learning" (``norm: average``: BatchNorm trains,
    its statistics move); the released ``src/local.py`` freezes every BatchNormalization layer after the warm-up:
    ``norm: frozen`` keeps the norm tensors of round 1 exactly."""
    for options, frozen in (({}, False), ({"norm": "frozen"}, True)):
        ctx = _surgical_site()
        tr = get_method("individual").make_trainer(ctx, {"warmup_epochs": 1, **options})
        tr.train_round(0, 3, {})
        tr.has_local_state = True
        before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
        tr.train_round(1, 3, {})
        after = ctx.model.state_dict()
        norm = ctx.model.parameter_groups()["norm"]
        assert norm and all(torch.equal(after[k], before[k]) for k in norm) == frozen, options
        assert not torch.equal(after["encoder.body.0.weight"], before["encoder.body.0.weight"])


def test_early_stopping_min_delta_counts_only_improvements_above_it():
    """Mean local validation loss falling by 4e-5 a round. min_delta 0: every round is a new best, never a stop.
    min_delta 1e-4 (the released federated.py): round 0 sets the reference; rounds 1 and 2 improve by 4e-5 and
    8e-5 (< 1e-4), so with patience 2 training stops after round 2, while the best model is still round 2's."""
    from fedpartial.fl.selection import ModelSelector

    losses = [1.0, 0.99996, 0.99992, 0.99988, 0.99984]

    def run(min_delta):
        sel = ModelSelector(key_metric="site_bce", patience=2, min_delta=min_delta)
        for rnd, loss in enumerate(losses):
            before = sel.best_val_metric
            sel.best_val_metric = max(before, -loss)  # what the parent does with the negated loss
            sel.note_round(rnd, before)
            if sel.should_stop():  # the workflow starts no further round
                return sel, rnd
        return sel, None

    sel, stopped = run(0.0)
    assert stopped is None and sel.best_round == sel.patience_round == 4
    sel, stopped = run(1e-4)
    assert stopped == 2 and sel.patience_round == 0 and sel.best_round == 2
    restored = ModelSelector(key_metric="site_bce", patience=2, min_delta=1e-4)
    restored.restore_checkpoint(run(1e-4)[0].checkpoint_state())
    assert restored.patience_round == 0 and restored.patience_metric == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="min_delta"):
        ModelSelector(min_delta=-1.0)


def test_warmup_state_survives_a_restart():
    ctx = _surgical_site()
    tr = SurgicalTrainer(ctx, warmup_epochs=1)
    tr.train_round(0, 3, {})
    again = SurgicalTrainer(_surgical_site(), warmup_epochs=1)
    again.load_state_dict(tr.state_dict())
    assert again.warmed_up and "surgical_warmup" not in again.train_round(1, 3, {}).meta


# ------------------------------------------------------------------------------------------ statistics

Y = np.array([[1, 0], [0, 1], [1, 1], [0, 0], [1, 0], [0, 1], [0, 0], [1, 1]])
P = np.array([[0.9, 0.2], [0.3, 0.6], [0.7, 0.7], [0.2, 0.1], [0.4, 0.3], [0.4, 0.8], [0.1, 0.4], [0.8, 0.5]])


def test_weighted_auc_equals_sklearn_on_the_resampled_rows():
    counts = resample_counts(len(Y), 20, seed=3)
    auc = weighted_auc(P[:, 0], Y[:, 0], counts)
    for b in range(20):
        idx = np.repeat(np.arange(len(Y)), counts[b].astype(int))
        y = Y[idx, 0]
        expected = roc_auc_score(y, P[idx, 0]) if 0 < y.sum() < len(y) else np.nan
        assert auc[b] == pytest.approx(expected, nan_ok=True)
    assert weighted_auc(P[:, 1], Y[:, 1], np.ones((1, 8)))[0] == pytest.approx(roc_auc_score(Y[:, 1], P[:, 1]))


def test_bootstrap_ci_is_the_percentile_interval_of_100_seeded_resamples():
    ci = bootstrap_auc_ci(Y, P, ["a", "b"], seed=0)
    assert ci["n_resamples"] == 100 and ci["level"] == 0.95
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(Y), size=(100, len(Y)))  # the same draws, by hand with sklearn
    per = {0: [], 1: []}
    for b in range(100):
        for c in (0, 1):
            y = Y[idx[b], c]
            per[c].append(roc_auc_score(y, P[idx[b], c]) if 0 < y.sum() < len(y) else np.nan)
    for c, name in ((0, "a"), (1, "b")):
        v = np.array(per[c])
        v = v[np.isfinite(v)]
        assert ci["auc"]["per_class"][name] == pytest.approx([np.percentile(v, 2.5), np.percentile(v, 97.5)])
    macro = np.nanmean(np.array([per[0], per[1]]), axis=0)
    assert ci["auc"]["macro"] == pytest.approx([np.percentile(macro, 2.5), np.percentile(macro, 97.5)])
    assert ci == bootstrap_auc_ci(Y, P, ["a", "b"], seed=0)  # seeded
    # an unannotated / one-outcome class has no interval
    mask = np.ones_like(Y, bool)
    mask[:, 1] = Y[:, 1] == 1
    assert bootstrap_auc_ci(Y, P, ["a", "b"], mask=mask)["auc"]["per_class"]["b"] is None


def test_paired_comparison_matches_scipy():
    a = {"c1": 0.81, "c2": 0.74, "c3": 0.69, "c4": 0.88, "c5": 0.77, "c6": 0.72}
    b = {"c1": 0.78, "c2": 0.75, "c3": 0.61, "c4": 0.85, "c5": 0.70, "c6": 0.70, "extra": 0.5}
    r = paired_comparison(a, b)
    x, y = np.array(list(a.values())), np.array([b[c] for c in a])
    d = x - y
    t_hand = d.mean() / (d.std(ddof=1) / np.sqrt(len(d)))
    assert r["n"] == 6 and r["classes"] == list(a) and r["mean_diff"] == pytest.approx(d.mean())
    assert r["t"] == pytest.approx(t_hand) and r["t"] == pytest.approx(st.ttest_rel(x, y).statistic)
    assert r["p"] == pytest.approx(st.ttest_rel(x, y).pvalue)
    assert r["shapiro_w"] == pytest.approx(st.shapiro(d).statistic)
    assert r["shapiro_p"] == pytest.approx(st.shapiro(d).pvalue)
    assert r["wilcoxon_p"] == pytest.approx(st.wilcoxon(x, y).pvalue)
    assert r["significant"] == (r["p"] < 0.05)
    assert paired_comparison({"c": 0.5}, {"c": 0.5})["p"] is None  # undefined, not an error


def test_own_class_scores_and_pooled_intervals_in_results():
    per_site = {
        "s1": {"per_class": {"a": {"auc": 0.9}, "b": {"auc": 0.5}}},
        "s2": {"per_class": {"a": {"auc": 0.7}, "b": {"auc": 0.8}}},
    }
    r = own_class_scores(per_site, {"s1": [True, False], "s2": [True, True]}, ["a", "b"])
    assert r["per_class"] == pytest.approx({"a": 0.8, "b": 0.8}) and r["sites"]["b"] == ["s2"]
    results = {
        "method": "pfl",
        "local_parts": ["norm", "classifier"],
        "rounds": [
            {"val": {"n_sites": 2, "ci": {"auc": {}}}, "test": {"n_sites": 1, "ci": {"auc": {"macro": [0.1, 0.2]}}}}
        ],
        "final": {
            "m": {
                "test": {"per_class": {"a": {}, "b": {}}, "n_sites": 2, "ci": {}},
                "per_site": {s: {"test": v} for s, v in per_site.items()},
            }
        },
    }
    add_run_statistics(results, {"s1": {"annotated": [True, False]}, "s2": {"annotated": [True, True]}})
    assert results["rounds"][0]["val"]["ci"] is None and results["rounds"][0]["test"]["ci"]["auc"]["macro"]
    assert results["final"]["m"]["test"]["ci"] is None
    assert results["final"]["m"]["own_classes"]["macro"] == pytest.approx(0.8)


# ------------------------------------------------------------------------------------------ the simulator


def _tiny_ich(prepare: dict | None = None) -> dict:
    from test_jobs_simulator import TINY

    from fedpartial.data.presets import deep_merge

    return deep_merge(
        TINY["ich"], {"method_args": {"warmup_epochs": 2, "warmup_lr": 0.005}, "dataset": {"prepare": prepare or {}}}
    )


@pytest.mark.integration
def test_surgical_ich_three_rounds_two_vocabularies_warmup_and_intervals(tmp_path, data_cache):
    """Surgical aggregation (FedBN+) for 3 rounds on 3 sites of which one names the classes in another vocabulary
    (the ICH abbreviations): the warm-up round, the vocabularies read as the job's classes, the union of every
    site's classes learnt, the shared sets scored once, the final test with its bootstrap intervals."""
    from conftest import REPO, results_of, run_simulator, server_log
    from fedpartial.tools.build_jobs import customise_job

    table = [
        ["epidural", "subdural", "intraventricular"],
        ["epidural", "subdural", "intraparenchymal"],
        ["epidural", "subdural", "subarachnoid"],
    ]
    prepare = {
        "protocol": "table",
        "k": None,
        "table": table,
        "num_sites": 3,
        "vocabularies": {"site-3": "ich_abbreviations"},
    }
    # the job's default is FedBN (norm: local, measured better without pretrained weights); FedBN+ here
    args = _tiny_ich(prepare)
    args["method_args"]["norm"] = "frozen"
    job = customise_job(REPO / "jobs" / "surgical_ich", tmp_path / "job", 3, args, min_clients=3)
    ws = tmp_path / "ws"
    proc = run_simulator(job, ws, n=3, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    sites = res["data"]["sites"]
    assert sites["site-3"]["annotated"] == [0, 3, 4]  # EDH, SAH, SDH read as epidural, subarachnoid, subdural
    # the shared val / test sets are scored by their first holder only, every round and in the final evaluation
    # (tests/test_privacy.py::test_the_summary_goes_with_every_task_a_resent_one_included: why it could differ)
    assert res["final"]["FL_global_model.pt"]["sites"] == ["site-1"]  # the shared test set, scored once
    assert all(r["evaluated_by"]["val"] == ["site-1"] for r in res["rounds"])
    assert res["num_rounds"] == 3 and res["method_options"]["norm"] == "frozen"
    assert res["method_options"]["site_weighting"] == res["method_options"]["row_weighting"] == "uniform"
    r0 = res["rounds"][0]
    assert sorted(r0["site_stats"]) == ["site-1", "site-2", "site-3"]
    assert all(s["surgical_warmup"][0] == 2 and s["surgical_norm_from_warmup"] for s in r0["site_stats"].values())
    assert all("surgical_warmup" not in s for s in res["rounds"][1]["site_stats"].values())
    final = res["final"]["FL_global_model.pt"]["test"]
    assert all(v["auc"] is not None for v in final["per_class"].values())  # every class of the union predicted
    ci = final["ci"]["auc"]
    assert final["ci"]["n_resamples"] == 100
    for c, v in final["per_class"].items():
        lo, hi = ci["per_class"][c]
        assert lo <= hi and 0 <= lo <= 1 and 0 <= hi <= 1
