"""Label vocabularies: a site maps its own column names to the job's classes and ignores columns
(fedpartial.data.vocabulary, read_manifest, fedpartial_data.json), and fedpartial-prepare writes a split where
groups of sites use different vocabularies, or pools every site into one (the centralised baseline)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fedpartial.data import prepare as prep
from fedpartial.data.catalog.chexpert import NIH_NAMES as CHEXPERT_NAMES
from fedpartial.data.catalog.ich import ABBREVIATIONS as ICH_ABBREVIATIONS
from fedpartial.data.manifest import ManifestError, read_manifest
from fedpartial.data.site_config import SITE_CONFIG_ENV, SiteDataError, resolve_site_data
from fedpartial.data.vocabulary import VocabularyError, check_vocabulary, map_header

CLASSES = ["Atelectasis", "Effusion", "Edema"]


def _csv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "a.png").write_bytes(b"x")
    path.write_text(",".join(header) + "\n" + "\n".join(",".join(r) for r in rows) + "\n")
    return path


def test_synonym_and_ignored_columns_are_read_as_global_classes(tmp_path):
    f = _csv(
        tmp_path / "chexpert.csv",
        ["image", "Pleural Effusion", "Atelectasis", "Support Devices"],
        [["a.png", "1", "", "1"], ["a.png", "0", "1", "0"]],
    )
    m = read_manifest(f, CLASSES, columns={"Pleural Effusion": "Effusion"}, ignore_columns=["Support Devices"])
    assert m.annotated_classes() == ["Atelectasis", "Effusion"]  # Edema: not annotated here
    assert m.labels[:, 1].tolist() == [1, 0] and m.mask[:, 0].tolist() == [False, True]
    # without the vocabulary the same file is the clear "unknown column" error, with a hint
    with pytest.raises(
        ManifestError,
        match=r"line 1: unknown class column\(s\) \['Pleural Effusion', 'Support "
        r"Devices'\].*'columns' in its fedpartial_data.json",
    ):
        read_manifest(f, CLASSES)
    # a mapped column but another unknown one left: still an error naming it
    with pytest.raises(ManifestError, match=r"unknown class column\(s\) \['Support Devices'\]"):
        read_manifest(f, CLASSES, columns={"Pleural Effusion": "Effusion"})


def test_vocabulary_errors():
    with pytest.raises(VocabularyError, match=r"maps \{'Pleural Effusion': 'Efusion'\} onto no class"):
        check_vocabulary({"Pleural Effusion": "Efusion"}, [], CLASSES, "site 's'")
    with pytest.raises(VocabularyError, match="both mapped onto class 'Effusion'"):
        check_vocabulary({"Pleural Effusion": "Effusion", "PE": "Effusion"}, [], CLASSES, "site 's'")
    with pytest.raises(VocabularyError, match="both mapped and ignored"):
        check_vocabulary({"PE": "Effusion"}, ["PE"], CLASSES, "site 's'")
    with pytest.raises(VocabularyError, match="strings"):
        check_vocabulary({"PE": 3}, [], CLASSES, "site 's'")
    with pytest.raises(VocabularyError, match=r"\['Pleural Effusion'\] are mapped onto \['Effusion'\]"):
        map_header(["image", "Effusion", "Pleural Effusion"], CLASSES, {"Pleural Effusion": "Effusion"}, [])


def test_mapping_onto_a_class_the_file_also_has_names_the_file(tmp_path):
    f = _csv(tmp_path / "m.csv", ["image", "Effusion", "Pleural Effusion"], [["a.png", "1", "0"]])
    with pytest.raises(ManifestError, match=r"file '.*m.csv', line 1: column\(s\) \['Pleural Effusion'\]"):
        read_manifest(f, CLASSES, site="s", columns={"Pleural Effusion": "Effusion"})


def test_site_config_carries_the_vocabulary_and_checks_it(tmp_path, monkeypatch):
    cfg = tmp_path / "fedpartial_data.json"
    entry = {"train": "train.csv", "columns": {"Pleural Effusion": "Effusion"}, "ignore_columns": ["No Finding"]}
    cfg.write_text(json.dumps({"datasets": {"cxr": entry}}))
    monkeypatch.setenv(SITE_CONFIG_ENV, str(cfg))
    sd = resolve_site_data("hospital-2", {"name": "cxr", "classes": CLASSES})
    assert sd.vocabulary == {"columns": {"Pleural Effusion": "Effusion"}, "ignore_columns": ["No Finding"]}
    entry["columns"] = {"Pleural Effusion": "Pleural_Effusion"}
    cfg.write_text(json.dumps({"datasets": {"cxr": entry}}))
    with pytest.raises(SiteDataError, match=r"site 'hospital-2', .*fedpartial_data.json, dataset 'cxr'.*onto no class"):
        resolve_site_data("hospital-2", {"name": "cxr", "classes": CLASSES})


def test_prepare_two_vocabularies_and_the_simulator_site_reads_them(tmp_path, monkeypatch):
    monkeypatch.delenv(SITE_CONFIG_ENV, raising=False)
    out = prep.prepare(
        "ich_phantom",
        None,
        tmp_path / "two",
        4,
        "table",
        seed=0,
        verbose=False,
        source_args={"n_images": 80, "size": 32, "seed": 0},
        table=[
            ["epidural", "subdural", "intraventricular"],
            ["epidural", "subdural", "intraparenchymal"],
            ["epidural", "subdural", "subarachnoid"],
            ["epidural", "subdural", "subarachnoid"],
        ],
        vocabularies={"site-3": "ich_abbreviations", "site-4": "ich_abbreviations"},
    )
    ds = prep.load_prepared(out)
    classes = ds.classes
    header = pd.read_csv(ds.sites["site-3"], nrows=0).columns.tolist()
    assert {"EDH", "SDH", "SAH"} <= set(header) and "epidural" not in header
    assert "epidural" in pd.read_csv(ds.sites["site-1"], nrows=0).columns
    assert ds.info["vocabularies"]["site-3"] == {v: k for k, v in ICH_ABBREVIATIONS.items()}
    spec = {"source": "ich_phantom", "root": None, "num_sites": 4, "protocol": "table"}
    monkeypatch.setattr("fedpartial.data.site_config.ensure_prepared", lambda s, c: out)
    sd = resolve_site_data("site-3", {"name": "ich", "prepare": spec, "classes": classes})
    m = read_manifest(sd.train, classes, sd.data_root, site="site-3", **sd.vocabulary)
    assert m.annotated_classes() == ["epidural", "subarachnoid", "subdural"]
    with pytest.raises(ManifestError, match=r"unknown class column\(s\) \['EDH'"):
        read_manifest(sd.train, classes, sd.data_root, site="site-3")


def test_prepare_centralise_pools_the_sites_partial_labels(tmp_path):
    kw = dict(seed=0, verbose=False, source_args={"n_images": 80, "size": 32, "seed": 0}, k=3)
    split = prep.load_prepared(prep.prepare("ich_phantom", None, tmp_path / "fed", 3, "missing_k", **kw))
    central = prep.load_prepared(
        prep.prepare("ich_phantom", None, tmp_path / "c", 3, "missing_k", centralise=True, **kw)
    )
    assert list(central.sites) == ["site-1"] and central.info["centralised_from"] == 3
    pooled = read_manifest(central.sites["site-1"], central.classes, central.data_root)
    parts = [read_manifest(split.sites[s], split.classes, split.data_root) for s in sorted(split.sites)]
    assert len(pooled) == sum(len(p) for p in parts)
    assert np.array_equal(pooled.mask, np.concatenate([p.mask for p in parts]))  # each row keeps its site's labels
    assert not pooled.mask.all() and pooled.annotated.all()


def test_nih_images_split_into_nih_and_chexpert_vocabularies_read_as_the_union(tmp_path):
    """The surgical paper's real-world setting on the real NIH images (benchmarks/surgical.sh EXP=vocab
    DATA=cxr14): sites 1-2 write NIH names, sites 3-4 CheXpert's; read back with each site's mapping, every site's
    annotated classes are its table row in the job's (NIH) names and the two groups together cover all 14."""
    from conftest import real_data

    root = real_data("nih_cxr14_1000")
    shared = ["Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Effusion", "Pneumonia", "Pneumothorax"]
    nih = shared + ["Nodule", "Emphysema", "Fibrosis", "Hernia"]
    chx = shared + ["Mass", "Infiltration", "Pleural_Thickening"]
    classes = sorted(set(nih) | set(chx))
    out = prep.prepare(
        "nih_cxr14",
        root,
        tmp_path / "two",
        4,
        "table",
        seed=0,
        verbose=False,
        classes=classes,
        table=[nih, nih, chx, chx],
        vocabularies={"site-3": "chexpert", "site-4": "chexpert"},
    )
    ds = prep.load_prepared(out)
    header3 = pd.read_csv(ds.sites["site-3"], nrows=0).columns.tolist()
    assert {"Pleural Effusion", "Lung Lesion", "Lung Opacity", "Pleural Other"} <= set(header3)
    assert not {"Effusion", "Mass", "Infiltration", "Pleural_Thickening"} & set(header3)
    assert "Effusion" in pd.read_csv(ds.sites["site-1"], nrows=0).columns
    annotated = {}
    for site, row in zip(sorted(ds.sites), [nih, nih, chx, chx]):
        vocab = ds.info["vocabularies"].get(site)
        assert (vocab == {v: k for k, v in CHEXPERT_NAMES.items()}) == (site in ("site-3", "site-4"))
        m = read_manifest(ds.sites[site], classes, ds.data_root, site=site, columns=vocab)
        annotated[site] = set(m.annotated_classes())
        assert annotated[site] == set(row), site
    assert set().union(*annotated.values()) == set(classes) and len(classes) == 14
