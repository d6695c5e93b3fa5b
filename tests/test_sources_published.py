"""Each public release in its published layout (tiny copies built from the shared real images) is prepared by
the documented command, and the manifests say what the release says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from published_layouts import (
    HAM,
    NIH,
    chexpert_release,
    ham10000_release,
    isic2018_release,
    isic2019_release,
    mimic_release,
    nih_release,
)

from conftest import real_data
from fedpartial.data import prepare as prep
from fedpartial.data import prepare_cli
from fedpartial.data.catalog.chexpert import FINDINGS as CHEXPERT_FINDINGS
from fedpartial.data.catalog.isic2019 import FLAMBY_CENTRES
from fedpartial.data.partition import dirichlet_label_skew, quantity_skew
from fedpartial.data.sources import load_source

pytestmark = pytest.mark.realdata


@pytest.fixture(autouse=True)
def _shared_data(tmp_path, monkeypatch):
    for folder in (NIH, HAM):
        real_data(folder.name)
    monkeypatch.setenv("FEDPARTIAL_CACHE", str(tmp_path / "cache"))


def _raw(out: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(out / f"{name}.csv", dtype=str, keep_default_na=False)


def _all_rows(out: Path) -> pd.DataFrame:
    info = json.loads((out / "dataset.json").read_text())
    return pd.concat([_raw(out, n).assign(part=n) for n in info["files"]], ignore_index=True)


@pytest.mark.parametrize("policy, code", [("ignore", ""), ("zeros", "0"), ("ones", "1")])
def test_chexpert_small_uncertain_policy_and_frontal_view(tmp_path, policy, code):
    root = chexpert_release(tmp_path)
    out = prep.prepare(
        "chexpert",
        root,
        tmp_path / "out",
        2,
        "full",
        val_frac=0.2,
        test_frac=0.2,
        source_args={"uncertain": policy, "view": "frontal"},
        verbose=False,
        figure=False,
    )
    src = pd.read_csv(root / "train.csv", dtype=str, keep_default_na=False)
    src["image"] = src["Path"].str.replace("CheXpert-v1.0-small/", "", regex=False)
    rows = _all_rows(out).set_index("image")
    frontal = src[src["Frontal/Lateral"] == "Frontal"]
    assert set(rows.index) == set(frontal["image"])  # laterals left out, nothing else
    info = json.loads((out / "dataset.json").read_text())
    lateral = src[src["Frontal/Lateral"] == "Lateral"]
    assert [d["count"] for d in info["dropped"] if "view filter" in d["reason"]] == [len(lateral)]
    assert info["classes"] == CHEXPERT_FINDINGS
    uncertain = blank = 0
    for _, r in frontal.iterrows():
        healthy = r["No Finding"] == "1.0"
        for c in CHEXPERT_FINDINGS:
            got = rows.loc[r["image"], c]
            if r[c] == "-1.0" and not (healthy and c != "Support Devices"):
                assert got == code, (r["image"], c)
                uncertain += 1
            elif r[c] == "":
                assert got == "0"  # blank = not mentioned = negative (default blank policy)
                blank += 1
            elif not healthy or c == "Support Devices":
                assert got == str(int(float(r[c])))
    assert uncertain > 10 and blank > 10


def test_chexpert_official_valid_set_is_the_test_set(tmp_path):
    root = chexpert_release(tmp_path, name="CheXpert-v1.0")
    out = prep.prepare(
        "chexpert", root, tmp_path / "out", 2, "full", source_args={"official_split": True}, verbose=False, figure=False
    )
    valid = pd.read_csv(root / "valid.csv", dtype=str)["Path"].str.replace("CheXpert-v1.0/", "", regex=False)
    assert set(_raw(out, "test")["image"]) == set(valid)
    assert not set(_raw(out, "val")["image"]) & set(valid)


def test_mimic_cxr_jpg_official_split_and_view(tmp_path):
    root = mimic_release(tmp_path / "mimic-cxr-jpg" / "2.0.0")
    out = prep.prepare(
        "mimic_cxr",
        root,
        tmp_path / "out",
        2,
        "full",
        source_args={"official_split": True, "view": "frontal", "uncertain": "zeros"},
        verbose=False,
        figure=False,
    )
    split = pd.read_csv(root / "mimic-cxr-2.0.0-split.csv.gz", dtype=str)
    meta = pd.read_csv(root / "mimic-cxr-2.0.0-metadata.csv.gz", dtype=str)
    frontal = set(meta[meta["ViewPosition"].isin(["PA", "AP"])]["dicom_id"])
    dicom = lambda df: {Path(p).stem for p in df["image"]}  # noqa: E731
    assert dicom(_raw(out, "test")) == set(split[split["split"] == "test"]["dicom_id"]) & frontal
    assert dicom(_raw(out, "val")) == set(split[split["split"] == "validate"]["dicom_id"]) & frontal
    rows = _all_rows(out)
    assert rows["image"].str.match(r"^files/p10/p10\d{6}/s5\d{7}/[0-9a-f-]{44}\.jpg$").all()
    labels = pd.read_csv(root / "mimic-cxr-2.0.0-chexpert.csv.gz", dtype=str, keep_default_na=False)
    one = rows.iloc[0]
    subject, study = Path(one["image"]).parts[2][1:], Path(one["image"]).parts[3][1:]
    lab = labels[(labels["subject_id"] == subject) & (labels["study_id"] == study)].iloc[0]
    healthy = lab["No Finding"] == "1.0"
    for c in ("Atelectasis", "Edema", "Pleural Effusion"):
        want = "1" if lab[c] == "1.0" else "0"  # zeros: uncertain and blank are negatives
        assert one[c] == ("0" if healthy else want)


def test_isic2019_six_flamby_centres_from_the_metadata(tmp_path):
    root = isic2019_release(tmp_path / "isic2019")
    out = prep.prepare(
        "isic2019",
        root,
        tmp_path / "out",
        None,
        "full",
        partition="centre",
        source_args={"ham_metadata": "HAM10000_metadata"},
        verbose=False,
        figure=False,
    )
    info = json.loads((out / "dataset.json").read_text())
    assert list(info["centres"].values()) == FLAMBY_CENTRES  # FLamby's index order 0..5
    assert info["classes"] == ["MEL", "NV", "BCC", "AK", "BKL", "DF", "VASC", "SCC"]
    meta = pd.read_csv(root / "ISIC_2019_Training_Metadata.csv", dtype=str, keep_default_na=False)
    ham = pd.read_csv(root / "HAM10000_metadata", dtype=str)
    centre_of = {}
    for _, r in meta.iterrows():
        code = r["lesion_id"][:3]
        centre_of[r["image"]] = (
            ("HAM_" + ham.set_index("image_id").loc[r["image"], "dataset"])
            if code == "HAM"
            else ("MSK" if code == "MSK" else code)
        )
    for site, centre in info["centres"].items():
        images = [Path(p).stem for p in _raw(out, site)["image"]]
        assert images and {centre_of[i] for i in images} == {centre}
    unknown = meta[meta["lesion_id"] == ""]["image"].tolist()
    reported = [d for d in info["dropped"] if "lesion_id" in d["reason"]]
    assert reported and reported[0]["count"] == len(unknown) and reported[0]["first"] == unknown
    assert not set(unknown) & {Path(p).stem for p in _all_rows(out)["image"]}


def test_isic2019_class_list_is_choosable(tmp_path):
    root = isic2019_release(tmp_path / "isic2019")
    t = load_source("isic2019", root, classes=["MEL", "NV", "BCC", "BKL", "DF", "VASC"])
    assert t.classes == ["MEL", "NV", "BCC", "BKL", "DF", "VASC"]
    assert (t.frame[t.classes].sum(axis=1) == 1).all()
    gone = [d for d in t.dropped if "outside" in d.reason][0]
    gt = pd.read_csv(root / "ISIC_2019_Training_GroundTruth.csv")
    meta = pd.read_csv(root / "ISIC_2019_Training_Metadata.csv", keep_default_na=False)
    known = set(meta[meta["lesion_id"] != ""]["image"])
    ak_scc = gt[(gt["AK"] == 1) | (gt["SCC"] == 1)]["image"]
    assert set(gone.names) == set(ak_scc) & known
    assert load_source("isic2019", root, classes=[*t.classes, "SCC", "AK"]).classes == [
        "MEL",
        "NV",
        "BCC",
        "AK",
        "BKL",
        "DF",
        "VASC",
        "SCC",
    ]  # the release's order


def test_isic2018_task3_with_the_ham10000_command(tmp_path, capsys):
    root = isic2018_release(tmp_path / "isic2018")
    rc = prepare_cli.main(
        [
            "--source",
            "ham10000",
            "--root",
            str(root),
            "--out",
            str(tmp_path / "out"),
            "--sites",
            "2",
            "--protocol",
            "full",
            "--no-figure",
        ]
    )
    assert rc == 0
    out = tmp_path / "out"
    info = json.loads((out / "dataset.json").read_text())
    groups = pd.read_csv(root / "ISIC2018_Task3_Training_LesionGroupings.csv")
    lesion = dict(zip(groups["image"], groups["lesion_id"]))
    rows = _all_rows(out)
    assert (rows["patient_id"] == [lesion[Path(p).stem] for p in rows["image"]]).all()
    by_lesion = rows.groupby("patient_id")["part"].nunique()
    assert (by_lesion == 1).all()  # one lesion's two images never straddle train / val / test
    assert info["source_files"] and sum(info["sizes"].values()) == len(groups)


def test_isic2018_without_lesion_groupings_is_refused(tmp_path, capsys):
    root = isic2018_release(tmp_path / "isic2018", groupings=False)
    rc = prepare_cli.main(
        [
            "--source",
            "ham10000",
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
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "ISIC2018_Task3_Training_LesionGroupings.csv not found" in err and "lesion_groupings=none" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_ham10000_release_two_image_folders(tmp_path):
    root = ham10000_release(tmp_path / "ham")
    out = prep.prepare("ham10000", root, tmp_path / "out", 2, "full", verbose=False, figure=False)
    rows = _all_rows(out)
    assert rows["image"].str.match(r"^HAM10000_images_part_[12]/ISIC_\d{7}\.jpg$").all()
    assert len(rows) == 28


def test_nih_official_split_lists(tmp_path):
    root = nih_release(tmp_path / "nih")
    out = prep.prepare(
        "nih_cxr14",
        root,
        tmp_path / "out",
        2,
        "full",
        source_args={"official_split": True},
        verbose=False,
        figure=False,
    )
    test_list = set((root / "test_list.txt").read_text().split())
    assert {Path(p).name for p in _raw(out, "test")["image"]} == test_list
    assert not {Path(p).name for p in _raw(out, "val")["image"]} & test_list
    assert _all_rows(out)["image"].str.match(r"^images_00[12]/images/\d{8}_\d{3}\.png$").all()
    assert json.loads((out / "dataset.json").read_text())["official_split"] is True


def test_nih_and_chexpert_two_vocabulary_federation_in_one_command(tmp_path, capsys):
    nih = nih_release(tmp_path / "data" / "nih")
    chex = chexpert_release(tmp_path / "data")
    skip = (nih / "test_list.txt").read_text().split()[0]  # one NIH image left out; CheXpert has no such name
    rc = prepare_cli.main(
        [
            "--source",
            "nih_cxr14",
            "--root",
            str(nih),
            "--sites",
            "2",
            "--source",
            "chexpert",
            "--root",
            str(chex),
            "--sites",
            "2",
            "--source-arg",
            "chexpert:view=frontal",
            "--protocol",
            "full",
            "--out",
            str(tmp_path / "fed"),
            "--exclude",
            skip,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    out = tmp_path / "fed"
    info = json.loads((out / "dataset.json").read_text())
    nih_names = [
        "Atelectasis",
        "Cardiomegaly",
        "Effusion",
        "Infiltration",
        "Mass",
        "Nodule",
        "Pneumonia",
        "Pneumothorax",
        "Consolidation",
        "Edema",
        "Emphysema",
        "Fibrosis",
        "Pleural_Thickening",
        "Hernia",
    ]
    assert info["classes"][:14] == nih_names and "Pleural Effusion" not in info["classes"]
    assert set(info["classes"][14:]) == {
        "Enlarged Cardiomediastinum",
        "Lung Opacity",
        "Lung Lesion",
        "Pleural Other",
        "Fracture",
        "Support Devices",
    }
    assert info["vocabularies"] == {
        "site-3": {"Pleural Effusion": "Effusion"},
        "site-4": {"Pleural Effusion": "Effusion"},
    }
    for site in ("site-1", "site-2"):
        df = _raw(out, site)
        assert df["image"].str.startswith("nih/images_00").all()
        assert set(info["sites"][site]) <= set(nih_names)
    for site in ("site-3", "site-4"):
        df = _raw(out, site)
        assert df["image"].str.startswith("CheXpert-v1.0-small/train/").all()
        assert "Pleural Effusion" in df.columns and "Effusion" not in df.columns  # the site's own column name
        assert not set(info["sites"][site]) & {"Infiltration", "Mass", "Nodule", "Emphysema", "Fibrosis", "Hernia"}
    test = _raw(out, "test")
    assert test["image"].str.startswith("nih/").any() and test["image"].str.startswith("CheXpert").any()
    chex_rows = test[test["image"].str.startswith("CheXpert")]
    assert (chex_rows["Hernia"] == "").all()  # CheXpert does not label Hernia: not annotated, not negative
    assert "label structure per site" in printed and (out / "label_structure.png").is_file()
    ds = prep.load_prepared(out)
    assert ds.data_root == (tmp_path / "data").resolve()
    assert not _all_rows(out)["image"].str.endswith(skip).any()
    assert [d["count"] for d in info["dropped"] if d["reason"] == "were excluded"] == [1]


def test_dirichlet_label_skew_and_quantity_skew():
    rng = np.random.default_rng(0)
    pids = [str(i) for i in range(600)]
    labels = np.eye(4, dtype=int)[rng.integers(0, 4, 600)]

    def skew(alpha):
        rows = dirichlet_label_skew(pids, labels, 5, alpha, seed=1)
        assert sorted(np.concatenate(rows).tolist()) == list(range(600))  # a partition of the patients
        dist = np.array([labels[r].sum(axis=0) / max(len(r), 1) for r in rows])
        return float(np.abs(dist - labels.mean(axis=0)).sum(axis=1).mean())

    assert skew(0.1) > 2 * skew(100.0)
    sizes_small = sorted(len(r) for r in quantity_skew(pids, 5, 0.2, seed=1))
    sizes_large = sorted(len(r) for r in quantity_skew(pids, 5, 1000.0, seed=1))
    assert sizes_small[-1] - sizes_small[0] > 3 * (sizes_large[-1] - sizes_large[0])
    assert min(sizes_small) >= 1
    grouped = dirichlet_label_skew(["a", "a", "b", "b", "c", "d"], np.eye(2, dtype=int)[[0, 0, 1, 1, 0, 1]], 2, 0.5, 0)
    owner = {i: s for s, r in enumerate(grouped) for i in r}
    assert owner[0] == owner[1] and owner[2] == owner[3]  # whole patients
