"""The data-quality pass of prepare: bad inputs stop with one line naming the source file and line, nothing
written; left-out rows are reported; images are decoded once (cached); the prepared-data cache notices a corrected
label in the source CSV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from published_layouts import HAM, NIH, ham10000_release, nih_release

from conftest import real_data
from fedpartial.data import prepare as prep
from fedpartial.data import quality
from fedpartial.data.site_config import SITE_CONFIG_ENV, SiteDataError, resolve_site_data
from fedpartial.data.sources.base import SourceError

pytestmark = pytest.mark.realdata


@pytest.fixture(autouse=True)
def _shared_data(tmp_path, monkeypatch):
    for folder in (NIH, HAM):
        real_data(folder.name)
    monkeypatch.setenv("FEDPARTIAL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(SITE_CONFIG_ENV, raising=False)


def _line_of(csv: Path, image_id: str) -> int:
    df = pd.read_csv(csv, dtype=str)
    return int(np.flatnonzero(df["image_id"] == image_id)[0]) + 2


def _image(root: Path, image_id: str) -> Path:
    return next(root.glob(f"HAM10000_images_part_*/{image_id}.jpg"))


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(prep.__file__).parents[2])}
    return subprocess.run(
        [sys.executable, "-m", "fedpartial.data.prepare_cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _nothing_written(tmp_path: Path, name: str = "out") -> None:
    assert not (tmp_path / name).exists()
    assert not list(tmp_path.glob(f".{name}.tmp-*"))


def test_missing_image_is_reported_with_count_name_and_line(tmp_path, capsys):
    root = ham10000_release(tmp_path / "ham")
    meta = root / "HAM10000_metadata.csv"
    gone = pd.read_csv(meta)["image_id"].iloc[5]
    _image(root, gone).unlink()
    out = prep.prepare("ham10000", root, tmp_path / "out", 2, "full", figure=False)
    printed = capsys.readouterr().out
    info = json.loads((out / "dataset.json").read_text())
    [d] = info["dropped"]
    assert d["count"] == 1 and d["first"] == [gone] and d["lines"] == [_line_of(meta, gone)]
    assert f"left out: 1 row(s) of {meta} have no image file under the root: {gone} (line 7)" in printed
    assert sum(info["sizes"].values()) == 27


def test_truncated_jpeg_stops_prepare_naming_the_csv_line(tmp_path):
    root = ham10000_release(tmp_path / "ham")
    meta = root / "HAM10000_metadata.csv"
    bad = pd.read_csv(meta)["image_id"].iloc[9]
    img = _image(root, bad)
    img.write_bytes(img.read_bytes()[: img.stat().st_size // 2])  # truncated: the header still reads
    with pytest.raises(SourceError) as e:
        prep.prepare("ham10000", root, tmp_path / "out", 2, "full", verbose=False, figure=False)
    msg = str(e.value)
    assert f"{meta} line {_line_of(meta, bad)}" in msg and bad in msg and "truncated" in msg
    assert "--exclude" in msg and "--drop-unreadable" in msg
    _nothing_written(tmp_path)
    proc = _cli(
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
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("fedpartial-prepare: error: ")
    assert f"line {_line_of(meta, bad)}" in proc.stderr
    _nothing_written(tmp_path)
    # the two ways on: leave it out explicitly, or drop every unreadable image with a report
    (tmp_path / "exclude.txt").write_text(f"# broken scan\n{bad}\n")
    out = prep.prepare(
        "ham10000", root, tmp_path / "ex", 2, "full", exclude=tmp_path / "exclude.txt", verbose=False, figure=False
    )
    info = json.loads((out / "dataset.json").read_text())
    assert [(d["reason"], d["first"]) for d in info["dropped"]] == [
        ("were excluded", [img.relative_to(root).as_posix()])
    ]
    out = prep.prepare(
        "ham10000", root, tmp_path / "drop", 2, "full", drop_unreadable=True, verbose=False, figure=False
    )
    info = json.loads((out / "dataset.json").read_text())
    assert info["dropped"][0]["count"] == 1 and sum(info["sizes"].values()) == 27
    with pytest.raises(SourceError, match="does not have"):
        prep.prepare("ham10000", root, tmp_path / "typo", 2, "full", exclude="ISIC_0000000", verbose=False)
    _nothing_written(tmp_path, "typo")


def test_images_are_decoded_once_and_again_when_they_change(tmp_path, monkeypatch):
    root = ham10000_release(tmp_path / "ham", n=14)
    calls = []
    real = quality.decode_image
    monkeypatch.setattr(quality, "decode_image", lambda p: calls.append(p.name) or real(p))
    prep.prepare("ham10000", root, tmp_path / "a", 2, "full", verbose=False, figure=False, val_frac=0.2, test_frac=0.2)
    assert len(calls) == 14
    calls.clear()
    prep.prepare("ham10000", root, tmp_path / "b", 2, "full", verbose=False, figure=False, val_frac=0.2, test_frac=0.2)
    assert calls == []
    img = next(root.glob("HAM10000_images_part_1/*.jpg"))
    os.utime(img, ns=(img.stat().st_atime_ns, img.stat().st_mtime_ns + 10**9))
    prep.prepare("ham10000", root, tmp_path / "c", 2, "full", verbose=False, figure=False, val_frac=0.2, test_frac=0.2)
    assert calls == [img.name]


def test_dx_typo_names_the_metadata_line(tmp_path):
    root = ham10000_release(tmp_path / "ham")
    meta = root / "HAM10000_metadata.csv"
    df = pd.read_csv(meta)
    df.loc[12, "dx"] = "mell"
    df.to_csv(meta, index=False)
    proc = _cli(
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
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{meta} line 14: unknown dx value 'mell'" in proc.stderr
    _nothing_written(tmp_path)


def test_corrected_label_in_the_source_csv_is_picked_up_by_the_cache(tmp_path, monkeypatch):
    root = ham10000_release(tmp_path / "ham")
    spec = {
        "source": "ham10000",
        "root": str(root),
        "num_sites": 2,
        "protocol": "full",
        "seed": 0,
        "figure": False,
        "verbose": False,
    }
    cache = tmp_path / "cache"
    out = prep.ensure_prepared(spec, cache)
    meta = root / "HAM10000_metadata.csv"
    df = pd.read_csv(meta)
    image = df["image_id"].iloc[3]

    def label_of(folder: Path) -> dict:
        for f in json.loads((folder / "dataset.json").read_text())["files"].values():
            m = pd.read_csv(folder / f, dtype=str)
            hit = m[m["image"].str.contains(image)]
            if len(hit):
                return {c: hit.iloc[0][c] for c in ("MEL", "NV", "BKL")}
        raise AssertionError(image)

    before = label_of(out)
    new = "bkl" if df.loc[3, "dx"] != "bkl" else "mel"
    df.loc[3, "dx"] = new
    df.to_csv(meta, index=False)
    assert prep.stale_sources(out) == [str(meta.resolve())]
    again = prep.ensure_prepared(spec, cache)
    assert again == out and label_of(again)[new.upper()] == "1" and label_of(again) != before
    assert prep.stale_sources(out) == []
    stamp = (out / "dataset.json").stat().st_mtime_ns
    assert prep.ensure_prepared(spec, cache) == out and (out / "dataset.json").stat().st_mtime_ns == stamp
    # a label corrected in place with the file's size and mtime put back: its ctime tells
    st = meta.stat()
    text = meta.read_text()
    swapped = "mel" if new != "mel" else "bkl"  # another three-letter code, the same size
    meta.write_text(text.replace(f",{new},", f",{swapped},", 1))
    os.utime(meta, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert meta.stat().st_size == st.st_size and meta.stat().st_mtime_ns == st.st_mtime_ns
    assert prep.stale_sources(out) == [str(meta.resolve())]
    prep.ensure_prepared(spec, cache)
    assert prep.stale_sources(out) == []
    monkeypatch.setattr(prep, "_STARTED", (out / "dataset.json").stat().st_mtime + 1)
    prep.ensure_prepared({**spec, "refresh": True}, cache)  # the refresh option prepares again
    assert (out / "dataset.json").stat().st_mtime_ns > stamp


def test_site_config_with_a_bom_is_read(tmp_path, monkeypatch):
    cfg = tmp_path / "fedpartial_data.json"
    cfg.write_text(
        json.dumps({"datasets": {"ham10000": {"data_root": ".", "train": "train.csv"}}}), encoding="utf-8-sig"
    )
    assert cfg.read_bytes()[:3] == b"\xef\xbb\xbf"
    monkeypatch.setenv(SITE_CONFIG_ENV, str(cfg))
    sd = resolve_site_data("site-1", {"name": "ham10000"}, simulated=False)
    assert sd.train == tmp_path / "train.csv"


def test_top_k_classes_that_differ_from_the_job_class_list_are_caught_at_prepare(tmp_path):
    root = nih_release(tmp_path / "nih", n=60)
    table = prep.load_source("nih_cxr14", root)
    top = prep.subset_classes(table, top_k=3).classes
    job_classes = [c for c in table.classes if c not in top][:3]
    dataset = {
        "name": "nih_cxr14",
        "classes": job_classes,
        "prepare": {
            "source": "nih_cxr14",
            "root": str(root),
            "num_sites": 2,
            "protocol": "full",
            "top_k_classes": 3,
            "figure": False,
            "verbose": False,
        },
    }
    with pytest.raises(SiteDataError) as e:
        resolve_site_data("site-1", dataset, simulated=True)
    msg = str(e.value)
    assert f"have classes {top}" in msg and f"job's class list is {job_classes}" in msg
    assert "top_k_classes=3 picked them from the data" in msg


def test_unknown_source_option_is_one_line(tmp_path):
    root = ham10000_release(tmp_path / "ham", n=14)
    proc = _cli(
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
            "--source-arg",
            "veiw=PA",
        ]
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "source 'ham10000' takes no option(s) ['veiw']" in proc.stderr
    _nothing_written(tmp_path)


def test_data_check_decodes_fully_where_the_header_check_passes(tmp_path):
    from fedpartial.data.manifest import ManifestError, read_manifest
    from fedpartial.data.transforms import check_image_header

    root = ham10000_release(tmp_path / "ham", n=14)
    images = sorted(p.relative_to(root).as_posix() for p in root.glob("HAM10000_images_part_*/*.jpg"))
    bad = root / images[4]
    full = (HAM / "images" / bad.name).read_bytes()  # the 224 px original: half of it keeps a readable header
    bad.write_bytes(full[: len(full) // 2])
    check_image_header(bad)  # the cheap header check does not see it
    classes = ["MEL", "NV"]
    (tmp_path / "train.csv").write_text("image,MEL,NV\n" + "".join(f"{i},1,0\n" for i in images))
    read_manifest(tmp_path / "train.csv", classes, root, site="site-1", verify_images=False)
    with pytest.raises(ManifestError) as e:
        read_manifest(tmp_path / "train.csv", classes, root, site="site-1", verify_images=True)
    msg = str(e.value)
    assert "site 'site-1'" in msg and "train.csv" in msg and "line 6" in msg and bad.name in msg
    assert "truncated" in msg


def test_missing_dicom_names_the_rsna_csv_line_not_a_temporary_manifest(tmp_path):
    from fedpartial.data.catalog.ich.phantom import generate_ich_phantom

    root = generate_ich_phantom(tmp_path / "rsna", n_images=30, size=32)
    csv = root / "stage_2_train.csv"
    ids = pd.read_csv(csv)["ID"]  # ID_<hex>_<subtype>
    image = ids.iloc[10].rsplit("_", 1)[0]
    line = int(np.flatnonzero(ids.str.startswith(image + "_"))[0]) + 2  # the image's first row
    (root / "stage_2_train" / f"{image}.dcm").unlink()
    proc = _cli(
        [
            "--source",
            "rsna_ich",
            "--root",
            str(root),
            "--out",
            str(tmp_path / "out"),
            "--sites",
            "2",
            "--protocol",
            "missing_k",
            "--k",
            "1",
        ]
    )
    last = proc.stderr.strip().splitlines()[-1]  # (the loader also logs that the missing file has no PatientID)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and last.startswith("fedpartial-prepare: error:")
    assert f"{csv} line {line}: image stage_2_train/{image}.dcm cannot be used: image file not found" in last
    assert ".tmp-" not in proc.stderr
    _nothing_written(tmp_path)


def test_a_generated_source_is_prepared_once_and_then_reused(tmp_path):
    """The ICH phantom is generated inside the folder being prepared: the cache must not record that temporary path
    as a source file, or every later use looks stale and prepares again (simulated sites starting together then
    read a folder another site is rewriting)."""
    from fedpartial.data.prepare import DATASET_JSON, ensure_prepared, stale_sources

    spec = {
        "source": "ich_phantom",
        "num_sites": 2,
        "protocol": "missing_k",
        "k": 2,
        "source_args": {"n_images": 40, "size": 32, "seed": 0},
    }
    out = ensure_prepared(spec, tmp_path, verbose=False)
    stamp = (out / DATASET_JSON).stat().st_mtime_ns
    assert stale_sources(out) == []
    assert ensure_prepared(spec, tmp_path, verbose=False) == out
    assert (out / DATASET_JSON).stat().st_mtime_ns == stamp  # reused, not prepared again
