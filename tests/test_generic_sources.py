"""The two generic sources, ``--source csv`` and ``--source folder``, on tiny copies built from the shared real
images: a hospital's multi-label export (1 / 0 / -1 / blank cells), NIH's ``Finding Labels`` layout, a single-label
label-name CSV and a class-folder tree. The manifests say what the files say (blank = not annotated), and every
bad input stops with one line naming the file and the line (or the folder)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from published_layouts import HAM, NIH, ham_sample, nih_sample

from conftest import REPO, real_data
from fedpartial.data import prepare as prep
from fedpartial.data import prepare_cli
from fedpartial.data.sources import load_source
from fedpartial.data.sources.base import NOT_ANNOTATED, SourceError
from fedpartial.data.store_cli import store_dataset

pytestmark = pytest.mark.realdata

CXR = ["Cardiomegaly", "Effusion", "Infiltration", "Emphysema", "Hernia"]
"""Five NIH findings with positives among the sample's first rows."""


@pytest.fixture(autouse=True)
def _shared_data(tmp_path, monkeypatch):
    for folder in (NIH, HAM):
        real_data(folder.name)
    monkeypatch.setenv("FEDPARTIAL_CACHE", str(tmp_path / "cache"))


# ------------------------------------------------------------------------------------------------ tiny copies


def _cell(truth: int, i: int, j: int) -> str:
    """A hospital export's cell: mostly the NIH truth (as 1 / 0 or 1.0 / 0.0), some blank (not annotated), some
    -1 (uncertain)."""
    if (i + 2 * j) % 5 == 0:
        return ""
    if (3 * i + j) % 11 == 0:
        return "-1"
    return f"{truth}.0" if i % 4 == 0 else str(bool(truth)) if i % 4 == 1 else str(truth)


def hospital_export(dest: Path, n: int = 36) -> tuple[Path, pd.DataFrame]:
    """``dest/export/labels.csv`` (``Accession,file,PatientID,Age`` + one column per class in ``CXR``) with the
    images under ``dest/export/images/p<patient>/``; returns the CSV and its cells (as written)."""
    df = nih_sample(n)
    export = dest / "export"
    rows = []
    for i, r in df.iterrows():
        rel = f"images/p{r['Patient ID']}/{r['Image Index']}"
        (export / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(NIH / "images" / r["Image Index"], export / rel)
        rows.append(
            {
                "Accession": f"A{1000 + i}",
                "file": rel,
                "PatientID": f"P{r['Patient ID']}",
                "Age": str(40 + i % 30),
                **{c: _cell(int(r[c]), i, j) for j, c in enumerate(CXR)},
            }
        )
    cells = pd.DataFrame(rows)
    cells.to_csv(export / "labels.csv", index=False)
    return export / "labels.csv", cells


HOSPITAL_ARGS = {"image_column": "file", "patient_column": "PatientID", "ignore_columns": "Accession,Age"}


def findings_csv(dest: Path, n: int = 30) -> tuple[Path, pd.DataFrame]:
    """NIH's ``Finding Labels`` layout (``a|b`` or ``No Finding``; bare file names, images in ``dest/png``; the CSV
    in ``dest/meta``)."""
    df = nih_sample(n)
    classes = list(df.columns[2:])
    (dest / "png").mkdir(parents=True, exist_ok=True)
    (dest / "meta").mkdir(parents=True, exist_ok=True)
    for name in df["Image Index"]:
        shutil.copy(NIH / "images" / name, dest / "png" / name)
    text = ["Image Index,Finding Labels,Patient ID"]
    for _, r in df.iterrows():
        found = [c for c in classes if r[c] == 1]
        text.append(f"{r['Image Index']},{'|'.join(found) or 'No Finding'},{r['Patient ID']}")
    (dest / "meta" / "entries.csv").write_text("\n".join(text) + "\n")
    return dest / "meta" / "entries.csv", df


def _jpeg(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(src) as im:
        im.convert("RGB").resize((32, 32)).save(dest, "JPEG", quality=90)


def ham_folder(dest: Path, n: int = 28) -> tuple[Path, pd.DataFrame]:
    """``dest/<DX>/<lesion_id>_<image_id>.jpg`` (one folder per class, HAM10000 images at 32 px)."""
    ham = ham_sample(n)
    for _, r in ham.iterrows():
        _jpeg(HAM / "images" / f"{r['image_id']}.jpg", dest / r["dx"].upper() / f"{r['lesion_id']}_{r['image_id']}.jpg")
    return dest, ham


def ham_dx_csv(dest: Path, n: int = 28) -> tuple[Path, pd.DataFrame]:
    """A single-label CSV with a label-name column (``diagnosis``) and the images in ``dest/jpg``."""
    ham = ham_sample(n)
    for i in ham["image_id"]:
        _jpeg(HAM / "images" / f"{i}.jpg", dest / "jpg" / f"{i}.jpg")
    pd.DataFrame(
        {
            "image": [f"jpg/{i}.jpg" for i in ham["image_id"]],
            "patient_id": ham["lesion_id"],
            "diagnosis": ham["dx"].str.upper(),
        }
    ).to_csv(dest / "dx.csv", index=False)
    return dest / "dx.csv", ham


def _raw(out: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(out / f"{name}.csv", dtype=str, keep_default_na=False)


def _all_rows(out: Path) -> pd.DataFrame:
    info = json.loads((out / "dataset.json").read_text())
    return pd.concat([_raw(out, n).assign(part=n) for n in info["files"]], ignore_index=True)


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(SourceError) as e:
        fn(*args, **kwargs)
    text = str(e.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------------- csv: one column per class

EXPECTED = {"1": 1, "1.0": 1, "True": 1, "0": 0, "0.0": 0, "False": 0, "": NOT_ANNOTATED}
NORMAL = {"1": "1", "1.0": "1", "True": "1", "0": "0", "0.0": "0", "False": "0", "": "", "-1": "-1"}
"""An export's cell -> the manifest's ('' = not annotated)."""


@pytest.mark.parametrize("uncertain, code", [("ignore", NOT_ANNOTATED), ("zeros", 0), ("ones", 1)])
def test_class_columns_read_cell_by_cell(tmp_path, uncertain, code):
    csv, cells = hospital_export(tmp_path)
    t = load_source("csv", csv, uncertain=uncertain, **HOSPITAL_ARGS)
    assert t.task == "multilabel" and t.classes == CXR  # Accession / Age ignored, the CSV's column order kept
    assert t.root == csv.parent.resolve() and t.files == [str(csv.resolve())]
    assert list(t.frame["image"]) == list(cells["file"]) and list(t.frame["patient_id"]) == list(cells["PatientID"])
    assert list(t.frame["line"]) == list(range(2, len(cells) + 2))
    counts = {k: 0 for k in ("1", "0", "", "-1", "True", "False", "1.0", "0.0")}
    for i, r in cells.iterrows():
        for c in CXR:
            want = code if r[c] == "-1" else EXPECTED[r[c]]
            assert t.frame.loc[i, c] == want, (i, c, r[c])
            counts[r[c]] += 1
    assert min(counts.values()) >= 2 and counts[""] >= 5 and counts["-1"] >= 5, counts  # every kind of cell


def test_blank_zeros_policy_and_the_class_subset(tmp_path):
    csv, cells = hospital_export(tmp_path)
    t = load_source("csv", csv, blank="zeros", classes="Hernia,Effusion", **HOSPITAL_ARGS)
    assert t.classes == ["Hernia", "Effusion"]  # the order given
    blank = cells["Hernia"] == ""
    assert blank.sum() > 0 and (t.frame.loc[blank, "Hernia"] == 0).all()


def test_prepare_writes_blank_cells_as_not_annotated(tmp_path):
    """The manifests (sites, val and test) say what the export says: a blank or uncertain cell stays empty (not
    annotated), never a negative."""
    csv, cells = hospital_export(tmp_path)
    out = prep.prepare(
        "csv",
        csv,
        tmp_path / "out",
        2,
        "full",
        val_frac=0.2,
        test_frac=0.2,
        source_args=HOSPITAL_ARGS,
        verbose=False,
        figure=False,
    )
    info = json.loads((out / "dataset.json").read_text())
    assert info["source"] == "csv" and info["task"] == "multilabel" and info["classes"] == CXR
    assert Path(info["data_root"]) == csv.parent.resolve()
    assert str(csv.resolve()) in info["source_files"]
    rows = _all_rows(out).set_index("image")
    assert sorted(rows.index) == sorted(cells["file"])
    assert set(rows["part"]) == {"site-1", "site-2", "val", "test"}
    src = cells.set_index("file")
    for image, r in rows.iterrows():
        for c in CXR:
            v = src.loc[image, c]
            assert r[c] == {"-1": ""}.get(v, NORMAL[v]), (image, c, v)


def test_missing_k_blanks_whole_columns_on_top_of_the_exports_blanks(tmp_path):
    csv, cells = hospital_export(tmp_path)
    out = prep.prepare(
        "csv",
        csv,
        tmp_path / "out",
        3,
        "missing_k",
        k=2,
        source_args=HOSPITAL_ARGS,
        val_frac=0.2,
        test_frac=0.2,
        verbose=False,
        figure=False,
    )
    info = json.loads((out / "dataset.json").read_text())
    src = cells.set_index("file")
    for site, annotated in info["sites"].items():
        m = _raw(out, site)
        assert len(annotated) == 3
        for c in CXR:
            if c not in annotated:
                assert (m[c] == "").all()
            else:
                written = m[c] != ""
                exported = m["image"].map(lambda p: src.loc[p, c] not in ("", "-1"))
                assert (written == exported).all(), (site, c)


def test_task_auto_one_hot_columns_are_single_label(tmp_path):
    ham = ham_sample(14)
    for i in ham["image_id"]:
        _jpeg(HAM / "images" / f"{i}.jpg", tmp_path / f"{i}.jpg")
    classes = sorted(ham["dx"].unique())
    df = pd.DataFrame({"image": [f"{i}.jpg" for i in ham["image_id"]], "patient_id": ham["lesion_id"]})
    for c in classes:
        df[c] = (ham["dx"] == c).astype(int)
    df.to_csv(tmp_path / "onehot.csv", index=False)
    t = load_source("csv", tmp_path / "onehot.csv")
    assert t.task == "multiclass" and t.classes == classes
    assert (t.frame[classes].to_numpy().argmax(axis=1) == [classes.index(d) for d in ham["dx"]]).all()
    assert load_source("csv", tmp_path / "onehot.csv", task="multilabel").task == "multilabel"
    df.loc[3, classes[0]] = 1 - df.loc[3, classes[0]]  # a row with 0 or 2 positives: multi-label
    df.to_csv(tmp_path / "onehot.csv", index=False)
    assert load_source("csv", tmp_path / "onehot.csv").task == "multilabel"
    text = _error(load_source, "csv", tmp_path / "onehot.csv", task="multiclass")
    assert "line 5" in text and "single-label" in text


# ------------------------------------------------------------------------------------ csv: label names


def test_finding_labels_column_with_separator_and_no_finding(tmp_path):
    csv, df = findings_csv(tmp_path)
    t = load_source(
        "csv",
        csv,
        image_column="Image Index",
        label_column="Finding Labels",
        patient_column="Patient ID",
        images_root="../png",
    )
    found = [c for c in df.columns[2:] if df[c].sum() > 0]
    assert t.task == "multilabel" and t.classes == sorted(found)
    assert t.root == (tmp_path / "png").resolve() and list(t.frame["image"]) == list(df["Image Index"])
    assert (t.frame[t.classes].to_numpy() == df[t.classes].to_numpy()).all()  # NIH's truth, exactly
    assert (df[t.classes].sum(axis=1) == 0).any()  # some 'No Finding' rows: every class negative
    # the job's classes given: the names outside them are errors, the others read in the order given
    t = load_source(
        "csv",
        csv,
        image_column="Image Index",
        label_column="Finding Labels",
        patient_column="Patient ID",
        images_root=str((tmp_path / "png").resolve()),
        classes=list(df.columns[2:]),
    )
    assert t.classes == list(df.columns[2:]) and (t.frame[t.classes].to_numpy() == df[t.classes].to_numpy()).all()


def test_blank_label_name_is_not_annotated_in_multilabel(tmp_path):
    csv, df = findings_csv(tmp_path)
    cells = pd.read_csv(csv, dtype=str, keep_default_na=False)
    cells.loc[2, "Finding Labels"] = ""  # line 4: not annotated at all
    cells.to_csv(csv, index=False)
    args = dict(
        image_column="Image Index", label_column="Finding Labels", patient_column="Patient ID", images_root="../png"
    )
    t = load_source("csv", csv, **args)
    assert (t.frame.loc[2, t.classes] == NOT_ANNOTATED).all()
    assert (t.frame.drop(index=2)[t.classes].to_numpy() == df.drop(index=2)[t.classes].to_numpy()).all()
    t = load_source("csv", csv, blank="zeros", **args)
    assert (t.frame.loc[2, t.classes] == 0).all()


def test_single_label_name_column_prepares_one_hot(tmp_path):
    csv, ham = ham_dx_csv(tmp_path)
    out = prep.prepare(
        "csv",
        csv,
        tmp_path / "out",
        2,
        "full",
        source_args={"label_column": "diagnosis"},
        val_frac=0.2,
        test_frac=0.2,
        verbose=False,
        figure=False,
    )
    info = json.loads((out / "dataset.json").read_text())
    assert info["task"] == "multiclass" and info["classes"] == sorted(ham["dx"].str.upper().unique())
    rows = _all_rows(out).set_index("image")
    for _, r in ham.iterrows():
        row = rows.loc[f"jpg/{r['image_id']}.jpg"]
        assert [c for c in info["classes"] if row[c] == "1"] == [r["dx"].upper()]
        assert all(row[c] == "0" for c in info["classes"] if c != r["dx"].upper())
    # one lesion's images stay in one part (patient_id = lesion_id)
    lesions = rows.reset_index().groupby("patient_id")["part"].nunique()
    assert (lesions == 1).all()


def test_image_ids_with_a_suffix_and_an_images_root(tmp_path):
    csv, ham = ham_dx_csv(tmp_path, n=14)
    df = pd.read_csv(csv, dtype=str)
    df["image"] = ham["image_id"]  # ids, as the ISIC ground truth writes them
    df.to_csv(csv, index=False)
    text = _error(load_source, "csv", csv, label_column="diagnosis", images_root="absent")
    assert f"images root {(tmp_path / 'absent').resolve()} is not a folder" in text
    t = load_source("csv", csv, label_column="diagnosis", images_root="jpg", image_suffix=".jpg")
    assert t.root == (tmp_path / "jpg").resolve() and list(t.frame["image"]) == [f"{i}.jpg" for i in ham["image_id"]]
    assert all((t.root / p).is_file() for p in t.frame["image"])


def test_split_column_is_the_publishers_split(tmp_path):
    csv, cells = hospital_export(tmp_path)
    pids = sorted(cells["PatientID"].unique())
    split = {p: "test" if k % 4 == 0 else "Validation" if k % 4 == 1 else "train" for k, p in enumerate(pids)}
    cells["Split"] = cells["PatientID"].map(split)
    cells.to_csv(csv, index=False)
    out = prep.prepare(
        "csv",
        csv,
        tmp_path / "out",
        2,
        "full",
        source_args={**HOSPITAL_ARGS, "split_column": "Split"},
        verbose=False,
        figure=False,
    )
    assert set(_raw(out, "test")["image"]) == set(cells.loc[cells["Split"] == "test", "file"])
    assert set(_raw(out, "val")["image"]) == set(cells.loc[cells["Split"] == "Validation", "file"])


def test_patient_pattern_and_windows_and_absolute_paths(tmp_path):
    csv, cells = hospital_export(tmp_path)
    df = cells.drop(columns=["PatientID"])
    df["file"] = [p.replace("/", "\\") if i % 2 else str(csv.parent / p) for i, p in enumerate(df["file"])]
    df.to_csv(csv, index=False)
    t = load_source("csv", csv, image_column="file", patient_pattern=r"images/(p\d+)/", ignore_columns="Accession,Age")
    assert list(t.frame["image"]) == list(cells["file"])
    assert list(t.frame["patient_id"]) == [p.lower() for p in cells["PatientID"]]
    with pytest.warns(UserWarning, match="own patient"):
        t = load_source("csv", csv, image_column="file", patient_column="none", ignore_columns="Accession,Age")
    assert list(t.frame["patient_id"]) == list(cells["file"])


def test_line_numbers_count_blank_lines_and_quoted_line_breaks(tmp_path):
    csv, cells = hospital_export(tmp_path, n=8)
    cells.loc[5, "Hernia"] = "maybe"
    cells.to_csv(csv, index=False)
    header, *rows = csv.read_text().rstrip("\n").split("\n")
    rows[3] = rows[3].replace("A1003", '"A10\n03"', 1)  # a quoted cell over two lines
    # editor lines: header 1, rows 2-3, a blank line 4, row 5, the quoted row 6-7, rows 8, 9 ('maybe'), 10, 11
    csv.write_text("\n".join([header, rows[0], rows[1], "", *rows[2:]]) + "\n")
    text = _error(load_source, "csv", csv, **HOSPITAL_ARGS)
    assert f"{csv.resolve()} line 9: column 'Hernia' has value 'maybe'" in text
    csv.write_text(csv.read_text().replace("maybe", "0"))
    t = load_source("csv", csv, **HOSPITAL_ARGS)
    assert list(t.frame["line"]) == [2, 3, 5, 6, 8, 9, 10, 11]
    assert list(t.frame["image"]) == list(cells["file"])


# ------------------------------------------------------------------------------------------- csv: errors


def test_bad_cell_value_names_file_line_column_and_value(tmp_path):
    csv, cells = hospital_export(tmp_path)
    cells.loc[5, "Hernia"] = "yes"
    cells.to_csv(csv, index=False)
    text = _error(load_source, "csv", csv, **HOSPITAL_ARGS)
    assert text.startswith(
        f"{csv.resolve()} line 7: column 'Hernia' has value 'yes'; a class cell is 1 (positive), "
        "0 (negative), -1 (uncertain) or blank (not annotated)"
    )
    # a metadata column not named as ignored reads as a class column: the hint says what to do
    text = _error(load_source, "csv", csv, image_column="file", patient_column="PatientID")
    assert "line 2: column 'Accession' has value 'A1000'" in text and "ignore_columns" in text


def test_unknown_class_name_in_label_column(tmp_path):
    csv, _ = findings_csv(tmp_path)
    text = _error(
        load_source,
        "csv",
        csv,
        image_column="Image Index",
        label_column="Finding Labels",
        patient_column="Patient ID",
        images_root="../png",
        classes="Cardiomegaly,Effusion",
    )
    assert f"{csv.resolve()} line " in text and "unknown class" in text and "Cardiomegaly" in text
    line = int(text.split(" line ")[1].split(":")[0])
    row = csv.read_text().split("\n")[line - 1]
    bad = text.split("unknown class '")[1].split("'")[0]
    assert bad in row.split(",")[1].split("|")


def test_duplicate_image_names_both_lines(tmp_path):
    csv, cells = hospital_export(tmp_path)
    lines = csv.read_text().rstrip("\n").split("\n")
    lines.append(lines[4])  # the row of line 5 again, as the last line
    csv.write_text("\n".join(lines) + "\n")
    text = _error(load_source, "csv", csv, **HOSPITAL_ARGS)
    assert f"line {len(cells) + 2}:" in text and f"listed twice (lines 5 and {len(cells) + 2})" in text
    assert cells["file"].iloc[3] in text


def test_missing_image_stops_prepare_at_its_line(tmp_path, capsys):
    csv, cells = hospital_export(tmp_path)
    (csv.parent / cells["file"].iloc[10]).unlink()
    argv = [
        "--source",
        "csv",
        "--root",
        str(csv),
        "--out",
        str(tmp_path / "out"),
        "--sites",
        "2",
        "--protocol",
        "full",
        "--no-figure",
        "--source-arg",
        "image_column=file",
        "--source-arg",
        "patient_column=PatientID",
        "--source-arg",
        "ignore_columns=Accession,Age",
    ]
    assert prepare_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fedpartial-prepare: error:")
    assert f"{csv.resolve()} line 12:" in err and cells["file"].iloc[10] in err and "not found" in err
    assert not (tmp_path / "out").exists()
    # --drop-unreadable leaves it out, reported
    assert prepare_cli.main(argv + ["--drop-unreadable"]) == 0
    info = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert [(d["count"], d["lines"]) for d in info["dropped"]] == [(1, [12])]


def test_corrupt_image_stops_prepare_at_its_line(tmp_path):
    csv, cells = hospital_export(tmp_path)
    bad = csv.parent / cells["file"].iloc[4]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    text = _error(
        prep.prepare, "csv", csv, tmp_path / "out", 2, "full", source_args=HOSPITAL_ARGS, verbose=False, figure=False
    )
    assert f"{csv.resolve()} line 6:" in text and bad.name in text


@pytest.mark.parametrize(
    "args, expect",
    [
        ({"image_column": "path"}, "line 1: lacks column(s) ['path']"),
        ({"classes": "Hernia,Edema"}, "line 1: lacks class column(s) ['Edema']"),
        ({"ignore_columns": "Accession,Sex"}, "line 1: ignore_columns names column(s) ['Sex']"),
        ({"patient_column": "auto"}, "line 1: has no patient column ('patient_id')"),
        ({"images_root": "nowhere"}, "images root"),
        ({"uncertain": "maybe"}, "uncertain must be one of"),
        ({"task": "binary"}, "task must be one of"),
    ],
)
def test_csv_option_errors(tmp_path, args, expect):
    csv, _ = hospital_export(tmp_path, n=6)
    assert expect in _error(load_source, "csv", csv, **{**HOSPITAL_ARGS, **args})


def test_csv_layout_typed_or_flat_is_one_table_and_a_bad_key_or_type_is_named(tmp_path):
    """A :class:`CsvLayout` and the same keys flat (``--source-arg``) read the same table; a flat key overrides the
    layout's; a column name given as a number is its text; an unknown key and a value of the wrong type are one
    line naming them."""
    from fedpartial.data.sources.csv_source import CsvLayout, csv_layout, load_csv

    csv, _ = hospital_export(tmp_path, n=8)
    flat = load_source("csv", csv, **HOSPITAL_ARGS)
    typed = load_csv(csv, CsvLayout(**HOSPITAL_ARGS))
    assert typed.frame.equals(flat.frame) and typed.classes == flat.classes and typed.task == flat.task
    over = load_csv(csv, CsvLayout(**{**HOSPITAL_ARGS, "source_name": "a"}), source_name="b")
    assert over.name == "b"
    assert csv_layout({"none_label": 0, "delimiter": "tab"}) == CsvLayout(none_label="0", delimiter="\t")
    assert "takes no option(s) ['image_colum']" in _error(load_source, "csv", csv, image_colum="file")
    assert "option 'classes' must be" in _error(load_source, "csv", csv, **{**HOSPITAL_ARGS, "classes": {"a": 1}})
    documented = re.findall(r"^\| `(\w+)=", (REPO / "docs" / "datasets.md").read_text(), re.M)
    assert sorted(documented) == sorted(f.name for f in fields(CsvLayout))  # docs/datasets.md's option table


@pytest.mark.parametrize(
    "row, column, value, expect",
    [
        (1, "file", "", "line 3: image column 'file' is empty"),
        (2, "file", "../../x.png", "line 4: image path '../../x.png' lies outside the images root"),
        (3, "Effusion", "2", "line 5: column 'Effusion' has value '2'"),
        (4, "Cardiomegaly", "-1.5", "line 6: column 'Cardiomegaly' has value '-1.5'"),
    ],
)
def test_csv_cell_errors(tmp_path, row, column, value, expect):
    csv, cells = hospital_export(tmp_path, n=6)
    cells.loc[row, column] = value
    cells.to_csv(csv, index=False)
    text = _error(load_source, "csv", csv, **HOSPITAL_ARGS)
    assert text.startswith(f"{csv.resolve()} {expect}"), text


def test_ragged_row(tmp_path):
    csv, _ = hospital_export(tmp_path, n=6)
    lines = csv.read_text().split("\n")
    lines[4] += ",extra"
    csv.write_text("\n".join(lines))
    assert "line 5: has 10 fields, the header (line 1) has 9" in _error(load_source, "csv", csv, **HOSPITAL_ARGS)


def test_blank_patient_and_patient_in_two_splits(tmp_path):
    csv, cells = hospital_export(tmp_path, n=12)
    df = cells.copy()
    df.loc[5, "PatientID"] = ""
    df.to_csv(csv, index=False)
    assert "line 7: patient column 'PatientID' is blank" in _error(load_source, "csv", csv, **HOSPITAL_ARGS)
    df = cells.copy()
    df["Split"] = "train"
    p = df["PatientID"].iloc[0]
    last = int(np.flatnonzero(df["PatientID"] == p)[-1])
    df.loc[last, "Split"] = "test"
    df.to_csv(csv, index=False)
    text = _error(load_source, "csv", csv, split_column="Split", **HOSPITAL_ARGS)
    assert f"line {last + 2}: patient '{p}' is in 'train' (line 2) and in 'test'" in text
    df.loc[last, "Split"] = "holdout"
    df.to_csv(csv, index=False)
    text = _error(load_source, "csv", csv, split_column="Split", **HOSPITAL_ARGS)
    assert f"line {last + 2}: split column 'Split' has value 'holdout'" in text


def test_label_name_errors(tmp_path):
    csv, ham = ham_dx_csv(tmp_path, n=14)
    df = pd.read_csv(csv, dtype=str, keep_default_na=False)
    df.loc[4, "diagnosis"] = ""
    df.to_csv(csv, index=False)
    table = load_source("csv", csv, label_column="diagnosis")  # a blank label: an unlabelled image, kept
    assert table.task == "multiclass" and (table.frame.loc[4, table.classes] == NOT_ANNOTATED).all()
    assert (table.frame.drop(index=4)[table.classes].sum(axis=1) == 1).all()
    assert "task=auto chose multiclass" in table.notes[0]
    df.loc[4, "diagnosis"] = "MEL|NV"
    df.to_csv(csv, index=False)
    text = _error(load_source, "csv", csv, label_column="diagnosis", task="multiclass")
    assert "line 6: column 'diagnosis' holds several classes 'MEL|NV'" in text
    df.loc[4, "diagnosis"] = "No Finding|NV"
    df.to_csv(csv, index=False)
    assert "line 6: label 'No Finding|NV' mixes 'No Finding'" in _error(
        load_source, "csv", csv, label_column="diagnosis"
    )


def test_two_exports_with_the_same_patient_ids_federate_under_their_own_names(tmp_path):
    a, cells = hospital_export(tmp_path / "a")
    b, _ = hospital_export(tmp_path / "b")  # the same patient ids, other patients
    sources = [
        {
            "source": "csv",
            "root": str(x.parent),
            "num_sites": 1,
            "source_args": {**HOSPITAL_ARGS, "csv": x.name, "source_name": name},
        }
        for x, name in ((a, "hospital_a"), (b, "hospital_b"))
    ]
    out = prep.prepare(
        None,
        None,
        tmp_path / "out",
        None,
        "full",
        sources=sources,
        val_frac=0.2,
        test_frac=0.2,
        verbose=False,
        figure=False,
    )
    info = json.loads((out / "dataset.json").read_text())
    assert info["source"] == "hospital_a+hospital_b" and info["classes"] == CXR
    for site, prefix in (("site-1", "hospital_a:"), ("site-2", "hospital_b:")):
        m = _raw(out, site)
        assert m["patient_id"].str.startswith(prefix).all()
        assert m["image"].str.startswith(prefix[9] + "/export/").all()
    rows = _all_rows(out)
    assert len(rows) == 2 * len(cells) and rows.groupby("patient_id")["part"].nunique().max() == 1


def test_two_exports_of_one_name_are_refused_and_the_command_line_names_each(tmp_path, capsys):
    a, _ = hospital_export(tmp_path / "a")
    b, _ = hospital_export(tmp_path / "b")  # the same patient ids: under one name they would be one patient each
    sources = [{"source": "csv", "root": str(x), "num_sites": 1, "source_args": HOSPITAL_ARGS} for x in (a, b)]
    text = _error(
        prep.prepare, None, None, tmp_path / "out", None, "full", sources=sources, verbose=False, figure=False
    )
    assert "sources 1 and 2 are both named 'csv'" in text and "--source-arg 2:source_name=NAME" in text
    assert not (tmp_path / "out").exists()
    cli = [
        "--source",
        "csv",
        "--root",
        str(a),
        "--sites",
        "1",
        "--source",
        "csv",
        "--root",
        str(b),
        "--sites",
        "1",
        "--protocol",
        "full",
        "--val-frac",
        "0.2",
        "--test-frac",
        "0.2",
        "--no-figure",
        *[f"--source-arg={k}={v}" for k, v in HOSPITAL_ARGS.items()],
    ]
    assert prepare_cli.main(cli + ["--out", str(tmp_path / "one")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "both named 'csv'" in err[0], err
    assert (
        prepare_cli.main(
            cli
            + [
                "--out",
                str(tmp_path / "two"),
                "--source-arg",
                "1:source_name=hospital_a",
                "--source-arg",
                "2:source_name=hospital_b",
            ]
        )
        == 0
    )
    for site, prefix in (("site-1", "hospital_a:"), ("site-2", "hospital_b:")):
        assert _raw(tmp_path / "two", site)["patient_id"].str.startswith(prefix).all()
    assert prepare_cli.main(cli + ["--out", str(tmp_path / "three"), "--source-arg", "3:source_name=x"]) == 2
    assert "names source 3, but there are 2 --source" in capsys.readouterr().err


def test_root_may_be_the_folder_of_a_single_csv(tmp_path):
    csv, cells = hospital_export(tmp_path, n=8)
    assert len(load_source("csv", csv.parent, **HOSPITAL_ARGS).frame) == 8
    (csv.parent / "other.csv").write_text("a,b\n1,2\n")
    text = _error(load_source, "csv", csv.parent, **HOSPITAL_ARGS)
    assert "holds 2 CSV files" in text and "csv=NAME" in text
    assert len(load_source("csv", csv.parent, csv="labels.csv", **HOSPITAL_ARGS).frame) == 8
    semi = csv.parent / "semi.csv"
    semi.write_text(csv.read_text().replace(",", ";"))
    text = _error(load_source, "csv", semi, **HOSPITAL_ARGS)
    assert "delimiter=;" in text
    assert len(load_source("csv", semi, delimiter=";", **HOSPITAL_ARGS).frame) == 8


def test_unknown_option_lists_the_loaders_options(tmp_path):
    csv, _ = hospital_export(tmp_path, n=6)
    text = _error(load_source, "csv", csv, view="PA")
    assert "takes no option(s) ['view']" in text and "label_column" in text and "images_root" in text


# --------------------------------------------------------------------------------------------------- folder


def test_folder_reads_one_class_per_sub_folder(tmp_path):
    root, ham = ham_folder(tmp_path / "derm")
    (root / "README.txt").write_text("export of 2024-01\n")
    (root / "NV" / "notes.txt").write_text("x")
    (root / "NV" / ".DS_Store").write_bytes(b"\0")
    t = load_source("folder", root, patient_pattern=r"^(HAM_\d+)_")
    classes = sorted(ham["dx"].str.upper().unique())
    assert t.task == "multiclass" and t.classes == classes and t.root == root.resolve()
    assert len(t.frame) == len(ham)
    want = {
        f"{r['dx'].upper()}/{r['lesion_id']}_{r['image_id']}.jpg": (r["dx"].upper(), r["lesion_id"])
        for _, r in ham.iterrows()
    }
    for _, r in t.frame.iterrows():
        dx, lesion = want[r["image"]]
        assert [c for c in classes if r[c] == 1] == [dx] and r["patient_id"] == lesion
    reasons = {d.reason: d.names for d in t.dropped}
    assert reasons["lie outside any class folder"] == ["README.txt"]
    assert any("not image files" in k and v == ["NV/notes.txt"] for k, v in reasons.items())


def test_folder_prepare_and_class_subset(tmp_path):
    root, ham = ham_folder(tmp_path / "derm")
    out = prep.prepare(
        "folder",
        root,
        tmp_path / "out",
        2,
        "full",
        source_args={"patient_pattern": r"^(HAM_\d+)_", "classes": "NV,MEL,BKL"},
        val_frac=0.2,
        test_frac=0.2,
        verbose=False,
        figure=False,
    )
    info = json.loads((out / "dataset.json").read_text())
    assert info["task"] == "multiclass" and info["classes"] == ["NV", "MEL", "BKL"]
    rows = _all_rows(out)
    keep = ham[ham["dx"].str.upper().isin(["NV", "MEL", "BKL"])]
    assert len(rows) == len(keep)
    for _, r in rows.iterrows():
        assert r[r["image"].split("/")[0]] == "1"
    left = sum(d["count"] for d in info["dropped"] if "outside ['NV', 'MEL', 'BKL']" in d["reason"])
    assert left == len(ham) - len(keep)


def test_folder_official_split(tmp_path):
    root, ham = ham_folder(tmp_path / "flat")
    split_root = tmp_path / "split"
    for i, p in enumerate(sorted(root.rglob("*.jpg"))):
        part = "test" if i % 4 == 0 else "train"
        dest = split_root / part / p.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest)
    text = _error(load_source, "folder", split_root)
    assert "official_split=true" in text
    # one lesion's images in train and test: refused when the pattern names the lesion
    first = sorted((split_root / "test").rglob("*.jpg"))[0]
    second = split_root / "train" / first.parent.name / (first.name.split("_ISIC")[0] + "_second.jpg")
    shutil.copy(first, second)
    text = _error(load_source, "folder", split_root, official_split=True, patient_pattern=r"^(HAM_\d+)_")
    assert text.startswith(
        f"{second.resolve()}: patient '{first.name.split('_ISIC')[0]}' has images in 'test' "
        f"({first.relative_to(split_root)}) and in 'train'"
    ), text
    second.unlink()
    with pytest.warns(UserWarning, match="its own patient"):
        load_source("folder", split_root, official_split=True)
    out = prep.prepare(
        "folder",
        split_root,
        tmp_path / "out",
        2,
        "full",
        source_args={"official_split": True, "patient_pattern": r"^(HAM_\d+)_"},
        verbose=False,
        figure=False,
    )
    assert set(_raw(out, "test")["image"]) == {
        p.relative_to(split_root).as_posix() for p in (split_root / "test").rglob("*.jpg")
    }
    assert all(p.startswith("train/") for p in _raw(out, "val")["image"])


def test_folder_errors(tmp_path):
    root, _ = ham_folder(tmp_path / "derm", n=14)
    (root / "SCC").mkdir()
    (root / "SCC" / "readme.txt").write_text("to do")
    text = _error(load_source, "folder", root)
    assert f"{(root / 'SCC').resolve()}: class folder 'SCC' holds no image" in text
    assert "holds no image" not in _error(load_source, "folder", root, classes="NV,XYZ")
    assert "unknown class(es) ['XYZ']" in _error(load_source, "folder", root, classes="NV,XYZ")
    shutil.rmtree(root / "SCC")
    text = _error(load_source, "folder", root, patient_pattern=r"^(P\d+)_")
    first = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jpg"))[0]
    assert text.startswith(f"{root.resolve() / first}: patient_pattern") and "finds no patient in" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no class sub-folder" in _error(load_source, "folder", empty)
    assert "is not a folder" in _error(load_source, "folder", tmp_path / "absent")


def test_folder_cli_error_is_one_line(tmp_path, capsys):
    root, _ = ham_folder(tmp_path / "derm", n=14)
    (root / "EMPTY").mkdir()
    rc = prepare_cli.main(
        [
            "--source",
            "folder",
            "--root",
            str(root),
            "--out",
            str(tmp_path / "out"),
            "--sites",
            "2",
            "--protocol",
            "full",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "class folder 'EMPTY' holds no image" in err
    assert not (tmp_path / "out").exists()


def test_prepare_with_store_decodes_each_image_once_and_names_an_unreadable_one(tmp_path, monkeypatch, capsys):
    """``fedpartial-prepare --store SIZExC``: the manifests, then the sites' stores (what fedpartial-store builds),
    every image decoded by one PIL image object only (the store build is the decode check; no separate pass).
    An unreadable image stops it with one line naming the file; ``--drop-unreadable`` needs the decode pass."""
    from PIL import ImageFile

    from fedpartial.data.store_cli import prepared_manifests

    root, ham = ham_folder(tmp_path / "derm", n=14)
    monkeypatch.setenv("FEDPARTIAL_CACHE", str(tmp_path / "cache"))
    loaded: dict[str, set[int]] = {}
    real_load = ImageFile.ImageFile.load

    def counting_load(self):
        loaded.setdefault(Path(self.filename).name, set()).add(id(self))
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    args = [
        "--source",
        "folder",
        "--root",
        str(root),
        "--out",
        str(tmp_path / "out"),
        "--sites",
        "2",
        "--protocol",
        "full",
        "--no-figure",
        "--store",
        "32x3",
    ]
    assert prepare_cli.main(args) == 0, capsys.readouterr().err
    stores = sorted(p for p in (tmp_path / "cache" / "stores").iterdir() if p.is_dir())
    assert len(stores) == len(prepared_manifests(tmp_path / "out")["site-1"]) + 1  # train x 2 sites, val, test
    out = capsys.readouterr().out
    assert all(str(s) in out for s in stores)
    assert sorted(loaded) == sorted(p.name for p in root.rglob("*.jpg"))
    assert {n: len(ids) for n, ids in loaded.items() if len(ids) != 1} == {}  # each decoded once

    bad = sorted(root.rglob("*.jpg"))[3]
    bad.write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    args[args.index("--out") + 1] = str(tmp_path / "out2")
    assert prepare_cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and bad.name in err, err
    assert prepare_cli.main(args[:-2] + ["--drop-unreadable", "--store", "32x3", "--overwrite"]) == 2
    assert "--drop-unreadable needs the decode pass" in capsys.readouterr().err
    assert prepare_cli.main(args[:-2] + ["--store", "224"]) == 2
    assert "--store expects a dataset preset, PRESET:SIZE" in capsys.readouterr().err
    assert prepare_cli._store_settings("nih_cxr14:224") == store_dataset(preset="nih_cxr14", image_size=224)
    assert prepare_cli._store_settings("ham10000") == store_dataset(preset="ham10000")
    assert prepare_cli._store_settings("32x3") == store_dataset(image_size=32, channels=3)


def test_absolute_image_paths_through_a_symbolic_link_are_inside_the_images_root(tmp_path):
    """A CSV whose absolute image paths reach the images through a linked folder (``/data`` a link to the disk
    the root names, or the root given through the link) reads the same table as its relative paths; a path that
    leaves the root is still refused."""
    csv, cells = hospital_export(tmp_path, n=6)
    export = csv.parent
    plain = load_source("csv", csv, **HOSPITAL_ARGS)
    (tmp_path / "link").symlink_to(export, target_is_directory=True)
    linked = cells.copy()
    linked["file"] = [str(tmp_path / "link" / f) for f in cells["file"]]
    linked.to_csv(export / "linked.csv", index=False)
    for root in (export, tmp_path / "link"):
        got = load_source("csv", export / "linked.csv", images_root=str(root), **HOSPITAL_ARGS)
        assert got.frame.equals(plain.frame), (root, got.frame.head(), plain.frame.head())
    outside = linked.copy()
    outside.loc[2, "file"] = str(tmp_path / "link" / ".." / "elsewhere.png")
    outside.to_csv(export / "outside.csv", index=False)
    err = _error(load_source, "csv", export / "outside.csv", images_root=str(export), **HOSPITAL_ARGS)
    assert "line 4: image path" in err and "lies outside the images root" in err, err
