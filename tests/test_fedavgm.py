"""FedAvgM's server momentum on hand-computed values over two rounds, and its state through a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from fedpartial.fl.checkpoint import read_file, write_private
from fedpartial.methods import Contribution, OptionError, get_method

GROUPS = {"encoder": ["w"], "norm": ["bn.num_batches_tracked"], "head": [], "classifier": []}


def _c(site: str, w: float, n: float, steps: int = 1) -> Contribution:
    return Contribution(
        site=site,
        weights={"w": np.array([w], np.float32), "bn.num_batches_tracked": np.array(steps, np.int64)},
        n=n,
        meta={},
    )


def _prev(w: float) -> dict:
    return {"w": np.array([w], np.float32), "bn.num_batches_tracked": np.array(0, np.int64)}


def test_momentum_over_two_rounds_by_hand():
    """w0 = 1. Round 0: sites 0 (n=1) and 2 (n=3): avg 1.5, delta = -0.5, v = -0.5, w1 = 1.5.
    Round 1: both sites 1: avg 1.0, delta = 0.5, v = 0.9 * -0.5 + 0.5 = 0.05, w2 = 1.5 - 0.05 = 1.45
    (FedAvg: 1.0). With eta = 0.5: w1 = 1.25; round 1 (avg 1): v = -0.45 + 0.25 = -0.2, w2 = 1.25 + 0.1 = 1.35."""
    rule = get_method("fedavgm").make_rule({"server_momentum": 0.9})
    w1, meta = rule.aggregate(_prev(1.0), [_c("a", 0.0, 1), _c("b", 2.0, 3)], GROUPS, 0)
    assert meta == {} and w1["w"].dtype == np.float32 and w1["w"][0] == pytest.approx(1.5)
    w2, _ = rule.aggregate(w1, [_c("a", 1.0, 1), _c("b", 1.0, 3)], GROUPS, 1)
    assert w2["w"][0] == pytest.approx(1.45, abs=1e-6)
    assert w2["bn.num_batches_tracked"].dtype == np.int64  # integer buffers: the average, no momentum

    half = get_method("fedavgm").make_rule({"server_momentum": 0.9, "server_lr": 0.5})
    w1, _ = half.aggregate(_prev(1.0), [_c("a", 0.0, 1), _c("b", 2.0, 3)], GROUPS, 0)
    assert w1["w"][0] == pytest.approx(1.25)
    w2, _ = half.aggregate(w1, [_c("a", 1.0, 1), _c("b", 1.0, 3)], GROUPS, 1)
    assert w2["w"][0] == pytest.approx(1.35, abs=1e-6)

    plain = get_method("fedavgm").make_rule({"server_momentum": 0.0})
    plain.aggregate(_prev(1.0), [_c("a", 0.0, 1), _c("b", 2.0, 3)], GROUPS, 0)
    assert plain.aggregate(w1, [_c("a", 1.0, 1)], GROUPS, 1)[0]["w"][0] == pytest.approx(1.0)  # beta 0, eta 1: FedAvg


def test_momentum_survives_a_checkpoint(tmp_path):
    """The same second round after the velocity went through a weights_only checkpoint into a fresh rule: 1.45."""
    rule = get_method("fedavgm").make_rule({})
    w1, _ = rule.aggregate(_prev(1.0), [_c("a", 0.0, 1), _c("b", 2.0, 3)], GROUPS, 0)
    write_private({"rule": rule.state_dict()}, tmp_path / "checkpoint.pt")
    fresh = get_method("fedavgm").make_rule({})
    fresh.load_state_dict(read_file(tmp_path / "checkpoint.pt")["rule"])
    assert fresh.velocity["w"].dtype == np.float64
    assert fresh.aggregate(w1, [_c("a", 1.0, 1), _c("b", 1.0, 3)], GROUPS, 1)[0]["w"][0] == pytest.approx(
        1.45, abs=1e-6
    )


def test_bad_momentum_is_an_option_error():
    with pytest.raises(OptionError, match="server_momentum"):
        get_method("fedavgm").make_rule({"server_momentum": 1.0})
