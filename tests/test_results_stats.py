"""fedpartial.fl.results.method_stats: which of a method's meta values land in results.json per round."""

from __future__ import annotations

import json

import numpy as np

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
