"""fedpartial.fl.results.method_stats: which of a method's meta values land in results.json per round."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpartial.fl.keys import META_RESULTS
from fedpartial.fl.results import STATS_MAX_SIZE, method_stats


def test_small_numeric_meta_is_kept_as_plain_json():
    meta = {
        "fedlsm_pseudo": 17,
        "fedlsm_pools": [3, 10, 1],
        "fedlsm_q": np.array([4.0, 0.0, 2.5]),
        "fedmlp_degree": np.float32(0.25),
        "flag": np.bool_(True),
        "fedmlp_p0": np.zeros((5, 16), dtype=np.float32),  # a prototype matrix: too large, key only
        "ragged": [[1, 2], [3]],
        "name": "text",  # not numeric arrays
        META_RESULTS: {"val": 1},
        "train_loss": 0.5,
        "__private": 1,  # standard / private meta: never
    }
    stats = method_stats(meta)
    assert stats == {
        "fedlsm_pseudo": 17,
        "fedlsm_pools": [3, 10, 1],
        "fedlsm_q": [4.0, 0.0, 2.5],
        "fedmlp_degree": 0.25,
        "flag": True,
    }
    assert type(stats["fedmlp_degree"]) is float and type(stats["flag"]) is bool
    json.dumps(stats)  # serialisable as it is


def test_size_limit_is_inclusive():
    assert method_stats({"a": np.ones(STATS_MAX_SIZE)})["a"] == [1.0] * STATS_MAX_SIZE
    assert method_stats({"a": np.ones(STATS_MAX_SIZE + 1), "empty": []}) == {}


def test_non_finite_values_become_null():
    """NaN / inf would make results.json unreadable for strict JSON parsers: they are written as null."""
    stats = method_stats(
        {
            "fedmlp_degree": np.float64("nan"),
            "x": float("inf"),
            "fedlsm_q": np.array([1.0, np.nan, -np.inf]),
            "grid": np.array([[0.5, np.nan]]),
        }
    )
    assert stats == {"fedmlp_degree": None, "x": None, "fedlsm_q": [1.0, None, None], "grid": [[0.5, None]]}
    assert json.loads(json.dumps(stats, allow_nan=False)) == stats


def test_histogram_auroc_is_the_mann_whitney_statistic_of_the_binned_scores():
    """On scores that sit on the histogram's bin edges the binned AUROC is the exact AUROC (ties counted half);
    a class without an outcome has none."""
    from fedpartial.metrics import SCORE_GRID, histogram_auroc, roc_auc_score, score_histogram

    rng = np.random.default_rng(0)
    grid = SCORE_GRID[40:120]
    y = rng.integers(0, 2, size=(300, 2))
    p = np.stack([grid[rng.integers(0, len(grid), 300)], grid[rng.integers(0, len(grid), 300)]], axis=1)
    p[:, 0] = np.where(y[:, 0] == 1, np.maximum(p[:, 0], grid[rng.integers(0, len(grid), 300)]), p[:, 0])
    hist = score_histogram(y, p, ["a", "b"])
    got = histogram_auroc(hist)
    assert got["a"] == pytest.approx(roc_auc_score(y[:, 0], p[:, 0]), abs=1e-12)
    assert got["b"] == pytest.approx(roc_auc_score(y[:, 1], p[:, 1]), abs=1e-12)
    assert got["a"] > 0.6  # the shifted class ranks
    assert histogram_auroc(score_histogram(np.ones((3, 1)), np.full((3, 1), 0.5), ["c"])) == {"c": None}


def _site_result(y, p, classes):
    from fedpartial.metrics import roc_auc_score, score_histogram

    auc = float(np.mean([roc_auc_score(y[:, c], p[:, c]) for c in range(y.shape[1])]))
    return {"test": {"macro": {"auc": auc}, "score_hist": score_histogram(y, p, classes)}}


def test_a_model_that_tells_the_sites_apart_is_named_and_an_honest_one_is_not():
    """Two hospitals, each its own test set. Shortcut: the scores say which hospital (0.8 at one, 0.2 at the other)
    and the prevalences differ (80 % / 20 %), but within each hospital they are noise: within-site AUROC about 0.5,
    pooled about 0.8, and results warn. Honest: the same scores rank the finding at both: pooled = within, no
    warning. Fewer than two own test sets (the simulator's shared one): nothing to compare."""
    from fedpartial.fl.results import across_sites, pooled_histograms
    from fedpartial.tables import across_sites_line

    rng = np.random.default_rng(1)
    classes = ["finding"]
    shortcut, honest = {}, {}
    for site, (centre, prevalence) in {"site-1": (0.8, 0.8), "site-2": (0.2, 0.2)}.items():
        y = (rng.random((400, 1)) < prevalence).astype(int)
        noise = np.clip(centre + rng.normal(0, 0.05, (400, 1)), 0.01, 0.99)
        shortcut[site] = _site_result(y, noise, classes)
        ranked = np.clip(0.3 + 0.4 * y + rng.normal(0, 0.15, (400, 1)), 0.01, 0.99)
        honest[site] = _site_result(y, ranked, classes)
    a = across_sites(shortcut, pooled_histograms(shortcut)["test_score_hist"])
    assert abs(a["mean_within_site_auc"] - 0.5) < 0.06 and a["pooled_auc"] > 0.75
    assert "exceeds the mean within-site AUROC" in a["warning"] and "telling the sites apart" in a["warning"]
    assert "WARNING" in across_sites_line("last", a)
    b = across_sites(honest, pooled_histograms(honest)["test_score_hist"])
    assert b["warning"] is None and abs(b["pooled_auc"] - b["mean_within_site_auc"]) < 0.02
    assert sorted(b["within_site_auc"]) == ["site-1", "site-2"]
    assert across_sites({"site-1": honest["site-1"], "site-2": {"val": {}}}, None) is None
    no_hist = across_sites(shortcut, None)  # a site's policy sent no histogram: within-site only, no pooled claim
    assert no_hist["pooled_auc"] is None and no_hist["warning"] is None
