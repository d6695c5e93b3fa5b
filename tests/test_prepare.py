"""fedpartial.data.prepare on tiny synthetic sources built in tmp_path (plus the loaders' layouts)."""

from __future__ import annotations

import json
import re
import sys
import threading
from dataclasses import fields
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from conftest import REPO
from fedpartial.data import prepare as prep
from fedpartial.data import prepare_cli, sources
from fedpartial.data.catalog.ham10000 import CLASSES as HAM_CLASSES
from fedpartial.data.catalog.ham10000.loader import load_ham10000, load_isic2018
from fedpartial.data.catalog.nih_cxr14 import CLASSES as NIH_CLASSES
from fedpartial.data.catalog.nih_cxr14.loader import load_nih_cxr14
from fedpartial.data.manifest import ManifestError, read_manifest
from fedpartial.data.protocols import assign
from fedpartial.data.sources.base import SourceTable, most_frequent_classes


def _png(path: Path, value: int = 0) -> None:
    """An 8 x 8 image of ``value`` with a corner pixel of its own (no two files byte-identical: prepare keeps exact
    copies in one split)."""
    import zlib

    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("L", (8, 8), color=value)
    tag = zlib.crc32(str(path).encode())
    img.putpixel((0, 0), tag % 256)
    img.putpixel((1, 0), (tag >> 8) % 256)
    img.save(path)


def _nih_labels(n_patients: int = 40, seed: int = 0) -> tuple[list[str], list[str], np.ndarray]:
    """Image names, patient ids and a (N, 14) 0/1 matrix, 1-3 images per patient."""
    rng = np.random.default_rng(seed)
    names, pids = [], []
    for p in range(1, n_patients + 1):
        for j in range(int(rng.integers(1, 4))):
            names.append(f"{p:08d}_{j:03d}.png")
            pids.append(str(p))
    labels = (rng.random((len(names), 14)) < 0.25).astype(int)
    labels[:, :5] |= (rng.random((len(names), 5)) < 0.2).astype(int)  # first classes most frequent
    return names, pids, labels


@pytest.fixture
def tiny_nih(tmp_path: Path) -> Path:
    """NIH sample layout: labels.csv (0/1 columns) + images/*.png."""
    root = tmp_path / "nih"
    names, pids, labels = _nih_labels()
    for i, n in enumerate(names):
        _png(root / "images" / n, i % 255)
    df = pd.DataFrame(labels, columns=NIH_CLASSES)
    df.insert(0, "Patient ID", pids)
    df.insert(0, "Image Index", names)
    df.to_csv(root / "labels.csv", index=False)
    return root


@pytest.fixture
def tiny_ham(tmp_path: Path) -> Path:
    """HAM10000 layout with every class; a few lesions with two images; one metadata row without an image."""
    root = tmp_path / "ham"
    rng = np.random.default_rng(1)
    rows = []
    dx = [c.lower() for c in HAM_CLASSES]
    for i in range(70):
        lesion = f"HAM_{i // 2 if i < 20 else i:07d}"  # lesions 0..9 have two images
        rows.append((lesion, f"ISIC_{i:07d}", dx[i % 7] if i < 35 else str(rng.choice(dx))))
    for _, image_id, _ in rows:
        _png(root / "images" / f"{image_id}.jpg", 3)
    rows.append(("HAM_9999999", "ISIC_9999999", "nv"))  # image absent: dropped
    pd.DataFrame(rows, columns=["lesion_id", "image_id", "dx"]).assign(dx_type="histo").to_csv(
        root / "HAM10000_metadata.csv", index=False
    )
    return root


def _raw(folder: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(folder / f"{name}.csv", dtype=str, keep_default_na=False)


def _prep(src: str, root: Path, out: Path, **kw) -> Path:
    kw.setdefault("num_sites", 4)
    kw.setdefault("protocol", "missing_k")
    if kw["protocol"] == "missing_k":
        kw.setdefault("k", 2)
    kw.setdefault("verbose", False)
    kw.setdefault("figure", False)
    return prep.prepare(src, root, out, **kw)


# ----------------------------------------------------------------------------------------------- the loaders


def test_ham_loader(tiny_ham):
    t = load_ham10000(tiny_ham)
    assert t.task == "multiclass" and t.classes == HAM_CLASSES
    assert len(t.frame) == 70  # the row without an image is dropped
    assert (t.frame[HAM_CLASSES].sum(axis=1) == 1).all()
    assert t.frame.loc[0, "image"] == "images/ISIC_0000000.jpg"
    assert t.frame.loc[0, "patient_id"] == t.frame.loc[1, "patient_id"] == "HAM_0000000"
    assert t.frame.loc[0, "MEL"] == 1 and t.frame.loc[1, "NV"] == 1


def test_isic2018_layout(tiny_ham):
    meta = pd.read_csv(tiny_ham / "HAM10000_metadata.csv")
    gt = pd.DataFrame({"image": meta["image_id"]})
    for c in HAM_CLASSES:
        gt[c] = (meta["dx"] == c.lower()).astype(float)
    gt.to_csv(tiny_ham / "gt.csv", index=False)
    with pytest.raises(ValueError, match="LesionGroupings.csv not found.*lesion_groupings=none"):
        load_isic2018(tiny_ham, "gt.csv", "images")  # one lesion could land in train and test: refused
    with pytest.warns(UserWarning, match="its own lesion"):
        t = load_isic2018(tiny_ham, "gt.csv", "images", lesion_groupings="none")
    ref = load_ham10000(tiny_ham)
    assert t.name == "isic2018" and len(t.frame) == 70
    assert (t.frame[HAM_CLASSES].to_numpy() == ref.frame[HAM_CLASSES].to_numpy()).all()
    assert (t.frame["patient_id"] == t.frame["image_id"]).all()
    with pytest.warns(UserWarning):
        assert load_ham10000(tiny_ham, metadata="gt.csv", lesion_groupings="none").name == "isic2018"
    groups = pd.DataFrame({"image": meta["image_id"], "lesion_id": meta["lesion_id"]})
    groups.to_csv(tiny_ham / "groups.csv", index=False)
    t2 = load_isic2018(tiny_ham, "gt.csv", "images", lesion_groupings="groups.csv")
    assert list(t2.frame["patient_id"]) == list(ref.frame["patient_id"])
    gt.loc[3, "NV"] = 1.0  # two positives
    gt.to_csv(tiny_ham / "bad.csv", index=False)
    with pytest.raises(ValueError, match="line 5"):
        load_isic2018(tiny_ham, "bad.csv", "images", lesion_groupings="none")


def test_nih_labels_csv_layout(tiny_nih):
    t = load_nih_cxr14(tiny_nih)
    names, pids, labels = _nih_labels()
    assert t.task == "multilabel" and t.classes == NIH_CLASSES
    assert list(t.frame["image"]) == [f"images/{n}" for n in names]
    assert (t.frame[NIH_CLASSES].to_numpy() == labels).all()
    with pytest.raises(ValueError, match="View Position"):
        load_nih_cxr14(tiny_nih, view="PA")
    sub = load_nih_cxr14(tiny_nih, classes=["Hernia", "Mass"])
    assert sub.classes == ["Mass", "Hernia"] and "Atelectasis" not in sub.frame.columns
    with pytest.raises(ValueError):
        load_nih_cxr14(tiny_nih, classes=["Covid"])


def test_nih_official_layout(tmp_path):
    """Data_Entry_2017.csv with '|'-separated findings, images in images_00x/images/, PA filter."""
    root = tmp_path / "nih_official"
    names, pids, labels = _nih_labels(12)
    findings = ["|".join(c for c, v in zip(NIH_CLASSES, row) if v) or "No Finding" for row in labels]
    views = ["PA" if i % 3 else "AP" for i in range(len(names))]
    for i, n in enumerate(names):
        _png(root / f"images_{1 + i % 2:03d}" / "images" / n)
    pd.DataFrame(
        {"Image Index": names, "Finding Labels": findings, "Follow-up #": 0, "Patient ID": pids, "View Position": views}
    ).to_csv(root / "Data_Entry_2017.csv", index=False)
    t = load_nih_cxr14(root)
    assert (t.frame[NIH_CLASSES].to_numpy() == labels).all()
    assert t.frame.loc[1, "image"] == f"images_002/images/{names[1]}"
    pa = load_nih_cxr14(root, view="PA")
    assert len(pa.frame) == sum(v == "PA" for v in views) and set(pa.frame["view"]) == {"PA"}
    pd.DataFrame({"Image Index": names[:1], "Finding Labels": ["Covid"], "Patient ID": pids[:1]}).to_csv(
        root / "bad.csv", index=False
    )
    with pytest.raises(ValueError, match="Covid"):
        load_nih_cxr14(root, labels_csv="bad.csv")


def test_most_frequent_classes(tiny_nih):
    t = load_nih_cxr14(tiny_nih)
    counts = t.frame[NIH_CLASSES].sum()
    top = most_frequent_classes(t, 3)
    assert len(top) == 3 and top == [c for c in NIH_CLASSES if c in top]  # NIH order
    assert min(counts[top]) >= max(counts.drop(top))
    with pytest.raises(ValueError):
        most_frequent_classes(t, 0)


def test_registry():
    assert set(sources.SOURCES) == {
        "ham10000",
        "isic2018",
        "isic2019",
        "nih_cxr14",
        "chexpert",
        "mimic_cxr",
        "rsna_ich",
        "ich_phantom",
        "csv",
        "folder",
    }
    with pytest.raises(ValueError, match="unknown source"):
        sources.load_source("mnist", ".")


# ---------------------------------------------------------------------------------------------- prepare: nih


def test_prepare_multilabel_invariants(tiny_nih, tmp_path):
    out = _prep("nih_cxr14", tiny_nih, tmp_path / "out", num_sites=4, protocol="missing_k", k=9, seed=3)
    ds = prep.load_prepared(out)
    info = ds.info
    assert ds.classes == NIH_CLASSES and ds.task == "multilabel"
    assert ds.data_root == tiny_nih.resolve() and info["data_root"] == str(tiny_nih.resolve())
    assert list(ds.sites) == ["site-1", "site-2", "site-3", "site-4"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["dataset.json", "val.csv", "test.csv"] + [f"site-{i}.csv" for i in range(1, 5)]
    )
    expected = assign("missing_k", NIH_CLASSES, 4, 3, k=9)
    source = load_nih_cxr14(tiny_nih).frame.set_index("image")
    patients, images = {}, {}
    for name in [*ds.sites, "val", "test"]:
        df = _raw(out, name)
        patients[name], images[name] = set(df["patient_id"]), set(df["image"])
        assert set(df["split"]) == {"train" if name.startswith("site") else name}
        annotated = expected[int(name[5:]) - 1] if name.startswith("site") else range(14)
        for j, c in enumerate(NIH_CLASSES):
            if j in annotated:  # annotated: the true 0/1 labels
                assert (df[c].astype(int).to_numpy() == source.loc[df["image"], c].to_numpy()).all()
            else:  # blanked
                assert (df[c] == "").all()
        assert info["sites"].get(name, NIH_CLASSES) == [NIH_CLASSES[j] for j in annotated]
        m = read_manifest(out / f"{name}.csv", ds.classes, ds.data_root, site=name)
        counts = info["counts"][name]
        assert [counts[c] for c in ds.classes] == [int(p) if a else None for p, a in zip(m.positives(), m.annotated)]
    names = list(patients)
    for i, a in enumerate(names):  # patient-level: no patient (hence no image) in two parts
        for b in names[i + 1 :]:
            assert not patients[a] & patients[b], (a, b)
            assert not images[a] & images[b]
    assert set().union(*images.values()) == set(source.index)  # nothing lost without site_sizes
    sizes = [info["sizes"][s] for s in ds.sites]
    assert max(sizes) - min(sizes) <= 3  # balanced sites (patients have at most 3 images)


def test_prepare_deterministic_and_seed_dependent(tiny_nih, tmp_path):
    a = _prep("nih_cxr14", tiny_nih, tmp_path / "a", seed=5)
    b = _prep("nih_cxr14", tiny_nih, tmp_path / "b", seed=5)
    c = _prep("nih_cxr14", tiny_nih, tmp_path / "c", seed=6)
    for name in ["site-1", "site-2", "site-3", "site-4", "val", "test", "dataset"]:
        ext = ".json" if name == "dataset" else ".csv"
        assert (a / f"{name}{ext}").read_text() == (b / f"{name}{ext}").read_text()
    assert any((a / f"{n}.csv").read_text() != (c / f"{n}.csv").read_text() for n in ["site-1", "test"])


def test_prepare_site_sizes_and_class_subset(tiny_nih, tmp_path, capsys):
    out = prep.prepare("nih_cxr14", tiny_nih, tmp_path / "o", 3, "random_s", s=2, site_sizes=5, top_k_classes=4)
    ds = prep.load_prepared(out)
    top = most_frequent_classes(load_nih_cxr14(tiny_nih), 4)
    assert ds.classes == top
    assert [ds.info["sizes"][s] for s in ds.sites] == [5, 5, 5]
    assert all(len(v) == 2 for v in ds.site_classes.values())
    assert list(_raw(out, "test").columns) == ["image", "patient_id", "split", *top]
    printed = capsys.readouterr().out
    assert "site-3" in printed and "test" in printed and top[0] in printed and " -" in printed
    out2 = prep.prepare("nih_cxr14", tiny_nih, tmp_path / "o2", 2, "full", classes=["Hernia", "Edema"], verbose=False)
    assert prep.load_prepared(out2).classes == ["Hernia", "Edema"]  # --classes sets the order too


def test_prepare_takes_its_options_as_typed_groups_or_flat_and_refuses_a_bad_value_naming_it(tiny_nih, tmp_path):
    """The three option groups and the flat keys of a job's dataset.prepare are one configuration: the same split
    either way; a flat key overrides its group's value; a value of the wrong type is one line naming the option
    and the type, before anything is read or written; an unknown key reaches the protocol, which names it."""
    from fedpartial.options import OptionError

    flat = prep.prepare(
        "nih_cxr14",
        tiny_nih,
        tmp_path / "flat",
        3,
        "random_s",
        s=2,
        seed=3,
        test_frac=0.3,
        classes=NIH_CLASSES[:6],
        verbose=False,
        figure=False,
    )
    typed = prep.prepare(
        "nih_cxr14",
        tiny_nih,
        tmp_path / "typed",
        3,
        "random_s",
        s=2,
        split=prep.SplitOptions(seed=3, test_frac=0.3),
        labels=prep.LabelOptions(classes=NIH_CLASSES[:6]),
        verbose=False,
        figure=False,
    )
    for name in ("site-1", "site-2", "site-3", "val", "test"):
        assert _raw(flat, name).equals(_raw(typed, name)), name
    assert prep.load_prepared(typed).info["seed"] == 3
    split, labels, images, params = prep.prepare_options(
        {"seed": 5, "k": 2, "drop_unreadable": True}, split=prep.SplitOptions(seed=3, val_frac=0.2)
    )
    assert (split.seed, split.val_frac, images.drop_unreadable, params) == (5, 0.2, True, {"k": 2})
    assert labels == prep.LabelOptions()
    with pytest.raises(OptionError, match=r"option 'val_frac' must be float, got 'ten'"):
        prep.prepare("nih_cxr14", tiny_nih, tmp_path / "bad", 3, "full", val_frac="ten")
    with pytest.raises(OptionError, match=r"option 'partition' must be one of 'iid', 'centre'"):
        prep.prepare("nih_cxr14", tiny_nih, tmp_path / "bad", 3, "full", partition="random")
    with pytest.raises(ValueError, match=r"unexpected \['val_fraq'\]"):
        prep.prepare("nih_cxr14", tiny_nih, tmp_path / "bad", 3, "full", val_fraq=0.1, verbose=False)
    assert not (tmp_path / "bad").exists()
    doc = (REPO / "docs" / "datasets.md").read_text()
    for group in prep.OPTION_GROUPS:  # docs/datasets.md names every key a job's dataset.prepare takes
        listed = doc.split(f"`{group.__name__}` (", 1)[1].split(")", 1)[0]
        assert sorted(re.findall(r"`(\w+)`", listed)) == sorted(f.name for f in fields(group)), group


def test_prepare_labeled_unlabeled(tiny_nih, tmp_path):
    out = _prep("nih_cxr14", tiny_nih, tmp_path / "lu", num_sites=4, protocol="labeled_unlabeled", m=1)
    info = prep.load_prepared(out).info
    assert info["sites"] == {"site-1": NIH_CLASSES, "site-2": [], "site-3": [], "site-4": []}
    df = _raw(out, "site-3")
    assert (df[NIH_CLASSES] == "").all().all()
    assert all(v is None for v in info["counts"]["site-2"].values())


# ---------------------------------------------------------------------------------------------- prepare: ham


def test_prepare_multiclass_table(tiny_ham, tmp_path):
    out = _prep("ham10000", tiny_ham, tmp_path / "h", num_sites=5, protocol="table", table="fedlsm_isic")
    ds = prep.load_prepared(out)
    assert ds.task == "multiclass" and ds.classes == HAM_CLASSES
    assert ds.site_classes["site-1"] == ["NV", "BKL", "VASC"]
    source = load_ham10000(tiny_ham).frame.set_index("image")
    for site, annotated in ds.site_classes.items():
        df = _raw(out, site)
        for c in HAM_CLASSES:
            assert (df[c] != "").all() if c in annotated else (df[c] == "").all()
        true = source.loc[df["image"], HAM_CLASSES].to_numpy().argmax(axis=1)
        own = np.isin(np.array(HAM_CLASSES)[true], annotated)
        vals = df[annotated].astype(int).to_numpy()
        assert (vals[own].sum(axis=1) == 1).all()
        assert (vals[~own] == 0).all()  # true class not annotated here: "unlabelled" row
        read_manifest(out / f"{site}.csv", HAM_CLASSES, ds.data_root, site=site, task="multiclass")
    lesion_sets = [set(_raw(out, n)["patient_id"]) for n in [*ds.sites, "val", "test"]]
    assert sum(len(s) for s in lesion_sets) == len(set().union(*lesion_sets))


def test_prepare_multiclass_subset_drops_rows(tiny_ham, tmp_path):
    out = _prep("ham10000", tiny_ham, tmp_path / "h2", num_sites=2, protocol="full", classes=["NV", "MEL", "DF"])
    ds = prep.load_prepared(out)
    assert ds.classes == ["NV", "MEL", "DF"]  # in the order given
    total = sum(ds.info["sizes"].values())
    assert total == int(load_ham10000(tiny_ham).frame[["MEL", "NV", "DF"]].sum().sum())


# -------------------------------------------------------------------------------------- atomicity and errors


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_failure_leaves_nothing(tiny_nih, tmp_path):
    parent = tmp_path / "runs"
    parent.mkdir()
    # a table leaving 'Hernia' unlabelled: the manifests are written, then check_coverage fails
    per_site = [NIH_CLASSES[:7], NIH_CLASSES[7:13]]
    with pytest.raises(ManifestError, match="Hernia"):
        _prep("nih_cxr14", tiny_nih, parent / "out", num_sites=2, protocol="table", table=per_site)
    assert not (parent / "out").exists() and _leftovers(parent) == []
    with pytest.raises(ValueError):  # impossible protocol
        _prep("nih_cxr14", tiny_nih, parent / "out", num_sites=2, protocol="missing_k", k=10)
    assert list(parent.iterdir()) == []


def test_failure_in_loader_leaves_nothing(tmp_path, monkeypatch):
    def broken(root, **kw):
        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / "half.png").write_bytes(b"x")
        raise RuntimeError("generator crashed")

    monkeypatch.setitem(sources.SOURCES, "broken", broken)
    with pytest.raises(RuntimeError, match="crashed"):
        prep.prepare("broken", None, tmp_path / "out", 2, "full", verbose=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_output(tiny_nih, tmp_path):
    out = _prep("nih_cxr14", tiny_nih, tmp_path / "o", seed=1)
    before = (out / "site-1.csv").read_text()
    with pytest.raises(FileExistsError):
        _prep("nih_cxr14", tiny_nih, out, seed=2)
    assert (out / "site-1.csv").read_text() == before
    _prep("nih_cxr14", tiny_nih, out, seed=2, overwrite=True)
    assert (out / "site-1.csv").read_text() != before
    assert _leftovers(tmp_path) == []
    (tmp_path / "empty").mkdir()
    _prep("nih_cxr14", tiny_nih, tmp_path / "empty")  # an empty folder is fine
    assert (tmp_path / "empty" / "dataset.json").is_file()


def _generator(calls: list | None = None):
    """A fake generated source (like ich_phantom): writes PNGs into root on demand."""

    def load(root, n=30, **kw):
        if calls is not None:
            calls.append(str(root))
        root = Path(root)
        rows = []
        for i in range(n):
            rel = f"img/{i}.png"
            if not (root / rel).exists():
                _png(root / rel, i)
            rows.append((rel, f"p{i // 2}", i % 3 == 0, i % 2 == 0))
        frame = pd.DataFrame(rows, columns=["image", "patient_id", "a", "b"]).astype({"a": int, "b": int})
        return SourceTable("gen", "multilabel", ["a", "b"], root, frame, synthetic=True)

    return load


def test_generated_source_lives_in_output(tmp_path, monkeypatch):
    monkeypatch.setitem(sources.SOURCES, "gen", _generator())
    out = prep.prepare("gen", None, tmp_path / "g", 2, "missing_k", k=1, verbose=False)
    ds = prep.load_prepared(out)
    assert ds.info["data_root"] == "." and ds.data_root == out and ds.info["synthetic"] is True
    assert _raw(out, "site-1")["image"].str.startswith("source/img/").all()
    read_manifest(ds.test, ds.classes, ds.data_root, site="test")
    assert _leftovers(tmp_path) == []


def test_source_inside_output(tmp_path, monkeypatch):
    monkeypatch.setitem(sources.SOURCES, "gen", _generator())
    out = tmp_path / "ds"
    _generator()(out / "raw")
    prep.prepare("gen", out / "raw", out, 2, "full", verbose=False)
    ds = prep.load_prepared(out)
    assert ds.info["data_root"] == "." and _raw(out, "val")["image"].str.startswith("raw/img/").all()
    read_manifest(ds.sites["site-2"], ds.classes, ds.data_root, site="site-2")
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------- caching / CLI


def test_ensure_prepared_reuses(tiny_nih, tmp_path, monkeypatch):
    spec = {
        "source": "nih_cxr14",
        "root": str(tiny_nih),
        "num_sites": 3,
        "protocol": "missing_k",
        "k": 5,
        "seed": 0,
        "verbose": False,
    }
    calls = []
    real = prep.prepare

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(prep, "prepare", counting)
    threads = [threading.Thread(target=prep.ensure_prepared, args=(spec, tmp_path / "cache")) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    out = prep.ensure_prepared(spec, tmp_path / "cache")
    assert len(calls) == 1
    assert out.parent == (tmp_path / "cache").resolve() and out.name.startswith("nih_cxr14-missing_k-")
    assert prep.load_prepared(out).info["protocol_params"] == {"k": 5}
    # the same spec with the keys reordered and a relative root spelling: same folder
    monkeypatch.chdir(tiny_nih.parent)
    same = dict(reversed(list({**spec, "root": "nih"}.items())))
    assert prep.ensure_prepared(same, tmp_path / "cache") == out and len(calls) == 1
    other = prep.ensure_prepared({**spec, "seed": 1}, tmp_path / "cache")
    assert other != out and len(calls) == 2


def test_ensure_prepared_generated(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sources.SOURCES, "gen", _generator(calls))
    spec = {"source": "gen", "num_sites": 2, "protocol": "full", "source_args": {"n": 20}, "verbose": False}
    out = prep.ensure_prepared(spec, tmp_path)
    assert prep.ensure_prepared(spec, tmp_path) == out and len(calls) == 1
    assert (out / "source" / "img" / "0.png").is_file()


def test_cli(tiny_nih, tmp_path, capsys):
    out = tmp_path / "cli"
    assert (
        prepare_cli.main(
            [
                "--source",
                "nih_cxr14",
                "--root",
                str(tiny_nih),
                "--out",
                str(out),
                "--sites",
                "2",
                "--protocol",
                "missing_k",
                "--k",
                "1",
                "--classes",
                "Mass,Hernia",
                "Edema",
                "--seed",
                "4",
                "--site-size",
                "10",
                "--source-arg",
                "view=all",
            ]
        )
        == 0
    )
    ds = prep.load_prepared(out)
    assert ds.classes == ["Mass", "Hernia", "Edema"] and ds.info["seed"] == 4
    assert ds.info["source_args"] == {"view": "all"} and ds.info["site_sizes"] == 10
    assert "labelled positives" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prepare_cli.main(["--source", "nih_cxr14", "--out", str(out)])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="atomic folder exchange is Linux's renameat2")
def test_a_folder_prepared_again_is_never_absent_to_a_reader(tmp_path):
    """Publishing over an existing prepared folder exchanges the two in one step: another process polling the
    folder's dataset.json all the while always finds one, whole (old or new), and no old copy is left behind."""
    import subprocess

    from fedpartial.data.prepare import _publish

    final = tmp_path / "prepared"
    final.mkdir()
    (final / "dataset.json").write_text('{"v": 0}')
    (tmp_path / "stop").mkdir()
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            """
import json, os, sys
f, stop, seen, bad = sys.argv[1], sys.argv[2], 0, 0
while os.path.isdir(stop) or not seen:
    try:
        json.loads(open(f).read())["v"]; seen += 1
    except (OSError, ValueError, KeyError):
        bad += 1
print(seen, bad)
""",
            str(final / "dataset.json"),
            str(tmp_path / "stop"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for v in range(1, 1500):
            tmp = tmp_path / f".prepared.tmp{v}"
            tmp.mkdir()
            (tmp / "dataset.json").write_text(json.dumps({"v": v}))
            _publish(tmp, final, inside=False, overwrite=True)
    finally:
        (tmp_path / "stop").rmdir()
        out = reader.communicate(timeout=60)[0]
    seen, bad = map(int, out.split())
    assert json.loads((final / "dataset.json").read_text())["v"] == 1499
    assert bad == 0 and seen > 0, (seen, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]
