"""What leaves a site: declared per-class statistics, minimum count, clipping, the Gaussian mechanism and its
accounting, the site privacy filter, the summary each site receives, paths, and the ledger."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext

from fedpartial.privacy import (
    ClassStat,
    clip_rows,
    epsilon_spent,
    noise_multiplier,
    release,
    stat_sensitivity,
    strip_paths,
    suppress_metrics,
    suppress_small,
)

PROTO = (ClassStat("counts", "count"), ClassStat("p0", "mean", "counts", 0), ClassStat("p1", "mean", "counts", 1))


# ------------------------------------------------------------------------------------------ declarations
def test_every_method_that_sends_per_class_statistics_declares_them():
    from fedpartial.methods import get_method

    declared = {
        m: {s.key for s in get_method(m).trainer.per_class_metadata}
        for m in ("fedmlp", "fedlsm", "fedirm", "fednoro", "cbafed")
    }
    assert declared["fedmlp"] == {"fedmlp_p0", "fedmlp_p1", "fedmlp_proto_counts"}
    assert declared["fedlsm"] == {"fedlsm_q"} and declared["fedirm"] == {"fedirm_relation"}
    assert declared["fednoro"] == {"fednoro_class_loss", "fednoro_class_count"}
    assert declared["cbafed"] == {"cbafed_counts", "cbafed_pseudo_positives"}
    assert get_method("fedavg").trainer.per_class_metadata == ()


def test_fl_package_names_no_method():
    from pathlib import Path

    import fedpartial.fl as fl

    names = ("fedmlp", "fedlsm", "fedirm", "fednoro", "cbafed")
    for f in Path(fl.__file__).parent.glob("*.py"):
        text = f.read_text().lower()
        if f.name in ("data_check.py", "privacy.py"):
            assert not [n for n in names if n in text], f.name


# ------------------------------------------------------------------------------------------ minimum count
def test_support_rows_are_dropped_with_their_valid_flag():
    stats = (ClassStat("rel", "mean", "support", valid="valid", dp=False),)
    meta = {"rel": np.ones((3, 3)), "valid": [1, 1, 1]}
    out, dropped = suppress_small(meta, stats, 5, support=np.array([2, 9, 0]))
    # row 2 is filled although the site annotates no positive of class 2 (pseudo labels): not sent either
    assert out["rel"][0].tolist() == [0, 0, 0] and out["rel"][1].tolist() == [1, 1, 1]
    assert out["rel"][2].tolist() == [0, 0, 0]
    assert out["valid"] == [0, 1, 0] and dropped == ["rel[0]", "rel[2]"]
    assert meta["valid"] == [1, 1, 1]
    out, dropped = suppress_small({"rel": np.ones((3, 3)), "valid": [1, 1, 0]}, stats, 5, support=np.array([9, 9, 0]))
    assert dropped == [] and out["valid"] == [1, 1, 0]


def test_per_class_metrics_from_fewer_than_min_count_are_suppressed():
    from fedpartial.metrics import multilabel_metrics

    y = np.array([[1, 1], [0, 1], [0, 0], [0, 1], [0, 0], [0, 1], [0, 0], [0, 1], [0, 0], [0, 1], [0, 0], [0, 0]])
    p = np.linspace(0.1, 0.9, 24).reshape(12, 2)
    res = multilabel_metrics(y, p, ["a", "b"])
    assert res["per_class"]["a"]["auc"] is not None  # 1 positive: AUC is defined ...
    out, small = suppress_metrics(res, y.sum(0), (1 - y).sum(0), 5)
    assert small == ["a"] and all(v is None for v in out["per_class"]["a"].values())  # ... and stays here
    assert out["per_class"]["b"] == res["per_class"]["b"]
    assert out["macro"]["auc"] == pytest.approx(res["per_class"]["b"]["auc"])  # the macro of what is left
    assert sum(out["score_hist"]["pos"][0]) == 0 and sum(out["score_hist"]["pos"][1]) == 6
    assert suppress_metrics(res, y.sum(0), (1 - y).sum(0), 1)[1] == []
    # the class's bootstrap interval stays too (it bounds the suppressed AUROC); the macro interval was resampled
    # over every class, so it cannot stand for the classes left
    from fedpartial.stats import bootstrap_auc_ci

    res["ci"] = bootstrap_auc_ci(y, p, ["a", "b"], n_resamples=50)
    assert res["ci"]["auc"]["per_class"]["a"] is not None
    out, _ = suppress_metrics(res, y.sum(0), (1 - y).sum(0), 5)
    assert out["ci"]["auc"]["per_class"] == {"a": None, "b": res["ci"]["auc"]["per_class"]["b"]}
    assert out["ci"]["auc"]["macro"] is None and out["ci"]["n_resamples"] == 50
    assert res["ci"]["auc"]["per_class"]["a"] is not None  # the site's own result is not modified


# ------------------------------------------------------------------------------------------ clipping, noise
def test_clip_rows_by_hand():
    import torch

    x = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    assert np.allclose(clip_rows(x, 1.0), [[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]])
    t = clip_rows(torch.tensor(x), 2.5)
    assert np.allclose(t.numpy(), [[1.5, 2.0], [0.3, 0.4], [0.0, 0.0]])
    assert clip_rows(x, None) is x


def test_sensitivity_and_noise_scale_by_hand():
    assert stat_sensitivity(PROTO[0], 4, None) == 2.0  # one image counts once per class: sqrt(4)
    assert stat_sensitivity(PROTO[1], 4, 0.5) == 1.0  # its clipped feature enters one row per class: 0.5 * sqrt(4)
    with pytest.raises(ValueError, match="feature_clip"):
        stat_sensitivity(PROTO[1], 4, None)
    # the released values, drawn with the same generator in the documented order (counts, then row sums)
    counts = np.array([[40, 60], [0, 30]])
    p0, p1 = np.full((2, 3), 0.1, np.float32), np.full((2, 3), 0.2, np.float32)
    meta = {"counts": counts, "p0": p0, "p1": p1}
    z, C = 0.7, 2
    out, ledger = release(meta, PROTO, z, n_train=100, min_count=5, feature_clip=1.0, rng=np.random.default_rng(3))
    g = np.random.default_rng(3)
    nc = np.clip(counts + g.normal(0, z * math.sqrt(C), (2, 2)), 0, 100)
    s0 = (p0 * counts[:, [0]] + g.normal(0, z * 1.0 * math.sqrt(C), (2, 3))) / np.maximum(nc[:, [0]], 1)
    s0[nc[:, 0] < 5] = 0
    assert np.allclose(out["p0"], s0.astype(np.float32), rtol=1e-5)
    exp_counts = np.rint(nc)
    exp_counts[exp_counts < 5] = 0
    assert out["counts"].tolist() == exp_counts.astype(int).tolist()
    assert out["counts"][1, 0] == 0 and out["p0"][1].tolist() == [0, 0, 0]  # an empty row stays below min_count
    assert [e["name"] for e in ledger] == ["counts", "p0", "p1"]
    assert ledger[0]["noise_std"] == pytest.approx(z * math.sqrt(2)) and ledger[1]["noise_std"] == pytest.approx(
        z * math.sqrt(2)
    )
    assert ledger[1]["shape"] == [2, 3] and all(e["noise_multiplier"] == z for e in ledger)


def test_noise_has_the_stated_standard_deviation():
    stats = (ClassStat("q", "count"),)
    q = np.full(4, 5000.0)
    draws = np.stack(
        [release({"q": q}, stats, 1.5, 10**6, 1, None, np.random.default_rng(i))[0]["q"] for i in range(1500)]
    )
    assert draws.std() == pytest.approx(1.5 * 2.0, rel=0.05)  # z * sqrt(C), C = 4
    assert abs(draws.mean() - 5000) < 0.3


def test_a_statistic_not_clipped_per_image_cannot_be_noised():
    stats = (ClassStat("rel", "mean", "support", dp=False),)
    with pytest.raises(ValueError, match="cannot be released with noise"):
        release({"rel": np.ones((2, 2))}, stats, 1.0, 10, 5, 1.0, np.random.default_rng(0))


# ------------------------------------------------------------------------------------------ accounting
def test_calibrated_multiplier_spends_the_budget_over_the_planned_rounds():
    z = noise_multiplier(4.0, 1e-5, rounds=20, releases_per_round=3)
    assert epsilon_spent([z] * 60, 1e-5) == pytest.approx(4.0, rel=1e-3)
    assert epsilon_spent([z] * 30, 1e-5) < 4.0 * 0.8  # a site that sat half the rounds out spent less
    assert noise_multiplier(1.0, 1e-5, 20, 3) > noise_multiplier(8.0, 1e-5, 20, 3) > 0
    assert epsilon_spent([], 1e-5) == 0.0 and math.isinf(epsilon_spent([z, 0.0], 1e-5))


def test_epsilon_of_a_known_schedule_against_the_library_and_the_classic_bound():
    """10 Gaussian releases of multiplier 2: the library's RDP accountant (what epsilon_spent must equal), its
    PLD accountant (tighter), and the classic RDP conversion min_a T a / (2 z^2) + log(1/delta) / (a - 1)
    (looser) computed by hand."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant
    from dp_accounting.rdp import RdpAccountant

    z, T, delta = 2.0, 10, 1e-5
    ours = epsilon_spent([z] * T, delta)
    rdp = RdpAccountant()
    rdp.compose(dp_accounting.GaussianDpEvent(z), T)
    assert ours == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)
    pld = PLDAccountant()
    pld.compose(dp_accounting.GaussianDpEvent(z), T)
    classic = min(T * a / (2 * z * z) + math.log(1 / delta) / (a - 1) for a in np.linspace(1.01, 200, 40000))
    assert pld.get_epsilon(delta) < ours <= classic
    # by hand: with r = T / (2 z^2) = 1.25 and L = log(1e5), the minimum is r + 2 sqrt(r L) = 8.837
    assert classic == pytest.approx(1.25 + 2 * math.sqrt(1.25 * math.log(1e5)), abs=1e-3)
    assert classic == pytest.approx(8.837, abs=1e-3)


# ------------------------------------------------------------------------------------------ paths
def test_no_absolute_path_survives():
    text = "site 'h2': cannot read '/secret/hosp/manifests/train.csv' row 3 (image /data/root/scans/1.png)"
    out = strip_paths(text, ["/data/root"])
    assert out == "site 'h2': cannot read 'train.csv' row 3 (image scans/1.png)"
    assert strip_paths("see ./local/x.json and a/b.csv", []) == "see ./local/x.json and a/b.csv"


# ------------------------------------------------------------------------------------------ the site filter
def _ctx(props: dict | None, scope: str = "strict", site: str = "hospital-3") -> FLContext:
    from unittest import mock

    ctx = FLContext()
    if props is not None:
        ctx.set_prop(FLContextKey.SCOPE_PROPERTIES, props, private=True, sticky=False)
        ctx.set_prop(FLContextKey.EFFECTIVE_JOB_SCOPE_NAME, scope, private=True, sticky=False)
    ctx.get_identity_name = mock.Mock(return_value=site)
    return ctx


def _update(counts, p1, rnd=0, num_rounds=4):
    from fedpartial.privacy import as_dicts

    entry = {
        "round": rnd,
        "num_rounds": num_rounds,
        "scope": "",
        "min_count": 5,
        "declared": as_dicts(PROTO),
        "released": [{"name": k, "noise_multiplier": 0.0} for k in ("counts", "p0", "p1")],
    }
    meta = {
        "counts": np.asarray(counts),
        "p0": np.zeros_like(p1),
        "p1": p1,
        "n_train": 200,
        "fedpartial_privacy": entry,
        "fedpartial_results": {"val": {"macro": {}, "per_class": {}, "score_hist": {"pos": [[1]]}}},
    }
    return DXO(data_kind=DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta=meta)


STRICT = {"min_count": 20, "score_histograms": False, "epsilon": 4.0, "delta": 1e-5, "feature_clip": 1.0}


def test_strict_scope_noises_thresholds_and_records_the_release():
    from fedpartial.fl.privacy import SitePrivacyFilter

    counts = [[100, 100], [100, 12]]  # class 1's positive prototype from 12 images
    p1 = np.full((2, 8), 0.3, np.float32)
    dxo = SitePrivacyFilter(seed=0).process_dxo(_update(counts, p1), None, _ctx(STRICT))
    meta = dxo.meta
    entry = meta["fedpartial_privacy"]
    z = noise_multiplier(4.0, 1e-5, rounds=4, releases_per_round=3)
    assert entry["scope"] == "strict" and entry["min_count"] == 20
    assert [e["noise_multiplier"] for e in entry["released"]] == pytest.approx([z] * 3)
    assert entry["budget"] == {"epsilon": 4.0, "delta": 1e-5, "planned_rounds": 4}
    assert not np.allclose(meta["p1"][0], 0.3) and np.abs(meta["p1"][0] - 0.3).max() < 1.0  # noised
    assert meta["counts"][1, 1] == 0 and meta["p1"][1].tolist() == [0] * 8  # below 20 after the noise: dropped
    assert "score_hist" not in meta["fedpartial_results"]["val"]


def test_standard_scope_thresholds_without_noise():
    from fedpartial.fl.privacy import SitePrivacyFilter

    p1 = np.full((2, 8), 0.3, np.float32)
    dxo = SitePrivacyFilter().process_dxo(
        _update([[100, 100], [100, 7]], p1), None, _ctx({"min_count": 10, "score_histograms": True}, "standard")
    )
    meta = dxo.meta
    assert meta["p1"][0].tolist() == pytest.approx([0.3] * 8) and meta["p1"][1].tolist() == [0] * 8
    assert meta["counts"].tolist() == [[100, 100], [100, 0]]
    assert meta["fedpartial_privacy"]["min_count"] == 10 and "budget" not in meta["fedpartial_privacy"]
    assert "score_hist" in meta["fedpartial_results"]["val"]


def test_data_check_answer_reports_small_counts_as_zero():
    from fedpartial.fl.privacy import SitePrivacyFilter

    info = {"positives": [2, 30, 0], "negatives": [50, 5, 9], "annotated": [True, True, False]}
    dxo = DXO(data_kind=DataKind.COLLECTION, data={}, meta={"fedpartial_data_summary": info})
    out = (
        SitePrivacyFilter().process_dxo(dxo, None, _ctx({"min_count": 10}, "standard")).meta["fedpartial_data_summary"]
    )
    assert out["positives"] == [0, 30, 0] and out["negatives"] == [50, 0, 0] and out["min_count"] == 10


def test_method_that_cannot_be_noised_stops_with_a_clear_message():
    from fedpartial.fl.privacy import check_method_under_policy
    from fedpartial.methods import get_method

    irm = get_method("fedirm").trainer.per_class_metadata
    with pytest.raises(ValueError, match=r"site 'hospital-3'.*'strict'.*method 'fedirm'.*cannot run under"):
        check_method_under_policy(irm, STRICT, "fedirm", "hospital-3", "strict")
    check_method_under_policy(irm, {"min_count": 5}, "fedirm", "hospital-3", "standard")
    check_method_under_policy(get_method("fedmlp").trainer.per_class_metadata, STRICT, "fedmlp", "h", "strict")
    with pytest.raises(ValueError, match="feature_clip"):
        check_method_under_policy(
            get_method("fedmlp").trainer.per_class_metadata,
            {k: v for k, v in STRICT.items() if k != "feature_clip"},
            "fedmlp",
            "h",
            "strict",
        )


def test_bad_scope_properties_name_the_scope():
    from fedpartial.fl.privacy import scope_of

    with pytest.raises(ValueError, match="privacy scope 'strict': epsilon"):
        scope_of(_ctx({"epsilon": -1, "delta": 1e-5}))
    with pytest.raises(ValueError, match="min_count"):
        scope_of(_ctx({"min_count": 0}))
    assert scope_of(_ctx(None)) == ("", {})


# ------------------------------------------------------------------------------------------ summary to sites
def test_each_site_receives_only_federation_totals_and_which_sets_it_scores():
    from fedpartial.fl.data_check import site_summary
    from fedpartial.methods.base import summary_counts

    summary = {
        "classes": ["a", "b"],
        "sites": {
            "h1": {
                "n_train": 30,
                "annotated": [True, False],
                "positives": [10, 0],
                "negatives": [20, 0],
                "eval_sets": {"val": "V", "test": "T1"},
                "origin": "site-config",
            },
            "h2": {
                "n_train": 40,
                "annotated": [True, True],
                "positives": [0, 25],
                "negatives": [33, 15],
                "eval_sets": {"val": "V", "test": "T2"},
            },
        },
    }
    out = site_summary(summary, "h2")
    assert set(out["sites"]) == {"federation"} and "h1" not in json.dumps(out)
    fed = out["sites"]["federation"]
    assert fed["positives"] == [10, 25] and fed["negatives"] == [53, 15] and fed["n_train"] == 70
    assert out["scores"] == {"val": False, "test": True}  # the shared val set is h1's to score
    assert site_summary(summary, "h1")["scores"] == {"val": True, "test": True}
    pos, neg = summary_counts(out, 2)
    assert pos.tolist() == [10, 25] and neg.tolist() == [53, 15]


# ------------------------------------------------------------------------------------------ ledger
def test_ledger_totals_compose_what_was_released():
    from fedpartial.fl.privacy import ledger_totals
    from fedpartial.tools.show_results import privacy_table

    z = 3.0
    noised = {
        "scope": "strict",
        "min_count": 20,
        "budget": {"epsilon": 4.0, "delta": 1e-5, "planned_rounds": 3},
        "released": [{"name": "q", "noise_multiplier": z}],
    }
    plain = {"scope": "standard", "min_count": 5, "released": [{"name": "q", "noise_multiplier": 0.0}]}
    rounds = [
        {"privacy": {"h1": noised, "h2": plain}},
        {"privacy": {"h1": noised, "h2": plain}},
        {"privacy": {"h2": plain}},
    ]  # h1 sat the last round out
    t = ledger_totals(rounds)
    assert t["h1"]["releases"] == 2 and t["h1"]["epsilon"] == pytest.approx(epsilon_spent([z, z], 1e-5))
    assert t["h2"]["releases"] == 3 and t["h2"]["epsilon"] is None  # no noise: no formal guarantee
    from fedpartial.fl.privacy import add_cumulative_epsilon

    rounds = json.loads(json.dumps(rounds))
    add_cumulative_epsilon(rounds)
    assert [r["privacy"]["h1"]["cumulative_epsilon"] for r in rounds[:2]] == pytest.approx(
        [epsilon_spent([z], 1e-5), epsilon_spent([z, z], 1e-5)]
    )
    assert rounds[2]["privacy"]["h2"]["cumulative_epsilon"] is None
    table = privacy_table({"privacy": t})
    assert f"{t['h1']['epsilon']:.3g}" in table and "inf" in table.splitlines()[-1]


# ------------------------------------------------------------------------------------------ scopes in jobs
def test_set_privacy_scope_on_a_job_folder(tmp_path):
    from fedpartial.fl.privacy import set_privacy_scope

    (tmp_path / "meta.json").write_text(json.dumps({"name": "j", "deploy_map": {"app": ["@ALL"]}}))
    set_privacy_scope(tmp_path, "strict")
    assert json.loads((tmp_path / "meta.json").read_text())["scope"] == "strict"
    with pytest.raises(ValueError):
        set_privacy_scope(tmp_path, "")


def test_sample_policy_and_the_strict_site_policy():
    from pathlib import Path

    from fedpartial.fl.privacy import POLICY_FILE, site_policy

    repo = Path(__file__).resolve().parents[1]
    sample = json.loads((repo / "provisioning" / "privacy.json").read_text())
    assert sample == json.loads(POLICY_FILE.read_text())
    scopes = {s["name"]: s for s in sample["scopes"]}
    assert sample["default_scope"] == "standard" and set(scopes) == {"standard", "strict"}
    assert scopes["standard"]["properties"]["min_count"] == 5
    assert scopes["strict"]["properties"]["min_count"] > 5 and not scopes["strict"]["properties"]["score_histograms"]
    strict = site_policy(strict=True)
    assert [s["name"] for s in strict["scopes"]] == ["standard", "strict"]
    assert all(s["properties"] == scopes["strict"]["properties"] for s in strict["scopes"])


# ------------------------------------------------------------------------------------------ the executor's side
def test_a_manifest_outside_the_data_root_leaves_by_file_name_only(tmp_path):
    from fedpartial.data.site_config import SiteData
    from fedpartial.fl.executor import PartialLabelExecutor

    ex = PartialLabelExecutor(dataset="ich_phantom")
    root, kit = tmp_path / "data", tmp_path / "kits" / "hospital-2"
    ex.site_data = SiteData(
        "hospital-2",
        "ich_phantom",
        root,
        tmp_path / "elsewhere" / "train.csv",
        None,
        None,
        origin="site-config:" + str(kit / "local" / "fedpartial_data.json"),
    )
    ex._ws_root = str(kit)
    msg = ex._relative(
        f"bad row 4 of {tmp_path}/elsewhere/train.csv (image {root}/scans/1.png); see {kit}/local/fedpartial_data.json"
    )
    assert str(tmp_path) not in msg
    assert msg == "bad row 4 of train.csv (image scans/1.png); see fedpartial_data.json"
    ex.site_data = None  # before the site's data configuration is found: paths relative to the kits' folder
    assert (
        ex._relative(f"no data configured: put it in {kit}/local/fedpartial_data.json")
        == "no data configured: put it in hospital-2/local/fedpartial_data.json"
    )


def test_without_histograms_each_site_chooses_thresholds_on_its_own_validation_data():
    from types import SimpleNamespace

    from fedpartial.fl.executor import PartialLabelExecutor
    from fedpartial.metrics import multilabel_metrics, thresholds_from_histogram

    rng = np.random.default_rng(0)
    y = (rng.random((60, 2)) < 0.4).astype(int)
    p = np.clip(0.3 * y + 0.7 * rng.random((60, 2)), 0, 1)
    val, test = multilabel_metrics(y[:40], p[:40], ["a", "b"]), multilabel_metrics(y[40:], p[40:], ["a", "b"])
    ex = PartialLabelExecutor(dataset="ich_phantom")
    ex.ctx = SimpleNamespace(site="h3")
    ex.site_privacy = {"score_histograms": True}
    assert "score_hist" in ex._site_thresholds({"val": val, "test": test})["val"]  # standard: the server chooses
    ex.site_privacy = {"score_histograms": False}
    out = ex._site_thresholds({"val": val, "test": test})
    assert "score_hist" not in out["val"] and "score_hist" not in out["test"]
    thr = thresholds_from_histogram(val["score_hist"])  # the site's own validation histogram
    expected = multilabel_metrics(y[40:], p[40:], ["a", "b"], threshold=thr)
    assert out["test"]["per_class"]["a"]["bacc_val_thr"] == pytest.approx(expected["per_class"]["a"]["bacc"])


def test_the_servers_table_shows_small_counts_as_below_the_minimum():
    from fedpartial.fl.data_check import summary_table

    table = summary_table(
        {
            "classes": ["a", "b", "c"],
            "sites": {"h1": {"n_train": 50, "positives": [0, 30, 0], "annotated": [True, True, False], "min_count": 5}},
        }
    )
    row = table.splitlines()[1].split()
    assert row == ["h1", "50", "<5", "30", "-"]


def test_fedmlp_prototypes_are_means_of_features_clipped_to_the_sites_bound(tmp_path):
    import torch
    from test_fedmlp import _site

    from fedpartial.methods import fedmlp as M
    from fedpartial.methods.fedmlp.maths import class_prototypes

    ctx = _site("x", [True, True, False], tmp=tmp_path)
    tr = M.FedMLPTrainer(ctx, warmup_rounds=1)
    labels, mask = tr._label_table()
    n = labels.shape[0]
    feats, _ = tr._features(ctx.model, n)
    bound = 0.5 * float(feats.norm(dim=1).min())  # every feature is longer: every one is clipped
    plain = tr._local_statistics(ctx.model, labels, mask, n)
    ctx.privacy = {"feature_clip": bound}
    clipped = tr._local_statistics(ctx.model, labels, mask, n)
    p0, p1, counts = class_prototypes(clip_rows(feats, bound), labels, mask & torch.as_tensor(ctx.annotated)[None])
    assert np.allclose(clipped[M.META_P1], p1.numpy(), atol=1e-6) and np.allclose(
        clipped[M.META_P0], p0.numpy(), atol=1e-6
    )
    assert (np.linalg.norm(clipped[M.META_P1], axis=1) <= bound + 1e-6).all()
    assert not np.allclose(plain[M.META_P1], clipped[M.META_P1])
    assert np.array_equal(plain[M.META_COUNTS], clipped[M.META_COUNTS])


def test_the_executor_keeps_per_class_metrics_of_small_classes(monkeypatch):
    from types import SimpleNamespace

    import fedpartial.fl.executor as E
    from fedpartial.metrics import multilabel_metrics

    y = np.array([[1, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0], [0, 0]])
    res = multilabel_metrics(y, np.linspace(0.1, 0.9, 22).reshape(11, 2), ["a", "b"])
    monkeypatch.setattr(E, "evaluate", lambda *a, **k: res)
    ex = E.PartialLabelExecutor(dataset="ich_phantom")
    ex.manifests = {"val": SimpleNamespace(positives=lambda: y.sum(0), negatives=lambda: (1 - y).sum(0))}
    ex.scores = lambda split: True
    ex.eval_opts, ex.data = (
        SimpleNamespace(batch_size=4),
        SimpleNamespace(eval_loader=lambda split, batch_size, device=None: None),
    )
    ex.net, ex.task_type, ex.classes, ex.torch_device, ex.min_count_eff = None, "multilabel", ["a", "b"], None, 5
    out = ex._evaluate_split("val")
    assert out["per_class"]["a"]["auc"] is None and out["per_class"]["b"]["auc"] == res["per_class"]["b"]["auc"]
    ex.min_count_eff = 1
    assert ex._evaluate_split("val")["per_class"]["a"]["auc"] == res["per_class"]["a"]["auc"]


def test_the_executor_ledger_entry_names_what_leaves():
    from types import SimpleNamespace

    from fedpartial.fl.executor import PartialLabelExecutor

    ex = PartialLabelExecutor(dataset="ich_phantom")
    ex.trainer = SimpleNamespace(per_class_metadata=PROTO)
    ex.manifests = {"train": SimpleNamespace(positives=lambda: np.array([9, 9]))}
    ex.site_privacy, ex.min_count_eff, ex.scope = {}, 5, "standard"
    meta = {"counts": np.array([[40, 3], [9, 20]]), "p0": np.ones((2, 4)), "p1": np.ones((2, 4)), "x": 1}
    out, entry = ex._privacy_entry(meta, rnd=3, num_rounds=10)
    assert out["counts"].tolist() == [[40, 0], [9, 20]] and out["p1"][0].tolist() == [0] * 4
    assert entry["round"] == 3 and entry["num_rounds"] == 10 and entry["scope"] == "standard"
    assert [(r["name"], r["shape"], r["min_count"], r["noise_std"]) for r in entry["released"]] == [
        ("counts", [2, 2], 5, 0.0),
        ("p0", [2, 4], 5, 0.0),
        ("p1", [2, 4], 5, 0.0),
    ]
    ex.site_privacy = dict(STRICT)  # under noise: thresholded after the noise, by the site's filter
    out, _ = ex._privacy_entry(meta, rnd=3, num_rounds=10)
    assert out["counts"].tolist() == [[40, 3], [9, 20]]
    ex.trainer = SimpleNamespace(per_class_metadata=())
    assert ex._privacy_entry(meta, 0, 1) == (meta, None)


def test_the_summary_goes_with_every_task_a_resent_one_included():
    """NVFlare resends a task whose delivery was lost: the resent task must carry the summary too (a site that
    trained without it scored every shared evaluation set, counting a shared test set twice)."""
    from unittest import mock

    from fedpartial.fl.data_check import SummaryFilter

    summary = {
        "classes": ["a"],
        "sites": {
            "h1": {"n_train": 3, "positives": [1], "negatives": [2], "annotated": [True], "eval_sets": {"test": "fp"}},
            "h2": {"n_train": 4, "positives": [0], "negatives": [4], "annotated": [True], "eval_sets": {"test": "fp"}},
        },
    }
    comp = mock.Mock(summary=summary)

    def ctx(site):
        c = mock.Mock()
        c.get_engine.return_value.get_component.return_value = comp
        c.get_peer_context.return_value.get_identity_name.return_value = site
        return c

    def sent(f, site):
        dxo = DXO(data_kind=DataKind.WEIGHTS, data={"w": np.zeros(1)})
        return f.process_dxo(dxo, None, ctx(site)).get_meta_prop("fedpartial_data_summary")

    # as NVFlare delivers a broadcast task: one task data, a shallow copy per site, the filter on each copy
    from nvflare.apis.dxo import from_shareable
    from nvflare.apis.shareable import make_copy

    task = DXO(data_kind=DataKind.WEIGHTS, data={"w": np.zeros(1)}, meta={"round": 0}).to_shareable()
    copies = {site: make_copy(task) for site in ("h1", "h2")}
    f = SummaryFilter()
    for site, c in copies.items():
        f.process(c, ctx(site))
    got = {site: from_shareable(c).get_meta_prop("fedpartial_data_summary")["scores"] for site, c in copies.items()}
    assert got == {"h1": {"test": True}, "h2": {"test": False}}  # each site its own, whatever the order
    assert "fedpartial_data_summary" not in from_shareable(task).meta and from_shareable(task).meta == {"round": 0}

    first = sent(f, "h1")
    assert first["sites"]["federation"]["positives"] == [1] and first["sites"]["federation"]["n_train"] == 7
    assert first["scores"] == {"test": True}  # the first holder by name scores the shared set
    again = sent(f, "h1")  # the same task resent after a lost delivery, or the next round's
    assert again == first
    assert sent(f, "h2")["scores"] == {"test": False} and sent(f, "h2")["scores"] == {"test": False}
    with mock.patch.object(f, "logger") as log:  # the scoring is logged once per site and summary
        sent(f, "h1")
        log.info.assert_not_called()
        comp.summary = {**summary}  # a new data check (a resumed job): logged again
        sent(f, "h1")
        log.info.assert_called_once()
