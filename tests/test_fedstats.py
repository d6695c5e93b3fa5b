"""Look before you train: the federated statistics job (``jobs/fedstats_*``) counts what the manifests hold, under
the sites' minimum count, and its report warns about shortcuts (``fedpartial.data_report``)."""

from __future__ import annotations

import json
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import StatisticsConstants as StC
from nvflare.fuel.utils import fobs
from test_predict import images, sim_ws  # noqa: F401 - test_predict's fixtures: a labelled manifest, a run folder

from conftest import REPO, real_data, run_recipe, server_log
from fedpartial.data_report import THRESHOLDS, intensity_divergences, summarise, warnings_of, withheld_counts
from fedpartial.fl.fedstats import (
    PIXEL_LEVELS,
    PolicyMinCountCleanser,
    PolicyStatisticsPrivacyFilter,
    Values,
    manifest_features,
    pixel_tables,
)
from fedpartial.stats_recipe import DataStatsRecipe, stats_main
from fedpartial.tools.build_jobs import export_job, is_training_job

MIN_COUNT = 5


def _expected(n: int, min_count: int = MIN_COUNT):
    """What a site releases of a count: itself, or None (withheld) from 1 to min_count - 1."""
    return n if n == 0 or n >= min_count else None


@pytest.mark.integration
@pytest.mark.realdata
def test_statistics_job_counts_equal_the_manifests(tmp_path, monkeypatch):
    """``fedstats_ham10000`` in the simulator on a small share of HAM10000: per site and split, the images,
    patients and each class's positives / negatives in its report equal a direct count of the site's manifests,
    a count from 1 to min_count - 1 withheld (at least one small class is); the intensity histograms came through
    NVFlare's range agreement; the report, its JSON and its figure are in the server's run folder."""
    from fedpartial.data.cache import cache_dir
    from fedpartial.data.manifest import read_manifest
    from fedpartial.data.prepare import ensure_prepared
    from fedpartial.data.prepared import load_prepared
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.site_config import simulated_spec

    root = real_data("ham10000")
    cache = tmp_path / "cache"
    dataset = {"preset": "ham10000", "image_size": 16, "prepare": {"site_sizes": 30}}
    proc = run_recipe("fedstats_ham10000", tmp_path / "ws", {"dataset": dataset}, env={"FEDPARTIAL_CACHE": str(cache)})
    run = tmp_path / "ws" / "fedstats_ham10000"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(run)[-3000:]
    folder = run / "server" / "simulate_job"
    report = json.loads((folder / "data_report.json").read_text())
    assert (folder / "data_report.md").is_file() and (folder / "data_intensity.png").stat().st_size > 0
    assert (folder / "data_statistics.json").is_file()  # NVFlare's own statistics JSON

    monkeypatch.setenv("FEDPARTIAL_CACHE", str(cache))
    ds = resolve_dataset(dataset)
    prepared = load_prepared(ensure_prepared(simulated_spec(ds), cache_dir()))
    assert root.name in str(prepared.data_root)
    read = dict(classes=ds["classes"], data_root=prepared.data_root, task=ds["task"], require_annotated=False)
    assert report["sites"] == sorted(prepared.sites)
    withheld, pixels = 0, 0
    for site, train in prepared.sites.items():
        manifests = {"train": read_manifest(train, **read).subset("train")}
        manifests.update({"val": read_manifest(prepared.val, **read), "test": read_manifest(prepared.test, **read)})
        for split, m in manifests.items():
            got = report["per_site"][site]["splits"][split]
            want = manifest_features(m, ds["classes"])
            assert got["images"] == _expected(len(m)) == len(m)
            assert got["patients"] == _expected(want["patients"].count)
            for j, c in enumerate(ds["classes"]):
                pos, neg = int(m.positives()[j]), int(m.negatives()[j])
                assert got["classes"][c]["positives"] == _expected(pos), (site, split, c)
                assert got["classes"][c]["negatives"] == _expected(neg), (site, split, c)
                withheld += got["classes"][c]["positives"] is None
                if pos == neg == 0:
                    assert got["classes"][c]["status"] == "not annotated"
        intensity = report["per_site"][site]["intensity"]
        assert sorted(intensity) == ["c0", "c1", "c2"]
        hist = intensity["c0"]["histogram"]
        assert len(hist) == 32 and sum(b[2] for b in hist) == len(manifests["train"]) * 16 * 16
        pixels += len(manifests["train"]) * 16 * 16
    assert withheld > 0  # a small class withheld by the minimum count
    pooled = report["pooled"]["intensity"]["c0"]
    assert len(pooled) == 32 and sum(b[2] for b in pooled) == pixels  # the agreed (noised) range holds every pixel


def _ctx(props: dict) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(FLContextKey.SCOPE_PROPERTIES, props, private=True, sticky=False)
    ctx.set_prop(FLContextKey.EFFECTIVE_JOB_SCOPE_NAME, "strict", private=True, sticky=False)
    return ctx


def _site_answer(counts: dict) -> dict:
    return {
        StC.STATS_COUNT: {"train": dict(counts)},
        StC.STATS_FAILURE_COUNT: {"train": {k: 0 for k in counts}},
        StC.STATS_SUM: {"train": dict(counts)},
    }


def test_site_policy_min_count_withholds_a_small_class():
    """The minimum count is the stricter of the job's and the site's privacy scope's: a class with fewer positives
    loses its count (not only NVFlare's other statistics of it), a class the site does not annotate stays 0, and
    the report says 'withheld' and still knows the class is annotated there (its negatives were released)."""
    cleanser = PolicyMinCountCleanser(min_count=MIN_COUNT)
    counts = {"images": 60, "pos_0": 12, "neg_0": 48, "pos_1": 0, "neg_1": 0, "pos_2": 3, "neg_2": 57}
    out, modified = cleanser.apply(_site_answer(counts), "site-1")
    assert modified and out[StC.STATS_COUNT]["train"] == {k: v for k, v in counts.items() if k != "pos_2"}
    # the site's 'strict' scope, as NVFlare hands it to the site's task-result filter
    ctx = _ctx({"min_count": 20})
    ctx.set_prop(ReservedKey.ENGINE, SimpleNamespace(get_component={"mc": cleanser}.get), private=True, sticky=False)
    task = StC.STATS_1st_STATISTICS
    dxo = DXO(DataKind.STATISTICS, {StC.STATISTICS_TASK_KEY: task, task: fobs.dumps(_site_answer(counts))})
    dxo = PolicyStatisticsPrivacyFilter(result_cleanser_ids=["mc"]).process_dxo(dxo, Shareable(), ctx)
    assert cleanser.min_count == 20
    out = fobs.loads(dxo.data[task])
    kept = out[StC.STATS_COUNT]["train"]
    assert kept == {"images": 60, "neg_0": 48, "pos_1": 0, "neg_1": 0, "neg_2": 57}
    assert "pos_0" not in out[StC.STATS_SUM]["train"] and "neg_0" in out[StC.STATS_SUM]["train"]
    cleanser.handle_event(EventType.START_RUN, _ctx({"min_count": 2}))  # a scope cannot lower the job's
    assert cleanser.min_count == MIN_COUNT

    data = {f: {"count": {"site-1": {"train": n}}} for f, n in kept.items()}
    summary = summarise(data, ["A", "B", "C"])
    cls = summary["per_site"]["site-1"]["splits"]["train"]["classes"]
    assert cls["A"]["status"] == "annotated" and cls["A"]["positives"] is None and cls["A"]["negatives"] == 48
    assert cls["B"]["status"] == "not annotated" and cls["B"]["unlabelled"] == 60
    assert {"site": "site-1", "split": "train", "what": "A positives"} in withheld_counts(summary)


def _ham_images(n: int, size: int = 32) -> np.ndarray:
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.store import Preprocessing, decode_resized

    root = real_data("ham10000")
    paths = sorted((root / "images").glob("*.jpg"))[:n]
    prep = Preprocessing.of(resolve_dataset({"preset": "ham10000", "image_size": size}))
    return np.stack([decode_resized(p, prep, 3) for p in paths])


def _intensity_data(sites: dict[str, np.ndarray], bins: int = 32) -> dict:
    """NVFlare's combined statistics of the sites' pixel features, histograms over one agreed range."""
    data: dict = {}
    for site, pixels in sites.items():
        for k, table in enumerate(pixel_tables(pixels)):
            v = Values(PIXEL_LEVELS, table)
            f = data.setdefault(f"intensity_c{k}", {"count": {}, "sum": {}, "histogram": {}})
            f["count"][site], f["sum"][site] = {"train": v.count}, {"train": v.sum}
            f["histogram"][site] = {"train": v.histogram(bins, -1e-5, 255 * 1.2).bins}
    return data


@pytest.mark.realdata
def test_intensity_warning_on_a_brightened_site_not_on_an_honest_split():
    """Three sites dealt at random from the same HAM10000 images: no intensity warning; the same sites with one
    site's images brightened by 40 grey levels (a scanner or export shortcut): a warning naming that site only."""
    decoded = _ham_images(60)
    order = np.random.default_rng(0).permutation(len(decoded))
    sites = {f"site-{i + 1}": decoded[order[i * 20 : (i + 1) * 20]] for i in range(3)}
    honest = summarise(_intensity_data(sites), [])
    div = intensity_divergences(honest)
    assert max(max(v.values()) for v in div.values()) < THRESHOLDS["intensity_js"], div
    assert [w for w in warnings_of(honest) if w["kind"] == "intensity"] == []

    sites["site-2"] = np.clip(sites["site-2"].astype(np.int16) + 40, 0, 255).astype(np.uint8)
    shortcut = summarise(_intensity_data(sites), [])
    flagged = [w for w in warnings_of(shortcut) if w["kind"] == "intensity"]
    assert [w["site"] for w in flagged] == ["site-2"], intensity_divergences(shortcut)
    assert flagged[0]["js"] > THRESHOLDS["intensity_js"]


def test_label_and_size_warnings():
    """A class annotated by one site, a class with few positives (withheld counts added as their bound), a
    prevalence differing by more than the factor, a site whose images all have one size: each warned, with the
    thresholds given; nothing warned where they hold."""
    data: dict = {}

    def put(feature, site, n, stat="count", split="train"):
        data.setdefault(feature, {}).setdefault(stat, {}).setdefault(site, {})[split] = n

    for site, (a_pos, a_neg, b_pos, b_neg, sd) in {
        "site-1": (50, 50, 10, 90, 0.0),
        "site-2": (5, 95, 0, 0, 30.0),
        "site-3": (40, 60, 0, 0, 25.0),
    }.items():
        put("images", site, 100)
        put("pos_0", site, a_pos)
        put("neg_0", site, a_neg)
        put("pos_1", site, b_pos)
        put("neg_1", site, b_neg)
        put("pos_2", site, 0)
        put("neg_2", site, 0)
        for k in ("width", "height"):
            put(k, site, 100)
            put(k, site, 100 * 512.0, "sum")
            put(k, site, sd, "stddev")
    kinds = {(w["kind"], w.get("class") or w.get("site")) for w in warnings_of(summarise(data, ["A", "B", "C"]))}
    assert kinds == {
        ("single_site_class", "B"),
        ("few_positives", "B"),
        ("prevalence", "A"),
        ("one_size", "site-1"),
        ("unannotated_class", "C"),
    }
    relaxed = warnings_of(summarise(data, ["A", "B"]), {"min_positives": 10, "prevalence_ratio": 20})
    assert {w["kind"] for w in relaxed} == {"single_site_class", "one_size"}


def test_evaluate_by_column_scores_within_each_group(tmp_path):
    """``fedpartial-evaluate --by source`` on a hand-built manifest (a column the job does not know, rows of
    another split in between): each group's AUROC is the one counted by hand over its own rows, the mean of the
    groups leaves out a class undefined in a group, and the pooled score is beside it."""
    from PIL import Image

    from fedpartial.tools.predict import group_table, group_values, read_input_manifest, scores_by_group

    rows = [  # image, source, split, A, B, (probability of A, of B)
        ("x1", "x", "test", "1", "1", 0.9, 0.7),
        ("x2", "x", "test", "1", "0", 0.8, 0.2),
        ("v1", "x", "val", "0", "1", 0.0, 0.0),
        ("y1", "y", "test", "1", "", 0.3, 0.5),
        ("x3", "x", "test", "0", "1", 0.85, 0.6),
        ("y2", "y", "test", "0", "", 0.2, 0.5),
        ("x4", "x", "test", "0", "0", 0.1, 0.3),
        ("y3", "y", "test", "0", "", 0.4, 0.5),
    ]
    for name, *_ in rows:
        Image.new("L", (8, 8), 128).save(tmp_path / f"{name}.png")
    csv_file = tmp_path / "manifest.csv"
    csv_file.write_text(
        "image,source,split,A,B\n" + "".join(f"{n}.png,{s},{sp},{a},{b}\n" for n, s, sp, a, b, *_ in rows)
    )
    model = SimpleNamespace(classes=["A", "B"], task="multilabel")
    m = read_input_manifest(csv_file, model, split="test", labelled=True, by="source")
    groups = group_values(csv_file, m, "source")
    test_rows = [r for r in rows if r[2] == "test"]
    assert groups == [r[1] for r in test_rows] and len(m) == 7
    scores = {
        "probs": np.array([[r[5], r[6]] for r in test_rows], dtype=np.float32),
        "label": m.labels,
        "mask": m.mask,
        "index": np.arange(len(m)),
    }
    by = scores_by_group(scores, groups, "multilabel", ["A", "B"])
    x, y = by["groups"]["x"], by["groups"]["y"]
    assert (x["n"], y["n"]) == (4, 3)
    # x: A positives {.9, .8} vs negatives {.85, .1}: 3 of 4 pairs ordered; B {.7, .6} vs {.2, .3}: all 4
    assert x["per_class"]["A"]["auc"] == pytest.approx(0.75) and x["per_class"]["B"]["auc"] == pytest.approx(1.0)
    # y: A {.3} vs {.2, .4}: 1 of 2; B not annotated in y: undefined
    assert y["per_class"]["A"]["auc"] == pytest.approx(0.5)
    assert not np.isfinite(y["per_class"]["B"]["auc"] if y["per_class"]["B"]["auc"] is not None else np.nan)
    assert x["macro"]["auc"] == pytest.approx(0.875) and y["macro"]["auc"] == pytest.approx(0.5)
    assert by["mean"]["auc"] == pytest.approx((0.875 + 0.5) / 2)
    pooled = {"n": 7, "macro": {"auc": 0.8}}
    table = group_table(by, pooled, "source", "multilabel")
    assert "mean of groups" in table and "68.75" in table and "pooled" in table and "80.00" in table
    with pytest.raises(ValueError, match="no column 'scanner'"):
        group_values(csv_file, m, "scanner")


def test_evaluate_cli_by_column(sim_ws, images, tmp_path, capsys):  # noqa: F811 - the fixtures imported above
    """``fedpartial-evaluate RUN --manifest M --by scanner --json J``: the table's group rows, mean and pooled
    rows, and the JSON's ``by`` with each group's rows."""
    import pandas as pd

    import fedpartial.tools.predict as P

    ws, _ = sim_ws
    folder, labelled = images
    df = pd.read_csv(labelled, dtype=str, keep_default_na=False)
    df.insert(1, "scanner", ["s1", "s2", "s1", "s2", "s1"])
    manifest = tmp_path / "with_scanner.csv"
    df.to_csv(manifest, index=False)
    out = tmp_path / "scores.json"
    argv = [str(ws), "--manifest", str(manifest), "--data-root", str(folder), "--json", str(out), "--no-figures"]
    assert P.evaluate_main([*argv, "--by", "scanner"]) == 0
    text = capsys.readouterr().out
    assert "within the groups of 'scanner'" in text and "mean of groups" in text and "pooled" in text
    res = json.loads(out.read_text())
    assert res["by"]["column"] == "scanner" and {g: r["n"] for g, r in res["by"]["groups"].items()} == {
        "s1": 3,
        "s2": 2,
    }
    assert P.evaluate_main([*argv, "--by", "hospital"]) == 2
    assert "no column 'hospital'" in capsys.readouterr().err


def test_statistics_job_exports_for_any_federation(tmp_path):
    """The exported statistics job deploys one app to every site (``@ALL``: any site names), ships the package,
    and writes the job's minimum count, the policy-aware filter and the report's thresholds into its configuration
    (``job.py``'s ``--set min_count=... --set thresholds.<name>=...`` reach them)."""
    job = REPO / "jobs" / "fedstats_ham10000"
    assert not is_training_job(job) and is_training_job(REPO / "jobs" / "fedavg_ham10000")
    out = export_job(job, tmp_path, min_count=20, thresholds={"prevalence_ratio": 3.0})
    assert json.loads((out / "meta.json").read_text())["deploy_map"] == {"app": ["@ALL"]}
    assert (out / "app/custom/fedpartial/fl/fedstats.py").is_file()
    client = json.loads((out / "app/config/config_fed_client.json").read_text())
    comps = {c["id"]: c for c in client["components"]}
    assert comps["min_count_cleanser"]["args"] == {"min_count": 20}
    # the split the table's training jobs use (5 % validation), so the statistics describe what they train on
    assert comps["stats_generator"]["args"]["dataset"] == {
        "preset": "ham10000",
        "image_size": 64,
        "prepare": {"val_frac": 0.05},
    }
    filters = [f["path"] for g in client["task_result_filters"] for f in g["filters"]]
    assert filters == ["fedpartial.fl.fedstats.PolicyStatisticsPrivacyFilter"]
    server = json.loads((out / "app/config/config_fed_server.json").read_text())
    # nvflare job submit re-reads every configuration as HOCON and saves it again: the same keys must come back
    from pyhocon import ConfigFactory, HOCONConverter

    for config in (server, client):
        again = json.loads(HOCONConverter.to_json(ConfigFactory.from_dict(config)))
        assert again == config
    hist = server["workflows"][0]["args"]["statistic_configs"]["histogram"]
    assert "*" not in hist and hist["pos_6"] == {"bins": 20} and hist["intensity_c2"]["bins"] == 32
    writer = next(c for c in server["components"] if c["id"] == "stats_writer")["args"]
    assert writer["min_count"] == 20 and writer["thresholds"] == {**THRESHOLDS, "prevalence_ratio": 3.0}
    recipe = partial(DataStatsRecipe, name="x", dataset="ham10000", num_sites=5)
    with pytest.raises(SystemExit) as stop:  # an unknown threshold: one line, exit 2
        stats_main(recipe, ["--set", "thresholds.nope=1"])
    assert stop.value.code == 2
