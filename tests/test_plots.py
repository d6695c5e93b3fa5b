"""The figures: per-round validation curves of a benchmark's configurations (mean ± std over seeds), the bar
chart of their final test metric and a single run's curves; the plotted data are read back from the matplotlib
objects and compared with the hand-built results."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from conftest import REPO
from fedpartial.tables import curve_stats, curves_figure, final_bar_figure, run_figure, save_figure
from fedpartial.tools import show_results

LAST, BEST = "FL_global_model.pt", "best_FL_global_model.pt"


def _run(val_auc: list, final_last: float, final_best: float, test_every: int = 2) -> dict:
    """A results.json-like run: round r has validation macro auc ``val_auc[r]``, test every ``test_every``."""

    def res(auc):
        return {"task": "multilabel", "macro": {"auc": auc, "bacc": auc - 0.1, "map": auc - 0.2}, "per_class": {}}

    rounds = [
        {"round": r, "val": res(v), "test": res(v - 0.05) if r % test_every == 0 else None}
        for r, v in enumerate(val_auc)
    ]
    return {
        "method": "m",
        "dataset": "d",
        "best": {"trained_rounds": 2},
        "rounds": rounds,
        "final": {LAST: {"test": res(final_last)}, BEST: {"test": res(final_best)}},
    }


RUNS = {
    "fedavg": [_run([0.5, 0.6, 0.7], 0.70, 0.72), _run([0.5, 0.8, 0.9], 0.90, 0.88)],
    "fedmlp": [_run([0.55, 0.65, 0.75], 0.75, 0.75)],
}


def _line(ax, label):
    return next(line for line in ax.get_lines() if line.get_label() == label)


def test_curve_stats_mean_and_population_std_per_round():
    s = curve_stats(RUNS["fedavg"], "auc")
    assert s["rounds"] == [0, 1, 2] and s["n"] == [2, 2, 2]
    assert s["mean"] == pytest.approx([0.5, 0.7, 0.8]) and s["std"] == pytest.approx([0.0, 0.1, 0.1])
    # a --compact run (curves instead of rounds) gives the same numbers
    compact = {"curves": [{"round": r["round"], "val": r["val"]["macro"]} for r in RUNS["fedavg"][1]["rounds"]]}
    assert curve_stats([RUNS["fedavg"][0], compact], "auc")["mean"] == pytest.approx([0.5, 0.7, 0.8])
    t = curve_stats(RUNS["fedavg"], "auc", "test")  # rounds without a test evaluation are left out
    assert t["rounds"] == [0, 2] and t["mean"] == pytest.approx([0.45, 0.75])


def test_benchmark_curves_plot_every_configuration(tmp_path):
    fig = curves_figure(RUNS, "auc", "val")
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["fedavg", "fedmlp"]
    fedavg = _line(ax, "fedavg")
    assert list(fedavg.get_xdata()) == [0, 1, 2]
    np.testing.assert_allclose(fedavg.get_ydata(), [0.5, 0.7, 0.8])
    np.testing.assert_allclose(_line(ax, "fedmlp").get_ydata(), [0.55, 0.65, 0.75])
    # the ± std band of fedavg (2 seeds): its upper edge is mean + std
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].max() == pytest.approx(0.9) and len(ax.collections) == 1  # fedmlp: one seed, no band
    assert "auc" in ax.get_ylabel()
    path = tmp_path / "sub" / "c.png"
    save_figure(fig, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_final_bars_mean_and_std_over_seeds():
    fig = final_bar_figure(RUNS, "auc", models=((LAST, "last round"), (BEST, "best on val")))
    ax = fig.axes[0]
    from matplotlib.container import BarContainer

    last, best = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert [p.get_height() for p in last.patches] == pytest.approx([0.8, 0.75])  # (0.7 + 0.9) / 2, one seed
    assert [p.get_height() for p in best.patches] == pytest.approx([0.8, 0.75])  # (0.72 + 0.88) / 2
    # error bars: mean ± population std: fedavg last 0.8 ± 0.1, best 0.8 ± 0.08, fedmlp ± 0
    segs = last.errorbar.lines[2][0].get_segments()
    assert [tuple(s[:, 1]) for s in segs] == [pytest.approx((0.7, 0.9)), pytest.approx((0.75, 0.75))]
    segs = best.errorbar.lines[2][0].get_segments()
    assert tuple(segs[0][:, 1]) == pytest.approx((0.72, 0.88))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["fedavg", "fedmlp"]
    assert [p.get_label() for p in (last, best)] == ["last round", "best on val"]


def test_single_run_figure_and_show_results_writes_it(tmp_path, capsys):
    run = RUNS["fedavg"][0]
    fig = run_figure(run, ["auc", "bacc"])
    ax = fig.axes[0]
    np.testing.assert_allclose(_line(ax, "val auc").get_ydata(), [0.5, 0.6, 0.7])
    np.testing.assert_allclose(_line(ax, "val bacc").get_ydata(), [0.4, 0.5, 0.6])
    test = _line(ax, "test auc")
    assert list(test.get_xdata()) == [0, 2] and test.get_linestyle() == "--"
    np.testing.assert_allclose(test.get_ydata(), [0.45, 0.65])
    assert _line(ax, "val auc").get_color() == test.get_color()
    # default metrics: the task's table metrics (multilabel: bacc, auc, map)
    labels = [line.get_label() for line in run_figure(run).axes[0].get_lines() if not line.get_label().startswith("_")]
    assert labels == ["val bacc", "test bacc", "val auc", "test auc", "val map", "test map"]

    ws = tmp_path / "ws" / "server" / "simulate_job"
    ws.mkdir(parents=True)
    full = {
        **run,
        "key_metric": "auc",
        "setting": "full labels",
        "num_rounds": 3,
        "seconds_per_round": 1.0,
        "final": {
            k: {
                **v,
                "test": {
                    **v["test"],
                    "per_class": {"a": dict.fromkeys(("auc", "ap", "bacc", "f1", "precision", "recall"), 0.5)},
                    "n": 4,
                    "undefined_classes": {},
                },
            }
            for k, v in run["final"].items()
        },
    }
    (ws / "results.json").write_text(json.dumps(full))
    assert show_results.main([str(tmp_path / "ws")]) == 0
    assert (ws / show_results.CURVES_FILE).read_bytes()[:4] == b"\x89PNG"
    other = tmp_path / "plots" / "run.png"
    assert show_results.main([str(tmp_path / "ws"), "--plot", str(other)]) == 0
    assert other.is_file() and f"curves: {other}" in capsys.readouterr().out


def test_run_jobs_writes_the_plots_beside_its_tables(tmp_path):
    spec = importlib.util.spec_from_file_location("run_jobs", REPO / "benchmarks" / "run_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    runs = {k: [{**r, "setting": "full labels", "seconds_per_round": 1.0} for r in rs] for k, rs in RUNS.items()}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"args": {"rounds": 3}, "runs": runs}))
    assert mod.main(["--report", str(path)]) == 0
    curves, final = mod.plot_paths(path)
    assert (curves.name, final.name) == ("bench_curves.png", "bench_final.png")
    assert curves.is_file() and final.is_file() and path.with_suffix(".md").is_file()
    curves.unlink()
    assert mod.main(["--report", str(path), "--no-plots"]) == 0 and not curves.exists()


# ------------------------------------------------------------------ a final model's per-class figures


def _hand_curve():
    from fedpartial.plots import binary_curve

    return binary_curve(np.array([1, 0, 1, 0]), np.array([0.9, 0.8, 0.4, 0.1]))


def test_binary_curve_by_hand_and_against_sklearn():
    from sklearn.metrics import roc_auc_score

    from fedpartial.plots import binary_curve

    c = _hand_curve()  # scores 0.9 (pos), 0.8 (neg), 0.4 (pos), 0.1 (neg)
    np.testing.assert_allclose(c.thresholds, [0.9, 0.8, 0.4, 0.1])
    np.testing.assert_allclose(c.tpr, [0.5, 0.5, 1.0, 1.0])
    np.testing.assert_allclose(c.fpr, [0.0, 0.5, 0.5, 1.0])
    np.testing.assert_allclose(c.precision, [1.0, 0.5, 2 / 3, 0.5])
    assert c.auc == pytest.approx(0.75)
    assert c.at(0.5) == pytest.approx((0.5, 0.5, 0.5))  # positive: 0.9 and 0.8
    assert c.at(0.95) == (0.0, 0.0, 1.0)  # nothing positive
    tie = binary_curve(np.array([1, 0]), np.array([0.5, 0.5]))
    assert len(tie.thresholds) == 1 and tie.auc == pytest.approx(0.5)
    assert binary_curve(np.array([1, 1]), np.array([0.2, 0.3])) is None  # one outcome only
    rng = np.random.default_rng(0)
    y, s = rng.integers(0, 2, 200), np.round(rng.random(200), 2)  # with ties
    assert binary_curve(y, s).auc == pytest.approx(roc_auc_score(y, s))


def test_curves_from_a_histogram_equal_those_from_the_scores_on_the_grid():
    from fedpartial.metrics import SCORE_GRID, score_histogram
    from fedpartial.plots import curves_from_histogram, curves_from_scores

    rng = np.random.default_rng(1)
    probs = SCORE_GRID[rng.integers(0, len(SCORE_GRID), (60, 2))]  # scores on the grid: binning loses nothing
    y = (rng.random((60, 2)) < probs).astype(int)
    mask = np.ones_like(y, bool)
    mask[:10, 1] = False
    a = curves_from_scores(y, probs, ["a", "b"], mask)
    b = curves_from_histogram(score_histogram(y, probs, ["a", "b"], mask))
    for k in ("a", "b"):
        np.testing.assert_allclose(a[k].tpr, b[k].tpr)
        np.testing.assert_allclose(a[k].fpr, b[k].fpr)
        np.testing.assert_allclose(a[k].thresholds, b[k].thresholds)
        assert a[k].positives == b[k].positives and a[k].negatives == b[k].negatives


def test_roc_pr_figures_plot_the_points_and_mark_the_thresholds():
    from fedpartial.plots import roc_pr_figures

    c = _hand_curve()
    roc, pr = roc_pr_figures({"a": c, "b": None, "c": c}, {"a": 0.5, "c": None}, {"a": [0.6, 0.9]})
    ax_a, ax_b, ax_c = roc.axes
    curve = _line(ax_a, "ROC")
    np.testing.assert_allclose(curve.get_xdata(), [0, 0, 0.5, 0.5, 1])
    np.testing.assert_allclose(curve.get_ydata(), [0, 0.5, 0.5, 1, 1])
    chosen = _line(ax_a, "t=0.50")  # the validation threshold: a filled dot at (FPR, TPR) = (0.5, 0.5)
    assert (chosen.get_xdata()[0], chosen.get_ydata()[0]) == (0.5, 0.5)
    assert chosen.get_markerfacecolor() != "white"
    default = _line(ax_c, "t=0.50 (default)")  # no threshold chosen: 0.5, an open dot
    assert default.get_markerfacecolor() == "white"
    assert "AUROC 0.75 [0.60, 0.90]" in ax_a.get_title() and "one outcome only" in ax_b.get_title()
    pr_curve = _line(pr.axes[0], "PR")
    np.testing.assert_allclose(pr_curve.get_xdata(), [0.5, 0.5, 1, 1])
    np.testing.assert_allclose(pr_curve.get_ydata(), [1, 0.5, 2 / 3, 0.5])
    exact, _ = roc_pr_figures({"a": c}, auc={"a": 0.8125})  # a binned curve shows the exact AUROC given
    assert "AUROC 0.81" in exact.axes[0].get_title()
    assert pr.axes[0].get_lines()[0].get_ydata()[0] == pytest.approx(0.5)  # the prevalence line
    single, _ = roc_pr_figures({"a": c}, None, None, default_threshold=None)  # single-label: no dot
    assert [line.get_label() for line in single.axes[0].get_lines()] == ["_child0", "ROC"]


def test_auc_interval_and_site_heat_map_figures():
    from fedpartial.plots import auc_ci_figure, site_heatmap_figure

    res = {
        "n": 40,
        "macro": {"auc": 0.7},
        "per_class": {"a": {"auc": 0.8}, "b": {"auc": None}},
        "ci": {"auc": {"per_class": {"a": [0.7, 0.9], "b": None}, "macro": [0.6, 0.8]}},
    }
    ax = auc_ci_figure(res, "t").axes[0]
    bars = [line for line in ax.get_lines() if line.get_linewidth() == 2.5]
    assert [tuple(b.get_xdata()) for b in bars] == [(0.7, 0.9), (0.6, 0.8)]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "macro"]
    assert any("n/a" in t.get_text() for t in ax.texts) and any(t.get_text() == "0.800 [0.70, 0.90]" for t in ax.texts)
    per_site = {
        "site-1": {"per_class": {"a": {"auc": 0.9}, "b": {"auc": 0.6}}},
        "site-2": {"per_class": {"a": {"auc": None}, "b": {"auc": 0.75}}},
    }
    fig = site_heatmap_figure(per_site, ["a", "b"], annotated={"site-1": ["a"], "site-2": ["a", "b"]})
    ax = fig.axes[0]
    data = ax.get_images()[0].get_array()
    np.testing.assert_allclose(data.filled(np.nan), [[0.9, 0.6], [np.nan, 0.75]])
    assert [t.get_text() for t in ax.texts] == ["0.90", "0.60", "n/a", "0.75"]
    assert len(ax.patches) == 3  # the annotated cells are framed
    assert [t.get_text() for t in ax.get_yticklabels()] == ["site-1", "site-2"]


def test_show_results_draws_the_final_model_and_results_md_shows_it(tmp_path, capsys):
    from fedpartial.metrics import score_histogram

    run = RUNS["fedavg"][0]
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 2, (30, 2)), rng.random((30, 2))
    res = {
        "task": "multilabel",
        "n": 30,
        "macro": {"auc": 0.6, "bacc": 0.5, "map": 0.4},
        "per_class": {c: dict.fromkeys(("auc", "ap", "bacc", "f1", "precision", "recall"), 0.6) for c in "ab"},
        "undefined_classes": {},
        "ci": {"auc": {"per_class": {"a": [0.4, 0.8], "b": None}, "macro": [0.5, 0.7]}},
    }
    final = {
        "test": res,
        "sites": ["site-1"],
        "per_site": {},
        "thresholds": {"criterion": "youden", "thresholds": {"a": 0.3, "b": None}},
        "test_score_hist": score_histogram(y, p, ["a", "b"]),
    }
    full = {
        **run,
        "key_metric": "auc",
        "setting": "s",
        "num_rounds": 3,
        "seconds_per_round": 1.0,
        "data": {"sites": {"site-1": {"annotated": [0]}}, "shared_eval_sets": {"test": [["site-1", "site-2"]]}},
        "final": {LAST: final, BEST: final},
    }
    ws = tmp_path / "ws" / "server" / "simulate_job"
    ws.mkdir(parents=True)
    (ws / "results.json").write_text(json.dumps(full))
    (ws / "results.md").write_text("# the run\n")
    assert show_results.main([str(tmp_path / "ws")]) == 0
    assert show_results.main([str(tmp_path / "ws")]) == 0  # twice: one Figures section
    md = (ws / "results.md").read_text()
    assert md.startswith("# the run\n") and md.count("## Figures") == 1
    for name in (
        "results_curves.png",
        "results_auc_ci.png",
        "results_site_auc.png",
        "results_roc.png",
        "results_pr.png",
    ):
        assert f"]({name})" in md and (ws / name).read_bytes()[:4] == b"\x89PNG", name
    assert "best_FL_global_model.pt: " in capsys.readouterr().out


def test_evaluate_writes_its_figures_beside_its_table(tmp_path):
    from PIL import Image
    from test_predict import _run_folder

    from fedpartial.data.catalog.ich import CLASSES as ICH_CLASSES
    from fedpartial.data.manifest import write_manifest
    from fedpartial.tools import predict as P

    _run_folder(tmp_path / "run" / "app_server")
    rng = np.random.default_rng(0)
    d = tmp_path / "imgs"
    d.mkdir()
    for i in range(12):
        Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8)).save(d / f"{i}.png")
    labels = np.tile([[1, 0, 1, 0, 1], [0, 1, 0, 1, 0]], (6, 1))
    write_manifest(d / "test.csv", [f"{i}.png" for i in range(12)], labels, np.ones_like(labels, bool), ICH_CLASSES)
    out = tmp_path / "scores"
    assert (
        P.evaluate_main(
            [str(tmp_path / "run"), "--manifest", str(d / "test.csv"), "--figures", str(out), "--thresholds", "0.4"]
        )
        == 0
    )
    md = (out / "test_evaluation.md").read_text()
    for name in ("test_roc.png", "test_pr.png", "test_auc_ci.png"):
        assert f"]({name})" in md and (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "epidural" in md  # the table


def test_pooled_histograms_of_a_final_model():
    from fedpartial.fl.results import pooled_histograms
    from fedpartial.metrics import score_histogram

    rng = np.random.default_rng(0)
    h = [score_histogram(rng.integers(0, 2, (5, 1)), rng.random((5, 1)), ["a"]) for _ in range(2)]
    per_site = {
        "site-1": {"test": {"score_hist": h[0]}, "val": {"score_hist": h[0]}},
        "site-2": {"test": {"score_hist": h[1]}, "val": {}},
    }
    out = pooled_histograms(per_site)
    assert set(out) == {"test_score_hist", "val_score_hist"}
    np.testing.assert_array_equal(out["test_score_hist"]["pos"], np.add(h[0]["pos"], h[1]["pos"]))
    per_site["site-2"]["test"] = {"n": 5}  # a site that sent no histogram: no pooled one
    assert "test_score_hist" not in pooled_histograms(per_site)


def test_progress_lines_off_a_terminal():
    import io

    from fedpartial.tools.bundle_runtime import Progress

    stream = io.StringIO()
    assert list(Progress(range(25), "predict: batch", stream=stream)) == list(range(25))
    lines = stream.getvalue().splitlines()
    assert lines[0] == "predict: batch 2 / 25" and lines[-1] == "predict: batch 25 / 25" and len(lines) == 13
