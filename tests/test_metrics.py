"""fedpartial.metrics against scikit-learn computed independently here, plus hand-computed examples."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    balanced_accuracy_score,
    confusion_matrix,
    f1_score,
    log_loss,
    precision_score,
    recall_score,
    roc_auc_score,
)

from fedpartial.metrics import compute_metrics, flatten_metrics, format_table, multiclass_metrics, multilabel_metrics

ML_CLASSES = ["epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural"]
MC_CLASSES = ["nv", "mel", "bcc", "bkl"]


def _ml_data(n: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (rng.random((n, len(ML_CLASSES))) < 0.3).astype(int)
    p = np.clip(0.35 * y + 0.65 * rng.random(y.shape), 0, 1)  # informative but imperfect
    return y, p


def _mc_data(n: int = 300, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, len(MC_CLASSES), n)
    logits = rng.normal(size=(n, len(MC_CLASSES))) + 1.5 * np.eye(len(MC_CLASSES))[y]
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return y, p


def _sk_binary(yt: np.ndarray, p: np.ndarray, thr: float = 0.5) -> dict[str, float]:
    pred = (p >= thr).astype(int)
    return {
        "auc": roc_auc_score(yt, p),
        "ap": average_precision_score(yt, p),
        "bacc": balanced_accuracy_score(yt, pred),
        "f1": f1_score(yt, pred, zero_division=0),
        "precision": precision_score(yt, pred, zero_division=0),
        "recall": recall_score(yt, pred, zero_division=0),
        "bce": log_loss(yt, p, labels=[0, 1]),
    }


# ---------------------------------------------------------------- multilabel


@pytest.mark.parametrize("thr", [0.5, 0.3])
def test_multilabel_matches_sklearn(thr: float) -> None:
    y, p = _ml_data()
    r = multilabel_metrics(y, p, ML_CLASSES, threshold=thr)
    assert r["task"] == "multilabel" and r["n"] == len(y)
    expected = {c: _sk_binary(y[:, i], p[:, i], thr) for i, c in enumerate(ML_CLASSES)}
    for c in ML_CLASSES:
        for k, v in expected[c].items():
            assert r["per_class"][c][k] == pytest.approx(v, abs=1e-12), (c, k)
    for macro, k in {
        "auc": "auc",
        "map": "ap",
        "bacc": "bacc",
        "f1": "f1",
        "precision": "precision",
        "recall": "recall",
    }.items():
        assert r["macro"][macro] == pytest.approx(np.mean([expected[c][k] for c in ML_CLASSES]), abs=1e-12)
    # the macro AUC equals sklearn's own macro average when every class is defined
    assert r["macro"]["auc"] == pytest.approx(roc_auc_score(y, p, average="macro"))
    assert r["n_undefined"] == {"auc": 0, "map": 0, "bacc": 0, "f1": 0, "precision": 0, "recall": 0}
    assert all(isinstance(v, float) for v in r["macro"].values())


# binary cross-entropy of the annotated entries, by hand: -mean(y ln p + (1 - y) ln(1 - p))
BCE_A = -(math.log(0.9) + math.log(0.4) + math.log(0.7) + math.log(0.9)) / 4  # y=[1,1,0,0], p=[.9,.4,.3,.1]
BCE_B = -(math.log(0.8) + math.log(0.7) + math.log(0.4) + math.log(0.1)) / 4  # y=[0,1,0,1], p=[.2,.7,.6,.1]


def test_multilabel_hand_computed() -> None:
    y = np.array([[1, 0], [1, 1], [0, 0], [0, 1]])
    p = np.array([[0.9, 0.2], [0.4, 0.7], [0.3, 0.6], [0.1, 0.1]])
    r = multilabel_metrics(y, p, ["A", "B"])
    # A: y=[1,1,0,0] pred=[1,0,0,0]: TPR=1/2, TNR=2/2 -> BACC=0.75; every positive outranks every negative -> AUC=AP=1
    #    precision=1/1, recall=1/2, F1=2*1*0.5/1.5=2/3
    assert r["per_class"]["A"] == pytest.approx(
        {"auc": 1.0, "ap": 1.0, "bacc": 0.75, "f1": 2 / 3, "precision": 1.0, "recall": 0.5, "bce": BCE_A}
    )
    # B: y=[0,1,0,1] pred=[0,1,1,0]: TPR=1/2, TNR=1/2 -> BACC=0.5; pairs (pos>neg): .7>.2,.7>.6 yes, .1>.2,.1>.6 no
    #    -> AUC=2/4; ranking .7(+) .6(-) .2(-) .1(+) -> AP = 0.5*1 + 0.5*(2/4) = 0.75; precision=recall=F1=1/2
    assert r["per_class"]["B"] == pytest.approx(
        {"auc": 0.5, "ap": 0.75, "bacc": 0.5, "f1": 0.5, "precision": 0.5, "recall": 0.5, "bce": BCE_B}
    )
    assert r["macro"] == pytest.approx(
        {
            "auc": 0.75,
            "map": 0.875,
            "bacc": 0.625,
            "f1": 7 / 12,
            "precision": 0.75,
            "recall": 0.5,
            "bce": (BCE_A + BCE_B) / 2,
        }
    )


def test_multilabel_undefined_class_left_out() -> None:
    y, p = _ml_data()
    y[:, 2] = 0  # intraventricular: negatives only
    r = multilabel_metrics(y, p, ML_CLASSES)
    pc = r["per_class"]["intraventricular"]
    assert pc["auc"] is None and pc["ap"] is None and pc["bacc"] is None
    assert pc["f1"] is not None  # still defined (zero_division=0)
    assert r["n_undefined"]["auc"] == r["n_undefined"]["map"] == r["n_undefined"]["bacc"] == 1
    assert r["n_undefined"]["f1"] == 0
    assert r["undefined_classes"]["auc"] == ["intraventricular"]
    others = [i for i in range(len(ML_CLASSES)) if i != 2]
    assert r["macro"]["auc"] == pytest.approx(np.mean([roc_auc_score(y[:, i], p[:, i]) for i in others]))
    assert r["macro"]["map"] == pytest.approx(np.mean([average_precision_score(y[:, i], p[:, i]) for i in others]))


def test_multilabel_mask() -> None:
    y, p = _ml_data(seed=3)
    rng = np.random.default_rng(4)
    mask = rng.random(y.shape) < 0.6
    mask[:, 4] = False  # subdural never annotated
    y_partial = np.where(mask, y, -1)  # unannotated entries hold junk and must be ignored
    r = multilabel_metrics(y_partial, p, ML_CLASSES, mask=mask)
    for i, c in enumerate(ML_CLASSES[:4]):
        exp = _sk_binary(y[mask[:, i], i], p[mask[:, i], i])
        assert r["per_class"][c] == pytest.approx(exp, abs=1e-12)
    assert all(v is None for v in r["per_class"]["subdural"].values())
    assert r["n_undefined"]["auc"] == 1 and r["n_undefined"]["f1"] == 1
    assert r["macro"]["auc"] == pytest.approx(
        np.mean([roc_auc_score(y[mask[:, i], i], p[mask[:, i], i]) for i in range(4)])
    )
    # full mask == no mask; junk outside the mask without a mask is rejected
    assert multilabel_metrics(y, p, ML_CLASSES, mask=np.ones_like(mask)) == multilabel_metrics(y, p, ML_CLASSES)
    with pytest.raises(ValueError, match="0/1"):
        multilabel_metrics(y_partial, p, ML_CLASSES)


# ---------------------------------------------------------------- multiclass


def test_multiclass_matches_sklearn() -> None:
    y, p = _mc_data()
    r = multiclass_metrics(y, p, MC_CLASSES)
    pred = p.argmax(1)
    C = len(MC_CLASSES)
    labels = list(range(C))
    cm = confusion_matrix(y, pred, labels=labels)
    assert r["task"] == "multiclass" and r["n"] == len(y)
    assert r["macro"]["auc"] == pytest.approx(roc_auc_score(y, p, multi_class="ovr", average="macro"))
    assert r["macro"]["accuracy"] == pytest.approx(accuracy_score(y, pred))
    assert r["macro"]["bacc"] == pytest.approx(balanced_accuracy_score(y, pred))
    for name, fn in (("f1", f1_score), ("precision", precision_score), ("recall", recall_score)):
        assert r["macro"][name] == pytest.approx(fn(y, pred, labels=labels, average="macro", zero_division=0))
        per = fn(y, pred, labels=labels, average=None, zero_division=0)
        for i, c in enumerate(MC_CLASSES):
            assert r["per_class"][c][name] == pytest.approx(per[i])
    sens, spec = [], []
    for i, c in enumerate(MC_CLASSES):
        tp = cm[i, i]
        fn_, fp = cm[i].sum() - tp, cm[:, i].sum() - tp
        tn = cm.sum() - tp - fn_ - fp
        sens.append(tp / (tp + fn_))
        spec.append(tn / (tn + fp))
        assert r["per_class"][c]["sensitivity"] == pytest.approx(sens[-1])
        assert r["per_class"][c]["specificity"] == pytest.approx(spec[-1])
        assert r["per_class"][c]["auc"] == pytest.approx(roc_auc_score(y == i, p[:, i]))
    assert r["macro"]["sensitivity"] == pytest.approx(np.mean(sens))
    assert r["macro"]["specificity"] == pytest.approx(np.mean(spec))
    assert r["n_undefined"] == {"auc": 0, "sensitivity": 0, "specificity": 0}


def test_multiclass_hand_computed() -> None:
    y = np.array([0, 0, 1, 2])
    p = np.array([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    r = multiclass_metrics(y, p, ["a", "b", "c"])
    # pred = [0, 1, 1, 2]; accuracy 3/4; sens a=1/2 b=1/1 c=1/1 -> bacc 5/6; spec b: 2 of 3 negatives -> 2/3
    assert r["macro"]["accuracy"] == pytest.approx(0.75)
    assert r["macro"]["bacc"] == pytest.approx(5 / 6)
    assert r["per_class"]["b"]["specificity"] == pytest.approx(2 / 3)
    assert r["per_class"]["a"]["specificity"] == pytest.approx(1.0)


def test_multiclass_absent_class_and_one_hot() -> None:
    y, p = _mc_data()
    y = np.where(y == 3, 0, y)  # class "bkl" never occurs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = multiclass_metrics(y, p, MC_CLASSES)
        assert r["macro"]["bacc"] == pytest.approx(balanced_accuracy_score(y, p.argmax(1)))
    assert r["per_class"]["bkl"]["auc"] is None and r["per_class"]["bkl"]["sensitivity"] is None
    assert r["per_class"]["bkl"]["specificity"] is not None
    assert r["n_undefined"]["auc"] == 1 and r["undefined_classes"]["auc"] == ["bkl"]
    assert r["macro"]["auc"] == pytest.approx(np.mean([roc_auc_score(y == i, p[:, i]) for i in range(3)]))
    # one-hot y_true through compute_metrics gives the identical result
    one_hot = np.eye(len(MC_CLASSES), dtype=int)[y]
    assert compute_metrics("multiclass", one_hot, p, MC_CLASSES) == r
    with pytest.raises(ValueError, match="one-hot"):
        compute_metrics("multiclass", one_hot * 2, p, MC_CLASSES)
    # row mask
    keep = np.arange(len(y)) % 2 == 0
    assert multiclass_metrics(y, p, MC_CLASSES, mask=keep) == multiclass_metrics(y[keep], p[keep], MC_CLASSES)


# ---------------------------------------------------------------- edge cases, dispatch, output helpers


def test_compute_metrics_dispatch() -> None:
    y, p = _ml_data()
    assert compute_metrics("multilabel", y, p, ML_CLASSES) == multilabel_metrics(y, p, ML_CLASSES)
    with pytest.raises(ValueError, match="unknown task"):
        compute_metrics("regression", y, p, ML_CLASSES)


@pytest.mark.parametrize("task,classes", [("multilabel", ML_CLASSES), ("multiclass", MC_CLASSES)])
def test_empty_input(task: str, classes: list[str]) -> None:
    y = np.zeros((0, len(classes))) if task == "multilabel" else np.zeros(0, int)
    r = compute_metrics(task, y, np.zeros((0, len(classes))), classes)
    assert r["n"] == 0
    assert all(v is None for v in r["macro"].values())
    assert all(v is None for ms in r["per_class"].values() for v in ms.values())
    assert r["n_undefined"]["auc"] == len(classes)
    assert flatten_metrics(r) == {}
    assert "n/a" in format_table(r)


def test_nan_and_out_of_range_probs_rejected() -> None:
    y, p = _ml_data()
    p[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        multilabel_metrics(y, p, ML_CLASSES)
    yc, pc = _mc_data()
    pc[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        compute_metrics("multiclass", yc, pc, MC_CLASSES)
    with pytest.raises(ValueError, match="logits"):
        multilabel_metrics(y, np.full(y.shape, 3.0), ML_CLASSES)


def test_flatten_metrics() -> None:
    y, p = _ml_data()
    y[:, 0] = 1  # epidural: positives only -> undefined AUC / AP / BACC
    r = multilabel_metrics(y, p, ML_CLASSES)
    flat = flatten_metrics(r, prefix="val_")
    assert all(isinstance(v, float) and math.isfinite(v) for v in flat.values())
    assert flat["val_auc"] == r["macro"]["auc"]
    assert flat["val_auc/subdural"] == r["per_class"]["subdural"]["auc"]
    assert "val_auc/epidural" not in flat and "val_f1/epidural" in flat
    assert "val_map" in flat and "val_ap/intraventricular" in flat


def test_format_table() -> None:
    y, p = _ml_data()
    y[:, 0] = 0
    r = multilabel_metrics(y, p, ML_CLASSES)
    t = format_table(r, title="site-1 validation")
    assert t.splitlines()[0] == "site-1 validation"
    for word in [*ML_CLASSES, "mean", "BACC", "AUC", "AP", "F1", "n/a"]:
        assert word in t
    assert f"{100 * r['macro']['auc']:.2f}" in t
    assert f"{100 * r['per_class']['subdural']['ap']:.2f}" in t

    yc, pc = _mc_data()
    rc = multiclass_metrics(yc, pc, MC_CLASSES)
    tc = format_table(rc)
    for word in [*MC_CLASSES, "mean", "Sens", "Spec", "accuracy"]:
        assert word in tc
    assert f"{100 * rc['macro']['accuracy']:.2f}" in tc


@pytest.mark.parametrize("seed", range(12))
def test_the_numpy_definitions_equal_scikit_learn_bit_for_bit(seed: int) -> None:
    """fedpartial.metrics computes scikit-learn's ranking and counting metrics in NumPy (a site never imports
    SciPy): on random scores with heavy ties (rounded to 1-3 decimals), sizes from 2 rows up, weighted ROC curves
    (histogram counts), single-class predictions and absent classes, every value equals scikit-learn's exactly."""
    import sklearn.metrics as sk

    import fedpartial.metrics as fm

    rng = np.random.default_rng(seed)
    n = int(rng.choice([2, 3, 7, 40, 500]))
    y = (rng.random(n) < rng.uniform(0.1, 0.9)).astype(int)
    y[:2] = [0, 1]  # both outcomes
    s = np.round(rng.random(n), int(rng.integers(1, 4)))
    w = rng.integers(0, 4, n).astype(float)
    w[:2] = 1.0
    assert fm.roc_auc_score(y, s) == sk.roc_auc_score(y, s)
    assert fm.average_precision_score(y, s) == sk.average_precision_score(y, s)
    for drop in (True, False):
        for weight in (None, w):
            ours, theirs = (f(y, s, sample_weight=weight, drop_intermediate=drop) for f in (fm.roc_curve, sk.roc_curve))
            for a, b in zip(ours, theirs):
                assert np.array_equal(a, b), (drop, weight is None)
    for pred in ((s >= 0.5).astype(int), np.zeros(n, int), np.ones(n, int)):
        ours = fm.precision_recall_f1(*fm.binary_counts(y, pred))
        for a, name in zip(ours, ("precision_score", "recall_score", "f1_score")):
            assert float(a) == getattr(sk, name)(y, pred, zero_division=0), name
        assert fm.accuracy_score(y, pred) == sk.accuracy_score(y, pred)
    C = 5
    yc, pc = rng.integers(0, C - 1, n), rng.integers(0, C, n)  # class 4 never true, some never predicted
    labels = list(range(C))
    assert np.array_equal(fm.confusion_matrix(yc, pc, labels=labels), sk.confusion_matrix(yc, pc, labels=labels))
    cm = fm.confusion_matrix(yc, pc, labels=labels)
    ours = fm.precision_recall_f1(np.diag(cm), cm.sum(1), cm.sum(0))
    for a, name in zip(ours, ("precision_score", "recall_score", "f1_score")):
        kw = dict(labels=labels, average=None, zero_division=0)
        assert np.array_equal(a, getattr(sk, name)(yc, pc, **kw)), name
    assert fm.accuracy_score(yc, pc) == sk.accuracy_score(yc, pc)


def test_a_site_computing_metrics_imports_no_scipy() -> None:
    """Scoring, choosing thresholds and the single-label metrics load neither scikit-learn nor SciPy."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np; from fedpartial.metrics import compute_metrics, select_thresholds;"
        "y = np.array([[0, 1], [1, 0], [1, 1], [0, 0]]); p = np.array([[.2, .7], [.6, .4], [.9, .8], [.1, .3]]);"
        "compute_metrics('multilabel', y, p, ['a', 'b']); select_thresholds(y, p);"
        "compute_metrics('multiclass', np.array([0, 1, 1]), np.array([[.6, .4], [.3, .7], [.8, .2]]), ['a', 'b']);"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'scipy', 'sklearn'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
