"""A hospital prepares its own export alone (``fedpartial-prepare --sites 1 --classes <the federation's>``) and the
simulator runs separately prepared hospitals as a federation (``job.py --site-data``).

Three exports in three shapes hospitals write, built from real HAM10000 images (``../shared/data/ham10000``):
hospital A a CSV with one column per class in its own order and spelling (``bcc, nv, mel``) and a column that is
no class, single-label, images of the classes it does not annotate as rows of ``0``; hospital B a CSV of one
label-name column in HAM10000's own codes (``akiec``, ``bkl``, ...) with blank cells (unlabelled images); hospital C
class folders named by HAM10000's codes (``df/``, ``mel/``, ``nv/``).
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import REPO, real_data
from fedpartial.data import prepare as prep
from fedpartial.data import prepare_cli
from fedpartial.data.manifest import ManifestError, read_manifest
from fedpartial.data.prepared import check_job_classes
from fedpartial.data.sources.base import NOT_ANNOTATED, SourceError, SourceTable
from fedpartial.metrics import multiclass_metrics

ISIC = ["MEL", "NV", "BCC", "AKIEC", "BKL", "DF", "VASC"]


def _table(classes, rows, task="multiclass", name="csv") -> SourceTable:
    frame = pd.DataFrame(rows, columns=classes)
    frame.insert(0, "image", [f"{i}.png" for i in range(len(rows))])
    frame.insert(1, "patient_id", [f"p{i}" for i in range(len(rows))])
    frame["line"] = range(2, len(rows) + 2)
    return SourceTable(name, task, list(classes), Path("."), frame, files=["export.csv"])


# ------------------------------------------------------------------------------------------------ vocabulary


def test_a_site_alone_gets_the_federation_vocabulary_in_its_order_with_the_rest_not_annotated():
    t = _table(["bcc", "nv", "mel"], [[0, 1, 0], [1, 0, 0], [0, 0, 0], [-1, -1, -1]])
    out = prep.subset_classes(t, ISIC, alone=True, export=True)
    assert out.classes == ISIC  # the job's order, the vocabulary's spelling
    values = out.frame[ISIC].to_numpy()
    assert values[:, :3].tolist() == [[0, 1, 0], [0, 0, 1], [0, 0, 0], [-1, -1, -1]]  # MEL NV BCC by name
    assert (values[:, 3:] == NOT_ANNOTATED).all()  # not annotated here
    assert len(out.frame) == 4  # the "none of my classes" row and the unlabelled row stay


def test_a_federation_of_several_sites_still_refuses_a_class_the_release_lacks_naming_the_closest():
    t = _table(["MEL", "NV"], [[1, 0], [0, 1]])
    with pytest.raises(ValueError, match=r"unknown class\(es\) \['BCC'\]"):
        prep.subset_classes(t, ["MEL", "NV", "BCC"])
    with pytest.raises(ValueError, match="closest: 'MEL'"):
        prep.subset_classes(t, ["MELL", "NV"])


def test_an_export_class_outside_the_vocabulary_or_no_class_of_it_is_one_error():
    t = _table(["mel", "nv", "scc"], [[1, 0, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="class 'scc' .*is not in the federation's classes"):
        prep.subset_classes(t, ISIC, alone=True, export=True)
    # a release's other classes are a subset choice: its rows of a class outside are left out, reported
    out = prep.subset_classes(t, ISIC, alone=True, export=False)
    assert len(out.frame) == 1 and "are of a class outside" in out.dropped[-1].reason
    with pytest.raises(ValueError, match="would annotate nothing"):
        prep.subset_classes(_table(["x1", "x2"], [[1, 0]]), ISIC, alone=True, export=True)


def test_a_single_label_row_of_zeros_over_the_whole_vocabulary_is_an_error_at_its_line():
    t = _table(ISIC, [[1, 0, 0, 0, 0, 0, 0], [0] * 7])
    with pytest.raises(SourceError, match="export.csv line 3: row of '1.png' is 0 in every class"):
        prep.check_rows_have_class(t)
    prep.check_rows_have_class(prep.subset_classes(_table(["MEL", "NV"], [[0, 0]]), ISIC, alone=True))  # fine


def test_manifest_columns_are_matched_by_name_in_any_order_and_case(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / "m.csv").write_text("nv,image,Mel,age\n1,a.png,0,\n")
    m = read_manifest(
        tmp_path / "m.csv", ISIC, data_root=tmp_path, task="multiclass", check_images=False, ignore_columns=["age"]
    )
    assert m.labels[0].tolist() == [0, 1, 0, 0, 0, 0, 0] and m.mask[0].tolist() == [True, True] + [False] * 5
    (tmp_path / "m.csv").write_text("image,Melanom\na.png,1\n")
    with pytest.raises(ManifestError, match="unknown class column.*Melanom.*closest: 'MEL'"):
        read_manifest(tmp_path / "m.csv", ISIC, data_root=tmp_path, task="multiclass", check_images=False)


def test_a_prepared_folder_with_the_classes_in_another_order_is_the_job_s():
    class P:
        classes, info, path = list(reversed(ISIC)), {}, Path("x")

    check_job_classes(P, ISIC)
    with pytest.raises(SourceError, match="only in the job: \\['MEL'\\]"):
        P.classes = ISIC[1:]
        check_job_classes(P, ISIC)


def test_single_label_metrics_score_only_the_rows_whose_class_is_annotated():
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    onehot = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 0]])  # the third row: a class not annotated here
    res = multiclass_metrics(onehot, probs, ["A", "B", "C"], mask=np.array([True, True, False]))
    assert res["n"] == 2 and res["macro"]["accuracy"] == 1.0
    with pytest.raises(ValueError, match="one-hot"):
        multiclass_metrics(onehot, probs, ["A", "B", "C"])


# ------------------------------------------------------------------------------------------- task=auto says


def test_task_auto_says_what_it_chose_and_why(tmp_path):
    from fedpartial.data.sources import load_source

    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / "b.png").write_bytes(b"x")
    (tmp_path / "c.png").write_bytes(b"x")
    csv_file = tmp_path / "e.csv"
    csv_file.write_text("image,patient_id,MEL,NV\na.png,1,1,0\nb.png,2,0,0\nc.png,3,,\n")
    auto = load_source("csv", csv_file)
    assert auto.task == "multilabel"
    assert "task=auto chose multilabel: line 3 (and 0 more) has no positive class" in auto.notes[0]
    assert "--task multiclass" in auto.notes[0]
    single = load_source("csv", csv_file, task="multiclass")  # never switched: the row of 0s and the blank stay
    assert single.task == "multiclass" and single.frame[["MEL", "NV"]].to_numpy().tolist() == [[1, 0], [0, 0], [-1, -1]]
    csv_file.write_text("image,patient_id,MEL,NV\na.png,1,1,0\nb.png,2,0,1\nc.png,3,,\n")
    auto = load_source("csv", csv_file)
    assert auto.task == "multiclass" and "1 unlabelled image(s)" in auto.notes[0]


# ------------------------------------------------------------------------------------ three real exports


def hospital_exports(dest: Path, per_site: int = 120) -> dict[str, Path]:
    """The three hospitals' exports (see the module docstring), real HAM10000 images copied in."""
    ham = real_data("ham10000")
    meta = [
        r
        for r in csv.DictReader(open(ham / "HAM10000_metadata.csv"))
        if (ham / "images" / f"{r['image_id']}.jpg").is_file()
    ]
    random.Random(3).shuffle(meta)
    by = {c: [r for r in meta if r["dx"] == c] for c in ("nv", "mel", "bcc", "akiec", "bkl", "df", "vasc")}
    a, b, c = dest / "a", dest / "b", dest / "c"
    for d in (a / "img", b / "img"):
        d.mkdir(parents=True)
    rows_a = by["nv"][: per_site // 2] + by["mel"][:25] + by["bcc"][:25] + by["bkl"][:20]
    with open(a / "export.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "bcc", "Patient", "nv", "mel", "age"])
        for r in rows_a:
            shutil.copy(ham / "images" / f"{r['image_id']}.jpg", a / "img")
            w.writerow(
                [
                    f"img/{r['image_id']}.jpg",
                    int(r["dx"] == "bcc"),
                    r["lesion_id"],
                    int(r["dx"] == "nv"),
                    int(r["dx"] == "mel"),
                    r["age"],
                ]
            )
    rows_b = by["nv"][100 : 100 + per_site // 2] + by["akiec"][:25] + by["bkl"][30:55] + by["vasc"][:20]
    with open(b / "labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["patient_id", "image", "dx"])
        for i, r in enumerate(rows_b):
            shutil.copy(ham / "images" / f"{r['image_id']}.jpg", b / "img")
            w.writerow([r["lesion_id"], f"img/{r['image_id']}.jpg", "" if i % 6 == 0 else r["dx"]])
    for cls, rows in (("nv", by["nv"][200 : 200 + per_site // 2]), ("mel", by["mel"][40:65]), ("df", by["df"][:25])):
        (c / cls).mkdir(parents=True)
        for r in rows:
            shutil.copy(ham / "images" / f"{r['image_id']}.jpg", c / cls)
    return {"a": a / "export.csv", "b": b / "labels.csv", "c": c}


PREPARE_ARGS = {
    "a": [
        "--source",
        "csv",
        "--task",
        "multiclass",
        "--source-arg",
        "image_column=file",
        "--source-arg",
        "patient_column=Patient",
        "--source-arg",
        "ignore_columns=age",
    ],
    "b": ["--source", "csv", "--source-arg", "label_column=dx"],
    "c": ["--source", "folder"],
}
"""Each hospital's own fedpartial-prepare options (the walkthrough of docs/deployment.md)."""


def prepare_alone(exports: dict[str, Path], dest: Path) -> dict[str, Path]:
    out = {}
    for h, root in exports.items():
        out[h] = dest / f"prepared_{h}"
        cmd = [
            *PREPARE_ARGS[h],
            "--root",
            str(root),
            "--out",
            str(out[h]),
            "--sites",
            "1",
            "--protocol",
            "full",
            "--classes",
            *ISIC,
            "--no-figure",
        ]
        assert prepare_cli.main(cmd) == 0, h
    return out


def federation_job(dest: Path, rounds: int | None = None) -> Path:
    """The three hospitals' own job (``new_job``: its own dataset name, the ISIC classes, single-label, 32 px)."""
    from fedpartial.tools import new_job

    job = dest / "derm_consortium"
    args = ["--method", "fedavg_pl", "--dataset", "derm_consortium", "--classes", *ISIC, "--task", "multiclass"]
    args += ["--channels", "3", "--image-size", "32", "--sites", "3"] + (["--rounds", str(rounds)] if rounds else [])
    assert new_job.main([str(job), *args]) == 0
    return job


@pytest.fixture(scope="module")
def prepared_hospitals(tmp_path_factory):
    root = tmp_path_factory.mktemp("hospitals")
    exports = hospital_exports(root)
    return exports, prepare_alone(exports, root)


def test_each_hospital_prepares_its_own_export_alone(prepared_hospitals, capsys, tmp_path):
    exports, prepared = prepared_hospitals
    want = {"a": ["MEL", "NV", "BCC"], "b": ["NV", "AKIEC", "BKL", "VASC"], "c": ["MEL", "NV", "DF"]}
    for h, folder in prepared.items():
        info = json.loads((folder / "dataset.json").read_text())
        assert info["classes"] == ISIC and info["task"] == "multiclass" and info["alone"] is True
        assert info["sites"]["site-1"] == want[h], h
        m = pd.read_csv(folder / "site-1.csv", dtype=str, keep_default_na=False)
        assert list(m.columns[3:]) == ISIC
        not_here = [c for c in ISIC if c not in want[h]]
        assert (m[not_here] == "").all().all(), h
    # hospital A: its BKL images (a class it does not annotate) are rows of 0 in its three classes, kept
    a = pd.concat(
        pd.read_csv(prepared["a"] / f, dtype=str, keep_default_na=False) for f in ("site-1.csv", "val.csv", "test.csv")
    )
    assert len(a) == 130 and ((a[["MEL", "NV", "BCC"]] == "0").all(axis=1)).sum() == 20
    # hospital B: its blank labels are unlabelled training images (never val / test), counted and printed
    b = json.loads((prepared["b"] / "dataset.json").read_text())
    assert b["unlabelled"]["site-1"] == 22 and b["unlabelled"]["val"] == b["unlabelled"]["test"] == 0
    assert "task=auto chose multiclass" in b["notes"][0]
    # the printed lines, from a run of the command again
    assert (
        prepare_cli.main(
            [
                *PREPARE_ARGS["b"],
                "--root",
                str(exports["b"]),
                "--out",
                str(tmp_path / "again"),
                "--sites",
                "1",
                "--protocol",
                "full",
                "--classes",
                *ISIC,
                "--no-figure",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "site-1 annotates 4 of 7 classes: NV, AKIEC, BKL, VASC; not annotated here: MEL, BCC, DF; unlabelled "
        "training images: 22"
    ) in out


def test_an_export_naming_a_class_outside_the_vocabulary_is_one_line(prepared_hospitals, tmp_path, capsys):
    exports, _ = prepared_hospitals
    rc = prepare_cli.main(
        [
            *PREPARE_ARGS["c"],
            "--root",
            str(exports["c"]),
            "--out",
            str(tmp_path / "o"),
            "--sites",
            "1",
            "--protocol",
            "full",
            "--classes",
            "MEL",
            "NV",
            "BCC",
            "--no-figure",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "class 'df' is not in the federation's classes" in err[0]
    assert not (tmp_path / "o").exists()


def test_the_simulator_runs_separately_prepared_hospitals_each_scoring_its_own_sets(
    prepared_hospitals, tmp_path, data_cache
):
    """The federation's own job (``new_job --dataset derm_consortium --classes ... --task multiclass``, no preset)
    run as ``python job.py --site-data ...``: three sites, each its own folder; each site's test set scored by that
    site, the pooled test the sets' size-weighted mean; the results name each site's data."""
    _, prepared = prepared_hospitals
    job = federation_job(tmp_path / "jobs")
    env = {**os.environ, "FEDPARTIAL_CACHE": str(data_cache)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    ws = tmp_path / "ws"
    cmd = [
        sys.executable,
        str(job / "job.py"),
        "--rounds",
        "1",
        "--workspace",
        str(ws),
        *[f"--site-data=site-{i}={prepared[h]}" for i, h in enumerate("abc", 1)],
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tmp_path = ws
    res = json.loads((tmp_path / "derm_consortium/server/simulate_job/results.json").read_text())
    assert res["rounds"][0]["sites"] == ["site-1", "site-2", "site-3"] and not res["rounds"][0]["missing"]
    assert res["data"]["shared_eval_sets"] == {"val": [], "test": []}  # every site its own sets
    # the results name the data each site trained on, not the job's preset
    assert res["dataset"] == "csv (export.csv) + csv (labels.csv) + folder (c)"
    assert res["job_dataset"] == "derm_consortium"
    for i, h in enumerate("abc", 1):
        source = res["data"]["sites"][f"site-{i}"]["source"]
        assert source["fingerprint"] == json.loads((prepared[h] / "dataset.json").read_text())["fingerprint"]
    md = (tmp_path / "derm_consortium/server/simulate_job/results.md").read_text()
    assert md.startswith("# fedavg_pl on csv (export.csv) + csv (labels.csv) + folder (c)")
    annotated = {s: [ISIC[j] for j in d["annotated"]] for s, d in res["data"]["sites"].items()}
    assert annotated == {
        "site-1": ["MEL", "NV", "BCC"],
        "site-2": ["NV", "AKIEC", "BKL", "VASC"],
        "site-3": ["MEL", "NV", "DF"],
    }
    final = next(iter(res["final"].values()))
    per_site = {s: r["test"] for s, r in final["per_site"].items()}
    assert sorted(per_site) == ["site-1", "site-2", "site-3"]
    n = {s: t["n"] for s, t in per_site.items()}
    assert final["test"]["n"] == sum(n.values()) and all(v > 0 for v in n.values())
    weighted = sum(per_site[s]["macro"]["accuracy"] * n[s] for s in n) / sum(n.values())
    assert final["test"]["macro"]["accuracy"] == pytest.approx(weighted)
    # each hospital's own test set: the AUROC within each, their plain mean, and all pooled (results.md says so)
    across = final["across_sites"]
    assert across["within_site_auc"] == pytest.approx({s: t["macro"]["auc"] for s, t in per_site.items()})
    assert across["mean_within_site_auc"] == pytest.approx(np.mean([t["macro"]["auc"] for t in per_site.values()]))
    assert 0.0 <= across["pooled_auc"] <= 1.0
    assert "test AUROC within each site site-1" in md and "all sites pooled" in md
    for site in ("site-1", "site-2", "site-3"):
        log = (tmp_path / "derm_consortium" / site / "log.txt").read_text()
        assert "Traceback" not in log, site


def test_a_job_for_a_federation_s_own_classes_needs_them_said():
    from fedpartial.tools.new_job import dataset_arg

    with pytest.raises(ValueError, match="needs --task, --channels"):
        dataset_arg("derm_consortium", classes=["A,B", "C"])
    assert dataset_arg("derm_consortium", ["A,B", "C"], "multilabel", 1) == {
        "name": "derm_consortium",
        "image_size": 64,
        "classes": ["A", "B", "C"],
        "task": "multilabel",
        "channels": 1,
    }
    assert dataset_arg("ham10000", ["MEL", "NV"]) == {"preset": "ham10000", "classes": ["MEL", "NV"]}
