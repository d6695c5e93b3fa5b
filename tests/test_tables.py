"""Paper-layout tables, the setting label and the seeded model initialisation that makes runs reproducible."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import REPO
from fedpartial.models import PartialLabelNet
from fedpartial.tables import cell, paper_table, per_class_table, setting_label
from fedpartial.tools.build_jobs import customise_job, training_jobs


def test_setting_label_names_the_partial_annotation_setting():
    eye = np.eye(5, dtype=bool)  # site i labels class i: FedMLP's "missing 4 classes"
    assert setting_label(eye) == "missing 4 classes"
    two = eye | np.roll(eye, 1, axis=1)
    assert setting_label(two) == "missing 3 classes"
    assert setting_label(~np.eye(3, dtype=bool)) == "missing 1 class"
    assert setting_label(np.ones((2, 4), bool)) == "full labels"
    assert setting_label([[1, 0, 0], [1, 1, 0]]) == "2 sites x 1..2 classes"


def test_cell_mean_and_population_std_in_percent():
    assert cell([0.5]) == "50.00"
    assert cell([0.5, 0.7]) == "60.00 ± 10.00"  # mean 0.6, population std 0.1
    assert cell([None, 0.25]) == "25.00"
    assert cell([]) == "n/a"


def test_paper_table_rows_settings_and_average():
    res = {
        "FedAvg": {
            "missing 1 class": [{"bacc": 0.7, "auc": 0.9, "map": 0.6}, {"bacc": 0.8, "auc": 0.8, "map": 0.6}],
            "missing 4 classes": [{"bacc": 0.5, "auc": 0.7, "map": 0.2}, {"bacc": 0.5, "auc": 0.8, "map": 0.4}],
        },
    }
    lines = paper_table(res, "multilabel").splitlines()
    assert lines[0] == (
        "| Method | missing 1 class: BACC | missing 1 class: AUC | missing 1 class: mAP | "
        "missing 4 classes: BACC | missing 4 classes: AUC | missing 4 classes: mAP | "
        "Average: BACC | Average: AUC | Average: mAP |"
    )
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    # average over settings per seed: seed 0 bacc (0.7+0.5)/2 = 0.6, seed 1 (0.8+0.5)/2 = 0.65 -> 62.50 ± 2.50
    assert cells[0] == "FedAvg"
    assert cells[1] == "75.00 ± 5.00" and cells[4] == "50.00 ± 0.00"
    assert cells[7] == "62.50 ± 2.50"
    # auc: seed 0 (0.9+0.7)/2 = 0.8, seed 1 (0.8+0.8)/2 = 0.8
    assert cells[8] == "80.00 ± 0.00"
    mc = paper_table(
        {"m": {"s": [{"auc": 0.9, "accuracy": 0.8, "f1": 0.5, "precision": 0.6, "recall": 0.4}]}}, "multiclass"
    )
    assert (
        "s: Acc" in mc and "Average" not in mc and mc.splitlines()[2] == "| m | 90.00 | 80.00 | 50.00 | 60.00 | 40.00 |"
    )


def test_per_class_table():
    r = {"task": "multilabel", "macro": {"auc": 0.75}, "per_class": {"a": {"auc": 0.5}, "b": {"auc": 1.0}}}
    t = per_class_table({"M": [r]})
    assert t.splitlines()[0] == "| Method | a: AUC | b: AUC | mean: AUC |"
    assert t.splitlines()[2] == "| M | 50.00 | 100.00 | 75.00 |"


def test_init_seed_fixes_the_initial_model_without_touching_the_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = PartialLabelNet("small_cnn", 5, init_seed=7)
    after = torch.rand(1)
    assert torch.equal(before, after), "init_seed must not consume the caller's random stream"
    b = PartialLabelNet("small_cnn", 5, init_seed=7)
    c = PartialLabelNet("small_cnn", 5, init_seed=8)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_customise_job_sets_the_seed_on_both_sides_and_rule_args(tmp_path):
    dest = customise_job(
        REPO / "jobs" / "fedmlp_ich",
        tmp_path / "j",
        num_rounds=3,
        seed=4,
        rule_args={"proto_weighting": "samples"},
        executor_args={"method_args": {"T0": 0.1}},
    )
    server = json.loads((dest / "app/config/config_fed_server.json").read_text())
    client = json.loads((dest / "app/config/config_fed_client.json").read_text())
    comps = {c["id"]: c for c in server["components"]}
    args = client["executors"][0]["executor"]["args"]
    assert server["num_rounds"] == 3 and comps["model"]["args"]["init_seed"] == 4 and args["seed"] == 4
    assert comps["aggregator"]["args"]["method_args"]["proto_weighting"] == "samples"
    assert args["method_args"]["T0"] == 0.1 and args["method_args"]["warmup_rounds"] == 5


@pytest.mark.parametrize("job", sorted(p.name for p in training_jobs(REPO / "jobs")))
def test_every_job_seeds_its_initial_global_model(job):
    server = json.loads((REPO / "jobs" / job / "app/config/config_fed_server.json").read_text())
    model = {c["id"]: c for c in server["components"]}["model"]
    assert isinstance(model["args"].get("init_seed"), int), f"{job}: the initial global model is not seeded"


def test_best_bold_second_underlined_upper_bound_not_ranked():
    mk = lambda auc: [{"auc": auc, "accuracy": 0.5, "f1": 0.5, "precision": 0.5, "recall": 0.5}]
    res = {
        "a": {"s": mk(0.80)},
        "b": {"s": mk(0.90)},
        "c": {"s": mk(0.85)},
        "d": {"s": mk(0.85)},
        "upper": {"s": mk(0.99)},
    }
    lines = {
        row.split(" | ")[0][2:]: row.split(" | ")[1]
        for row in paper_table(res, "multiclass", not_ranked=["upper"]).splitlines()[2:]
    }
    assert lines == {"a": "80.00", "b": "**90.00**", "c": "_85.00_", "d": "_85.00_", "upper": "99.00"}
    # equal means everywhere (the accuracy columns): every row is best, none second
    acc = paper_table(res, "multiclass", not_ranked=["upper"]).splitlines()[2].split(" | ")[2]
    assert acc == "**50.00**"
    # fewer than 3 competing rows: no marks
    two = paper_table({"a": {"s": mk(0.8)}, "b": {"s": mk(0.9)}}, "multiclass")
    assert "**" not in two and "_" not in two.split("\n", 2)[2]


def test_per_class_table_takes_runs_whose_sites_kept_a_class():
    """A class whose per-class metrics a run's sites kept (fewer than the minimum count) is absent from that run:
    the table still lists it, from the runs that have it (n/a where none has)."""
    from fedpartial.tables import per_class_table

    runs = {
        "m": [
            {"per_class": {"x": {"auc": 0.5}, "y": {"auc": 0.7}}, "macro": {"auc": 0.6}},
            {"per_class": {"x": {"auc": 0.6}}, "macro": {"auc": 0.6}},
        ],
        "n": [{"per_class": {"x": {"auc": 0.4}}, "macro": {"auc": 0.4}}],
    }
    lines = per_class_table(runs, task="multilabel").splitlines()
    assert lines[0] == "| Method | x: AUC | y: AUC | mean: AUC |"
    assert lines[2] == "| m | 55.00 ± 5.00 | 70.00 | 60.00 ± 0.00 |"
    assert lines[3] == "| n | 40.00 | n/a | 40.00 |"
