"""What a hospital's own export may contain, each case on tiny images built here: label cells that spell a missing
value (``nan``, ``N/A``, ``#N/A``, ...), one class spelt several ways (``nv`` / ``NV``, ``Pneumonia/`` /
``pneumonia/``), an export with no labelled image, byte-identical copies labelled differently, images of a
degenerate size, and ``job.py --site-data`` naming a folder that is not there. Each is read as docs/datasets.md
("What your export may contain") says: treated as missing or merged and reported, or one line naming the file
and the row, before any training."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from conftest import REPO
from fedpartial.data import prepare as prep
from fedpartial.data import prepare_cli, quality
from fedpartial.data.sources import load_source
from fedpartial.data.sources.base import NOT_ANNOTATED, SourceError, SourceTable

MISSING = ["", " ", "nan", "NaN", "NA", "N/A", "n/a", "null", "NULL", "None", "none", "#N/A", "-", "?"]
"""The spellings of a missing value the brief of the exports lists (a blank cell and one of spaces included)."""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPARTIAL_CACHE", str(tmp_path / "cache"))


def _png(path: Path, size: tuple[int, int] = (40, 40), shade: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(shade)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)


def _export(folder: Path, labels: list[str], column: str = "dx", sizes: dict[int, tuple[int, int]] | None = None):
    """``folder/labels.csv`` (image, patient_id, ``column``) and one distinct 40 x 40 PNG per row (``sizes``: other
    sizes of some rows); returns the CSV."""
    rows = []
    for i, label in enumerate(labels):
        _png(folder / "img" / f"{i}.png", (sizes or {}).get(i, (40, 40)), shade=i)
        rows.append({"image": f"img/{i}.png", "patient_id": f"p{i}", column: label})
    pd.DataFrame(rows).to_csv(folder / "labels.csv", index=False)
    return folder / "labels.csv"


def _prepare(csv: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--source",
        "csv",
        "--root",
        str(csv),
        "--out",
        str(out),
        "--sites",
        "1",
        "--protocol",
        "full",
        "--no-figure",
        *extra,
    ]


# ------------------------------------------------------------------------------------------ missing values


def test_missing_value_spellings_in_a_label_column_are_unlabelled_and_counted_once(tmp_path):
    labels = ["mel", "nv"] * 6 + MISSING
    table = load_source("csv", _export(tmp_path, labels), label_column="dx")
    assert table.classes == ["mel", "nv"] and table.task == "multiclass"
    values = table.frame[["mel", "nv"]].to_numpy()
    assert (values[12:] == NOT_ANNOTATED).all() and (values[:12] >= 0).all()
    [said] = [n for n in table.notes if "missing value" in n]
    assert "14 cell(s) of column 'dx' spell a missing value, read as unlabelled images" in said
    # listed once each, with its count (the cells are read stripped: a cell of spaces is an empty one)
    for spelling in ["'nan' (1 row)", "'#N/A' (1 row)", "'' (2 rows)", "'NULL' (1 row)", "'?' (1 row)"]:
        assert spelling in said


def test_missing_value_spellings_in_class_columns_are_blank_and_minus_one_stays_uncertain(tmp_path):
    for i in range(4):
        _png(tmp_path / f"{i}.png", shade=i)
    (tmp_path / "e.csv").write_text(
        "image,patient_id,Effusion,Mass\n0.png,a,1,N/A\n1.png,b,#N/A,-1\n2.png,c,null,0\n3.png,d,?,-\n"
    )
    table = load_source("csv", tmp_path / "e.csv", task="multilabel", uncertain="zeros")
    assert table.frame[["Effusion", "Mass"]].to_numpy().tolist() == [
        [1, NOT_ANNOTATED],
        [NOT_ANNOTATED, 0],  # -1: uncertain (CheXpert's code), here uncertain=zeros
        [NOT_ANNOTATED, 0],
        [NOT_ANNOTATED, NOT_ANNOTATED],
    ]
    [said] = [n for n in table.notes if "missing value" in n]
    assert "5 class cell(s) are blank or spell a missing value, read as not annotated" in said
    assert "'N/A' (1 cell)" in said and "'-' (1 cell)" in said


def test_a_multilabel_column_reads_missing_values_and_merges_spellings(tmp_path):
    labels = ["Effusion|Mass", "effusion", "No Finding", "no finding", "NaN", "Mass|nan", "MASS|Effusion", "N/A|"]
    table = load_source("csv", _export(tmp_path, labels, "Finding Labels"), label_column="Finding Labels")
    assert table.task == "multilabel" and table.classes == ["Effusion", "Mass"]
    assert table.frame[["Effusion", "Mass"]].to_numpy().tolist() == [
        [1, 1],
        [1, 0],
        [0, 0],
        [0, 0],  # 'no finding' is the none label in another case
        [NOT_ANNOTATED, NOT_ANNOTATED],
        [0, 1],  # a stray missing token beside a finding is dropped
        [1, 1],
        [NOT_ANNOTATED, NOT_ANNOTATED],
    ]
    notes = "\n".join(table.notes)
    assert "2 cell(s) of column 'Finding Labels' spell a missing value" in notes and "'N/A' (1 row)" in notes
    assert "1 missing value(s) beside a class name in column 'Finding Labels' were dropped: 'nan' (1 row)" in notes
    assert "class 'Mass' also spelt 'MASS' (1 row)" in notes


# ------------------------------------------------------------------------------------------ one class, many spellings


def test_class_names_differing_in_case_are_one_class_spelt_as_most_rows_spell_it(tmp_path):
    labels = ["nv"] * 5 + ["NV"] * 3 + ["Nv"] + [" mel "] * 2 + ["MEL"]
    table = load_source("csv", _export(tmp_path, labels), label_column="dx")
    assert table.classes == ["mel", "nv"]
    assert table.frame["nv"].tolist() == [1] * 9 + [0] * 3
    assert "csv: class 'nv' also spelt 'NV' (3 rows), 'Nv' (1 row): read as one class" in "\n".join(table.notes)
    assert "class 'mel' also spelt 'MEL' (1 row)" in "\n".join(table.notes)
    # the loader's classes name the spelling kept
    table = load_source("csv", tmp_path / "labels.csv", label_column="dx", classes="NV,MEL")
    assert table.classes == ["NV", "MEL"] and table.frame["NV"].sum() == 9
    assert "class 'NV' also spelt 'nv' (5 rows), 'Nv' (1 row)" in "\n".join(table.notes)


def test_class_folders_differing_in_case_are_one_class(tmp_path):
    for i in range(3):
        _png(tmp_path / "Pneumonia" / f"a{i}.png", shade=i)
    _png(tmp_path / "pneumonia" / "b.png", shade=7)
    for i in range(2):
        _png(tmp_path / "Normal" / f"n{i}.png", shade=10 + i)
    table = load_source("folder", tmp_path)
    assert table.classes == ["Normal", "Pneumonia"] and table.frame["Pneumonia"].sum() == 4
    assert "folder: class folder 'Pneumonia' also spelt 'pneumonia' (1 image)" in "\n".join(table.notes)
    table = load_source("folder", tmp_path, classes="normal,pneumonia")
    assert table.classes == ["normal", "pneumonia"] and table.frame["pneumonia"].sum() == 4


def test_spellings_that_cannot_be_told_apart_are_one_line_before_training(tmp_path, capsys):
    # two class columns that differ only in case
    _png(tmp_path / "a.png")
    (tmp_path / "e.csv").write_text("image,patient_id,nv,NV\na.png,p,1,0\n")
    with pytest.raises(SourceError, match=r"e.csv line 1: class columns \['nv', 'NV'\] differ only in case"):
        load_source("csv", tmp_path / "e.csv")
    # the federation's classes naming one class twice
    csv = _export(tmp_path / "x", ["nv", "mel", "nv", "mel"])
    rc = prepare_cli.main(
        _prepare(csv, tmp_path / "out", "--source-arg", "label_column=dx", "--classes", "MEL", "NV", "nv")
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "the classes 'NV' and 'nv' differ only in case or spaces: one class or two?" in err[0]
    from fedpartial.data.sources.base import merge_spellings

    with pytest.raises(SourceError, match="'NV' and 'nv' differ only in case"):
        merge_spellings({"nv": 1}, ["NV", "nv"])


def test_prepare_reports_what_was_merged_and_what_was_missing_and_keeps_the_classes_spelling(tmp_path, capsys):
    labels = ["nv", "NV", "Nv", "mel", "nan", "NA", "N/A", "null", "None", "#N/A", " "] + ["nv", "mel"] * 6
    csv = _export(tmp_path / "export", labels)
    out = tmp_path / "out"
    rc = prepare_cli.main(_prepare(csv, out, "--source-arg", "label_column=dx", "--classes", "MEL", "NV", "BCC"))
    printed, err = capsys.readouterr()
    assert rc == 0, err
    info = json.loads((out / "dataset.json").read_text())
    assert info["classes"] == ["MEL", "NV", "BCC"] and info["sites"]["site-1"] == ["MEL", "NV"]
    assert info["unlabelled"]["site-1"] == 7
    notes = "\n".join(info["notes"])
    assert "7 cell(s) of column 'dx' spell a missing value" in notes and "'#N/A' (1 row)" in notes
    assert "class 'nv' also spelt 'NV' (1 row), 'Nv' (1 row)" in notes
    for note in info["notes"]:
        assert note in printed
    rows = pd.concat(pd.read_csv(out / f, dtype=str, keep_default_na=False) for f in info["files"].values())
    assert len(rows) == len(labels) and (rows["NV"] == "1").sum() == 9


# ------------------------------------------------------------------------------------------ the lesser cases


def test_an_export_with_no_labelled_image_names_its_csv_not_a_temporary_file(tmp_path, capsys):
    csv = _export(tmp_path / "export", ["nan", "", "N/A", "null"])
    for extra in ([], ["--classes", "MEL", "NV", "--task", "multiclass"]):
        rc = prepare_cli.main(_prepare(csv, tmp_path / "out", "--source-arg", "label_column=dx", *extra))
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, err
        assert f"error: {csv}: " in err[0] and "none of its 4 image(s) has a label" in err[0]
        assert ".tmp-" not in err[0]
    # a class-column export blank everywhere, prepared for several sites
    for i in range(4):
        _png(tmp_path / "b" / f"{i}.png", shade=i)
    (tmp_path / "b" / "e.csv").write_text("image,patient_id,MEL,NV\n" + "".join(f"{i}.png,p{i},,\n" for i in range(4)))
    with pytest.raises(SourceError) as e:
        prep.prepare("csv", tmp_path / "b" / "e.csv", tmp_path / "out", 2, "full", verbose=False, figure=False)
    assert str(e.value).startswith(f"{tmp_path / 'b' / 'e.csv'}: none of its 4 image(s) has a label")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_byte_identical_images_with_conflicting_labels_are_named_with_their_labels(tmp_path):
    csv = _export(tmp_path, ["nv", "mel", "nv", "mel", "nv", "mel"])
    (tmp_path / "img" / "1.png").write_bytes((tmp_path / "img" / "0.png").read_bytes())  # nv and mel: one image
    (tmp_path / "img" / "4.png").write_bytes((tmp_path / "img" / "2.png").read_bytes())  # nv twice: agree
    out = prep.prepare(
        "csv", csv, tmp_path / "out", 1, "full", source_args={"label_column": "dx"}, verbose=False, figure=False
    )
    notes = json.loads((out / "dataset.json").read_text())["notes"]
    [conflict] = [n for n in notes if "conflicting labels" in n]
    assert (
        "csv: 1 group(s) of byte-identical images have conflicting labels: img/0.png (line 2): nv vs "
        "img/1.png (line 3): mel;"
    ) in conflict
    assert "img/2.png" not in conflict  # the copies that agree are only the duplicates' line
    assert any("byte-identical copies in 2 group(s)" in n for n in notes)


def test_conflicting_labels_of_multilabel_copies_name_the_findings():
    frame = pd.DataFrame(
        {"image": ["a.png", "b.png", "c.png"], "patient_id": ["1", "2", "3"], "A": [1, 1, -1], "B": [0, 1, 1]}
    )
    table = SourceTable("hosp", "multilabel", ["A", "B"], Path("."), frame, files=["x.csv"], lines=[2, 3, 4])
    quality.conflicting_copies(table, [[0, 1], [1, 2]])  # b and c agree where both annotate
    assert table.notes == [
        "hosp: 1 group(s) of byte-identical images have conflicting labels: a.png (line 2): A vs b.png (line 3): "
        "A+B; one image cannot be both: correct the labels, or --exclude the wrong copy"
    ]


def test_degenerate_image_sizes_are_one_line_with_examples_from_the_decode(tmp_path, monkeypatch):
    sizes = {1: (1, 1), 2: (1, 5000), 3: (5000, 20), 4: (31, 40), 5: (320, 32)}
    csv = _export(tmp_path, ["nv", "mel"] * 4, sizes=sizes)
    out = prep.prepare(
        "csv", csv, tmp_path / "out", 1, "full", source_args={"label_column": "dx"}, verbose=False, figure=False
    )
    [said] = [n for n in json.loads((out / "dataset.json").read_text())["notes"] if "degenerate" in n]
    assert said.startswith(
        "csv: 4 image(s) of a degenerate size (shorter side under 32 px, or one side over 10 times the other): "
        "img/1.png 1 x 1 px (line 3), img/2.png 1 x 5000 px (line 4), img/3.png 5000 x 20 px (line 5), "
        "img/4.png 31 x 40 px (line 6); they are kept"
    )
    # the sizes are the decode's, kept in its cache: a second prepare opens no image and says the same
    monkeypatch.setattr(quality, "decode_image", lambda p: pytest.fail(f"{p} decoded again"))
    again = prep.prepare(
        "csv", csv, tmp_path / "again", 1, "full", source_args={"label_column": "dx"}, verbose=False, figure=False
    )
    assert said in json.loads((again / "dataset.json").read_text())["notes"]


def test_degenerate_sizes_of_many_images_are_counted_not_listed():
    frame = pd.DataFrame({"image": [f"{i}.png" for i in range(100_000)], "patient_id": "p", "A": 1})
    table = SourceTable("big", "multiclass", ["A"], Path("."), frame)
    t0 = time.perf_counter()
    quality.degenerate_sizes(table, range(100_000), [(1, 1) if i % 2 else (64, 64) for i in range(100_000)])
    assert time.perf_counter() - t0 < 5
    [said] = table.notes
    assert said.startswith("big: 50000 image(s) of a degenerate size") and ", ... 49995 more;" in said
    assert said.count(".png") == 5


def test_site_data_naming_a_missing_folder_stops_job_py_at_once(tmp_path, monkeypatch, capsys):
    from fedpartial.fl import simulator
    from fedpartial.recipes import job_main
    from fedpartial.tools.build_jobs import load_job_module

    monkeypatch.setattr(simulator, "supervise", lambda *a, **k: pytest.fail("the simulator was started"))
    recipe = load_job_module(REPO / "jobs" / "fedavg_ich").recipe
    (tmp_path / "empty").mkdir()
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "dataset.json").write_text("{}")  # site-1's folder passes the check (it is not read)
    for folder, said in (
        (tmp_path / "gone", f"the folder {tmp_path / 'gone'} does not exist"),
        (tmp_path / "empty", f"{tmp_path / 'empty'} holds no dataset.json: it is not a prepared folder"),
    ):
        for how in (["--site-data", f"site-2={folder}"], [f"--site-data=site-2={folder}"]):
            t0 = time.perf_counter()
            with pytest.raises(SystemExit) as e:
                job_main(recipe, [f"--site-data=site-1={tmp_path / 'ok'}", *how, "--workspace", str(tmp_path / "ws")])
            assert e.value.code == 2 and time.perf_counter() - t0 < 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"error: --site-data site-2={folder}: {said}" in err[0], err
    assert not (tmp_path / "ws").exists()
