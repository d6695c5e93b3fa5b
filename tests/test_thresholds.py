"""Per-class operating thresholds chosen on validation: the selection by hand (Youden's J / balanced accuracy and
F1, ties), the sites' score histograms and the server's pooled choice, the results.json record and
fedpartial-predict / fedpartial-evaluate ``--thresholds``."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fedpartial.fl.keys import BEST_MODEL, LAST_MODEL
from fedpartial.fl.report import THRESHOLDS_FILE, render_tables
from fedpartial.fl.results import ResultsRecorder, model_thresholds
from fedpartial.metrics import (
    SCORE_GRID,
    apply_validation_thresholds,
    best_threshold,
    histogram_metrics,
    multiclass_metrics,
    multilabel_metrics,
    score_histogram,
    select_thresholds,
    thresholds_from_histogram,
)

# Hand example (one class), scores sorted:  0.1  0.3  0.35  0.4  0.6  0.8
#                                   labels:   0    0    1    0    1    1      P = 3, N = 3
# threshold  TP FP   J = TPR - FPR   F1 = 2TP / (2TP + FP + FN)
#   0.8       1  0   1/3 - 0 = 1/3   2 / (2 + 0 + 2) = 0.5
#   0.6       2  0   2/3             4 / (4 + 0 + 1) = 0.8
#   0.4       2  1   1/3             4 / (4 + 1 + 1) = 0.667
#   0.35      3  1   2/3             6 / (6 + 1 + 0) = 0.857   <- F1's best
#   0.3       3  2   1/3             6 / 8 = 0.75
#   0.1       3  3   0               6 / 9 = 0.667
# J ties at 0.6 and 0.35 (2/3): the highest, 0.6, is chosen (fewest positive predictions).
Y = np.array([0, 0, 1, 0, 1, 1])
S = np.array([0.1, 0.3, 0.35, 0.4, 0.6, 0.8])


def test_best_threshold_by_hand_both_criteria_and_the_tie_rule():
    assert best_threshold(Y, S, "youden") == 0.6  # tie with 0.35: the higher one
    assert best_threshold(Y, S, "bacc") == 0.6  # bacc = (1 + J) / 2: same maximiser
    assert best_threshold(Y, S, "f1") == 0.35
    # order of the rows does not matter
    perm = np.array([3, 0, 5, 1, 4, 2])
    assert best_threshold(Y[perm], S[perm], "f1") == 0.35
    # a negative at 0.5 lowers J(0.35) to 1 - 2/4 = 1/2: 0.6 (J = 2/3) is the only maximiser
    assert best_threshold(np.r_[Y, 0], np.r_[S, 0.5], "youden") == 0.6
    # a positive at 0.5: J(0.5) = 3/4 - 0 beats J(0.6) = 2/4 and J(0.35) = 1 - 1/3
    assert best_threshold(np.r_[Y, 1], np.r_[S, 0.5], "youden") == 0.5
    # weights act as repeated rows: the positive at 0.35 counted 3 times makes J(0.35) = 1 - 1/3 > J(0.6) = 2/5
    w = np.array([1, 1, 3, 1, 1, 1])
    assert best_threshold(Y, S, "youden", sample_weight=w) == 0.35
    assert best_threshold(np.repeat(Y, w), np.repeat(S, w), "youden") == 0.35
    assert best_threshold([1, 1], [0.2, 0.7]) is None  # one outcome only
    with pytest.raises(ValueError, match="criterion"):
        best_threshold(Y, S, "accuracy")


def test_select_thresholds_per_class_over_annotated_rows():
    probs = np.stack([S, S[::-1]], axis=1)
    y = np.stack([Y, np.ones(6, int)], axis=1)
    mask = np.ones_like(y, bool)
    assert select_thresholds(y, probs, mask) == [0.6, None]  # class 2: positives only
    # class 2 anti-ranked: its one negative scores highest (0.8), so FPR = 1 below 0.8 and J <= 0 everywhere;
    # the maximum, 0, is "everything positive": the lowest score
    y[0, 1] = 0
    assert select_thresholds(y, probs, mask) == [0.6, 0.1]
    # class 1 without the negative at 0.4 (row 3, not annotated): J(0.35) = 1 - 0 is the unique best
    mask[3, 0] = False
    assert select_thresholds(y, probs, mask, "youden") == [0.35, 0.1]
    assert select_thresholds(y, probs, mask, "f1")[0] == 0.35  # F1 = 6 / 6


def test_score_histogram_bins_match_the_threshold_rule():
    assert SCORE_GRID[0] == 0.0 and SCORE_GRID[81] == 0.5 and np.all(np.diff(SCORE_GRID) > 0)
    rng = np.random.default_rng(0)
    p = np.r_[rng.random(200), SCORE_GRID[[0, 5, 81, 120]], 1.0]  # grid values land in their own bin
    y = (rng.random(len(p)) < 0.4).astype(int)
    h = score_histogram(y[:, None], p[:, None], ["a"])
    pos, neg = np.array(h["pos"][0]), np.array(h["neg"][0])
    assert pos.sum() == y.sum() and neg.sum() == (1 - y).sum()
    for j in range(len(SCORE_GRID)):  # "p >= SCORE_GRID[j]" == "in bin j or above"
        assert pos[j:].sum() == int(((p >= SCORE_GRID[j]) & (y == 1)).sum())
        assert neg[j:].sum() == int(((p >= SCORE_GRID[j]) & (y == 0)).sum())
    masked = score_histogram(y[:, None], p[:, None], ["a"], mask=(p > 0.5)[:, None])
    assert sum(masked["pos"][0]) + sum(masked["neg"][0]) == int((p > 0.5).sum())


def _on_grid(idx):
    return SCORE_GRID[np.asarray(idx)]


def test_histogram_thresholds_equal_the_raw_choice_on_grid_scores():
    s = _on_grid([10, 30, 35, 40, 60, 80])  # the hand example's order: same choices, at grid values
    h = score_histogram(Y[:, None], s[:, None], ["a"])
    assert thresholds_from_histogram(h, "youden") == [SCORE_GRID[60]] == [best_threshold(Y, s)]
    assert thresholds_from_histogram(h, "f1") == [SCORE_GRID[35]]


def test_histogram_metrics_equal_multilabel_metrics():
    rng = np.random.default_rng(1)
    y = (rng.random((150, 3)) < 0.3).astype(int)
    p = np.clip(0.3 * y + 0.7 * rng.random(y.shape), 0, 1)
    mask = rng.random(y.shape) < 0.8
    classes = ["a", "b", "c"]
    at_half = multilabel_metrics(y, p, classes, mask=mask)
    from_hist = histogram_metrics(at_half["score_hist"], [None, 0.5, None])  # None = 0.5
    thr = thresholds_from_histogram(at_half["score_hist"])
    at_thr = multilabel_metrics(y, p, classes, threshold=thr, mask=mask)  # per-class thresholds
    from_hist_thr = histogram_metrics(at_half["score_hist"], thr)
    for c in classes:
        for m in ("bacc", "f1", "precision", "recall"):
            assert from_hist[c][m] == pytest.approx(at_half["per_class"][c][m])
            assert from_hist_thr[c][m] == pytest.approx(at_thr["per_class"][c][m])
    # the chosen thresholds maximise J on this set: BACC there is at least the 0.5 one
    assert all(at_thr["per_class"][c]["bacc"] >= at_half["per_class"][c]["bacc"] - 1e-12 for c in classes)
    assert thr != [0.5, 0.5, 0.5]


def _result(y, idx, classes=("a",)):
    return multilabel_metrics(np.asarray(y)[:, None], _on_grid(idx)[:, None], list(classes))


# two sites' validation sets: the hand example split in two; alone, site A's best J threshold is grid[35]
VAL_A = ([0, 0, 1], [10, 30, 35])
VAL_B = ([0, 1, 1], [40, 60, 80])
TEST_A = ([1, 0, 1, 0], [70, 50, 45, 20])  # at grid[60]: TP 1 (70), FN 1 (45), FP 0, TN 2


def test_server_pools_validation_histograms_and_scores_every_set_at_the_pooled_thresholds():
    assert thresholds_from_histogram(_result(*VAL_A)["score_hist"]) == [SCORE_GRID[35]]
    per_site = {
        "site-1": {"val": _result(*VAL_A), "test": _result(*TEST_A)},
        "site-2": {"val": _result(*VAL_B)},
        "site-3": {},
    }
    before = json.dumps(per_site)
    out, record = apply_validation_thresholds(per_site, "youden")
    assert json.dumps(per_site) == before  # inputs untouched
    assert record["thresholds"] == {"a": SCORE_GRID[60]} and record["val_sets"] == 2 and record["n_val"] == {"a": 6}
    test = out["site-1"]["test"]
    assert "score_hist" not in test and "score_hist" not in out["site-2"]["val"] and out["site-3"] == {}
    # by hand at grid[60]: TPR 1/2, TNR 1 -> BACC 0.75; F1 2 / (2 + 0 + 1); precision 1; recall 1/2
    pc = test["per_class"]["a"]
    assert pc["bacc_val_thr"] == pytest.approx(0.75) and pc["f1_val_thr"] == pytest.approx(2 / 3)
    assert pc["precision_val_thr"] == 1.0 and pc["recall_val_thr"] == 0.5
    assert test["macro"]["bacc_val_thr"] == pytest.approx(0.75)
    # the 0.5-threshold numbers stay: every test score is below 0.5 (grid[81]) -> BACC 0.5, F1 0
    assert test["macro"]["bacc"] == 0.5 and test["macro"]["f1"] == 0.0
    # on validation the thresholds are in-sample: site-2 at grid[60] predicts 60 and 80: all right (BACC 1);
    # site-1 predicts nothing positive: BACC (0 + 1) / 2
    assert out["site-2"]["val"]["macro"]["bacc_val_thr"] == 1.0
    assert out["site-1"]["val"]["macro"]["bacc_val_thr"] == 0.5
    out_f1, rec_f1 = apply_validation_thresholds(per_site, "f1")
    assert rec_f1["thresholds"] == {"a": SCORE_GRID[35]}


def test_single_label_results_get_no_thresholds():
    res = multiclass_metrics(np.array([0, 1, 1]), np.array([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]]), ["x", "y"])
    out, record = apply_validation_thresholds({"site-1": {"val": res, "test": res}})
    # the one-vs-rest score histogram travels (the pooled AUROC across sites, the ROC curves), no threshold is chosen
    assert record is None and res["score_hist"]["pos"][1][-1] == 0 and sum(map(sum, res["score_hist"]["pos"])) == 3
    assert out["site-1"]["val"] == {k: v for k, v in res.items() if k != "score_hist"}


def _recorder_with_results() -> ResultsRecorder:
    rec = ResultsRecorder(method="fedavg", dataset="toy")
    site_results = {"site-1": {"val": _result(*VAL_A), "test": _result(*TEST_A)}, "site-2": {"val": _result(*VAL_B)}}
    rec.rounds = {1: {"sites": {s: {"results": r, "train_loss": 0.1} for s, r in site_results.items()}}}
    rec.final = {
        f"SRV_{LAST_MODEL}": site_results,
        f"SRV_{BEST_MODEL}": {"site-1": {"val": _result(*VAL_A), "test": _result(*TEST_A)}},
    }
    return rec


def test_results_record_thresholds_per_round_and_final_model_beside_the_existing_numbers():
    out = _recorder_with_results().summary()
    rnd = out["rounds"][0]
    assert rnd["thresholds"]["thresholds"] == {"a": SCORE_GRID[60]}
    assert rnd["test"]["macro"]["bacc"] == 0.5 and rnd["test"]["macro"]["bacc_val_thr"] == pytest.approx(0.75)
    # the sites' score histograms stay out of the record; only each final model's pooled ones (its ROC / PR curves)
    pooled = {m: {k: f.pop(k) for k in list(f) if k.endswith("_score_hist")} for m, f in out["final"].items()}
    assert "score_hist" not in json.dumps(out)
    assert set(pooled[LAST_MODEL]) == {"val_score_hist", "test_score_hist"}
    last, best = out["final"][LAST_MODEL], out["final"][BEST_MODEL]
    assert last["thresholds"]["thresholds"] == {"a": SCORE_GRID[60]}
    assert best["thresholds"]["thresholds"] == {"a": SCORE_GRID[35]}  # the best model: site-1's validation only
    # at grid[35] site-1's test: 70, 50, 45 predicted positive: TP 2, FP 1, TN 1 -> BACC (1 + 1/2) / 2
    assert best["test"]["macro"]["bacc_val_thr"] == pytest.approx(0.75)
    assert best["test"]["macro"]["f1_val_thr"] == pytest.approx(4 / 5)
    thr = model_thresholds(out)
    assert thr["models"][BEST_MODEL]["criterion"] == "youden" and set(thr["models"]) == {LAST_MODEL, BEST_MODEL}
    # each site's own validation scores as well (a site's own model, fedpartial-predict / export --site): site-1's
    # alone choose what the best model's did (its validation only)
    own = last["thresholds"]["sites"]
    assert own["site-1"]["thresholds"] == {"a": SCORE_GRID[35]} and own["site-1"]["val_sets"] == 1
    assert set(own) == {"site-1", "site-2"} and "sites" not in best["thresholds"]
    out["thresholds"] = thr
    text = render_tables({**out, "num_rounds": 1})
    assert "thresholds chosen on validation (youden" in text
    assert f"| a | {SCORE_GRID[35]:.4g} | 50.00 | 75.00 | 0.00 | 80.00 |" in text  # best model on test
    with pytest.raises(ValueError, match="threshold_criterion"):
        ResultsRecorder(threshold_criterion="accuracy")
    f1 = ResultsRecorder(threshold_criterion="f1")
    f1.rounds, f1.final = _recorder_with_results().rounds, {}
    assert f1.summary()["rounds"][0]["thresholds"]["thresholds"] == {"a": SCORE_GRID[35]}


def test_single_label_run_says_why_it_has_no_thresholds():
    res = multiclass_metrics(np.array([0, 1]), np.array([[0.7, 0.3], [0.2, 0.8]]), ["x", "y"])
    assert model_thresholds({"final": {LAST_MODEL: {"test": res, "thresholds": None}}}) == {
        "models": {},
        "note": "single-label task: the prediction is the argmax, no threshold applies",
    }


# ----------------------------------------------------------------------------------- fedpartial-predict

from test_predict import _expected, _run_folder, images, sim_ws  # noqa: E402,F401  (fixtures)

from fedpartial.data.catalog.ich import CLASSES as ICH_CLASSES  # noqa: E402
from fedpartial.data.manifest import read_manifest  # noqa: E402
from fedpartial.tools import predict as P  # noqa: E402


def test_predict_with_validation_thresholds(sim_ws, images, tmp_path, capsys):  # noqa: F811
    ws, nets = sim_ws
    folder, labelled = images
    app = ws / "server/simulate_job/app_server"
    probs = _expected(nets[BEST_MODEL], labelled)  # (5 images, 5 classes), manifest order
    # per class, a threshold between the 2nd and 3rd highest probability: 2 positives per class
    srt = np.sort(probs, axis=0)[::-1]
    thr = (srt[1] + srt[2]) / 2
    chosen = {c: float(t) for c, t in zip(ICH_CLASSES, thr)}
    chosen[ICH_CLASSES[4]] = None  # none chosen for that class: 0.5
    (app / THRESHOLDS_FILE).write_text(
        json.dumps({"models": {BEST_MODEL: {"criterion": "youden", "thresholds": chosen}}})
    )
    out = tmp_path / "p.csv"
    args = [str(ws), "--manifest", str(labelled), "--data-root", str(folder), "-o", str(out)]
    assert P.main(args + ["--thresholds", "validation"]) == 0
    df = pd.read_csv(out)
    assert list(df.columns) == (["image"] + [f"prob_{c}" for c in ICH_CLASSES] + [f"pred_{c}" for c in ICH_CLASSES])
    want = np.c_[probs[:, :4] >= thr[:4], probs[:, 4] >= 0.5].astype(int)
    np.testing.assert_array_equal(df.filter(like="pred_").to_numpy(), want)
    assert (df.filter(like="pred_").to_numpy()[:, :4].sum(0) == 2).all()
    at_half = P.add_decisions(df.filter(like="prob_"), ICH_CLASSES, P.resolve_thresholds(P.load_model(ws), "0.5"))
    np.testing.assert_array_equal(at_half.filter(like="pred_").to_numpy(), (df.filter(like="prob_") >= 0.5).astype(int))
    # the last model has no thresholds in the file: a clear error, nothing written
    out.unlink()
    assert P.main(args + ["--model", "last", "--thresholds", "validation"]) == 2
    assert "has no thresholds for FL_global_model.pt" in capsys.readouterr().err and not out.exists()
    assert P.main(args + ["--thresholds", "high"]) == 2
    assert "must be a number or 'validation'" in capsys.readouterr().err
    # fedpartial-evaluate: thresholded metrics at the chosen thresholds (AUC unchanged)
    js = tmp_path / "s.json"
    assert (
        P.evaluate_main(
            [
                str(ws),
                "--manifest",
                str(labelled),
                "--data-root",
                str(folder),
                "--json",
                str(js),
                "--thresholds",
                "validation",
            ]
        )
        == 0
    )
    res = json.loads(js.read_text())
    m = read_manifest(labelled, ICH_CLASSES, data_root=folder)
    want = multilabel_metrics(m.labels, probs, ICH_CLASSES, threshold=[*thr[:4], 0.5], mask=m.mask)
    for c in ICH_CLASSES:
        for k in ("f1", "recall", "auc"):
            a, b = res["per_class"][c][k], want["per_class"][c][k]
            assert (a is None and b is None) or a == pytest.approx(b, abs=1e-6)


def test_predict_thresholds_from_results_json_and_single_label_refusal(tmp_path):
    model_file = tmp_path / "run" / "app_server" / BEST_MODEL
    model_file.parent.mkdir(parents=True)
    (tmp_path / "run" / "results.json").write_text(
        json.dumps({"thresholds": {"models": {BEST_MODEL: {"criterion": "f1", "thresholds": {"a": 0.2, "b": None}}}}})
    )
    assert P.find_thresholds(model_file)["thresholds"] == {"a": 0.2, "b": None}
    with pytest.raises(FileNotFoundError, match="use --thresholds 0.5"):
        P.find_thresholds(tmp_path / "elsewhere" / BEST_MODEL)
    mc = P.LoadedModel(net=None, dataset={"task": "multiclass", "classes": ["x", "y"]}, path=model_file)
    with pytest.raises(ValueError, match="argmax"):
        P.resolve_thresholds(mc, "validation")
    ml = P.LoadedModel(net=None, dataset={"task": "multilabel", "classes": ["a", "b"]}, path=model_file)
    assert P.resolve_thresholds(ml, "validation") == [0.2, 0.5] and P.resolve_thresholds(ml, None) is None
    with pytest.raises(ValueError, match="outside"):
        P.resolve_thresholds(ml, "1.5")


def test_a_sites_own_model_takes_the_thresholds_of_its_own_validation_scores(tmp_path):
    from fedpartial.tools.predict import find_thresholds

    out = _recorder_with_results().summary()
    model = tmp_path / LAST_MODEL
    model.write_bytes(b"")
    (tmp_path / "thresholds.json").write_text(json.dumps(model_thresholds(out)))
    pooled, mine = find_thresholds(model), find_thresholds(model, "site-1")
    assert pooled["thresholds"] == {"a": SCORE_GRID[60]} and "sites" not in pooled
    assert mine["thresholds"] == {"a": SCORE_GRID[35]} and mine["chosen_on"] == "site-1's own validation scores"
    assert find_thresholds(model, "site-9")["thresholds"] == {"a": SCORE_GRID[60]}  # none recorded: the pooled ones
