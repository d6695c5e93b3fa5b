"""How good are FedMLP's pseudo labels? A simulation-only diagnostic that compares each site's permanent tags
with the source's full labels:

    python -m fedpartial.tools.tag_audit WS [WS ...] [--json OUT]

``WS`` is a finished simulator workspace (``nvflare simulator ... -w WS``, or a run kept by
``benchmarks/run_jobs.py --keep``). For every site the tool reads the tags the site kept (``fedmlp_pseudo_labels`` in
``fedpartial_state/trainer_state.pt``: ``(N, C)``, -1 untagged, 0 / 1 pseudo labels, in training-row order), the
site's training manifest of the simulated split, and the true label of every missing entry from the source
dataset the split was prepared from (matched by image file). It prints, per class, over the sites where the
class is missing: the missing entries, their true prevalence, the positive / negative tags with their precision,
and the share of the true positives that got a positive tag. Several workspaces (e.g. the seeds of one
configuration) are pooled.

Only a simulated split has these true labels: nothing here runs at a site or travels, and a deployment (sites
with their own ``fedpartial_data.json``) has nothing to audit. A positive-tag precision near the prevalence means
the prototype scores (Eq. 7) do not separate the class on this data: the tags then add label noise, not labels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from ..data.manifest import read_manifest
from ..data.prepare import DATASET_JSON, load_prepared, prepared_path
from ..data.presets import resolve_dataset
from ..data.site_config import cache_dir, simulated_site_data, simulated_spec
from ..data.sources import load_source
from ..fl.keys import STATE_FILE
from ..methods.fedmlp.trainer import STATE_PSEUDO_LABELS as TAGS_KEY


def tag_quality(tags: np.ndarray, truth: np.ndarray, missing: np.ndarray) -> dict[str, np.ndarray]:
    """Counts and precisions of pseudo labels against the true labels, per class.

    Args:
        tags: ``(N, C)`` int, -1 untagged, 0 / 1 pseudo labels.
        truth: ``(N, C)`` 0 / 1 true labels.
        missing: ``(C,)`` bool, the classes the site does not annotate (only these entries are counted).

    Returns: ``(C,)`` arrays: ``entries`` (missing entries), ``true_pos`` (true positives among them),
    ``pos_tags`` / ``pos_correct`` (positive tags / those truly positive), ``neg_tags`` / ``neg_correct``; counts
    are 0 for annotated classes.
    """
    tags, truth = np.asarray(tags), np.asarray(truth).astype(bool)
    if tags.shape != truth.shape:
        raise ValueError(f"tags {tags.shape} and true labels {truth.shape} differ in shape")
    cols = np.asarray(missing, bool)[None, :]
    pos, neg = (tags == 1) & cols, (tags == 0) & cols
    return {
        "entries": np.broadcast_to(cols, tags.shape).sum(0),
        "true_pos": (truth & cols).sum(0),
        "pos_tags": pos.sum(0),
        "pos_correct": (pos & truth).sum(0),
        "neg_tags": neg.sum(0),
        "neg_correct": (neg & ~truth).sum(0),
    }


def summarise(counts: dict[str, np.ndarray], classes: list[str]) -> list[dict]:
    """One row per class with at least one missing entry: counts plus prevalence, positive / negative tag
    precision and the recall of the true positives (None where undefined)."""

    def ratio(a, b):
        return float(a) / float(b) if b else None

    rows = []
    for j, name in enumerate(classes):
        c = {k: int(v[j]) for k, v in counts.items()}
        if not c["entries"]:
            continue
        rows.append(
            {
                "class": name,
                **c,
                "prevalence": ratio(c["true_pos"], c["entries"]),
                "pos_precision": ratio(c["pos_correct"], c["pos_tags"]),
                "neg_precision": ratio(c["neg_correct"], c["neg_tags"]),
                "pos_recall": ratio(c["pos_correct"], c["true_pos"]),
            }
        )
    return rows


def _client_args(site_dir: Path) -> dict:
    hits = sorted(site_dir.rglob("config_fed_client.json"))
    if not hits:
        raise FileNotFoundError(f"no config_fed_client.json under {site_dir}")
    config = json.loads(hits[0].read_text())
    return config["executors"][0]["executor"]["args"]


def site_truth(site: str, site_dir: Path, tables: dict | None = None) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``(classes, annotated (C,) bool, truth (N, C))`` of a simulated site's training rows, in row order.
    ``tables``: source tables already loaded, by root (filled in)."""

    ds = resolve_dataset(_client_args(site_dir)["dataset"])
    if not ds.get("prepare"):
        raise ValueError(f"site '{site}': the job's dataset is not a simulated split; there are no true labels")
    folder = prepared_path(simulated_spec(ds), cache_dir())
    if not (folder / DATASET_JSON).is_file():  # never prepare a split here: audit the one the run used
        raise FileNotFoundError(
            f"site '{site}': the run's split {folder.name} is not in {folder.parent} (set "
            "FEDPARTIAL_CACHE to the cache the run used)"
        )
    data = simulated_site_data(site, ds)
    classes = list(ds["classes"])
    manifest = read_manifest(
        data.train,
        classes,
        data_root=data.data_root,
        site=site,
        task=ds["task"],
        require_annotated=False,
        **data.vocabulary,
    ).subset("train")
    info = load_prepared(folder).info
    generated = folder / "source"  # a generated source (the phantom) lives inside the prepared folder
    root = generated if info.get("data_root") == "." and generated.is_dir() else data.data_root
    tables = {} if tables is None else tables
    if str(root) not in tables:
        table = load_source(info["source"], root, **(info.get("source_args") or {}))
        tables[str(root)] = table.frame.set_index(table.frame["image"].map(lambda p: str((table.root / p).resolve())))
    frame = tables[str(root)]
    keys = [str(Path(p).resolve()) for p in manifest.paths]
    absent = [k for k in keys if k not in frame.index]
    if absent:
        raise ValueError(f"site '{site}': {len(absent)} training image(s) not in the source table, e.g. {absent[0]}")
    truth = frame.loc[keys, classes].to_numpy(dtype=np.int64)
    wrong = np.argwhere(manifest.mask & (truth != manifest.labels))
    if len(wrong):  # the match by image file must give the annotated labels back
        i, j = wrong[0]
        raise ValueError(
            f"site '{site}': {data.train} line {manifest.lines[i]}, class {classes[j]}: the manifest "
            f"says {int(manifest.labels[i, j])}, the source {truth[i, j]}; not the split of this source"
        )
    return classes, manifest.annotated, truth


def audit(workspace: str | Path) -> dict:
    """Per-site and pooled tag quality of a finished simulator workspace (see the module docstring); ``counts``
    holds the pooled :func:`tag_quality` counts."""
    ws = Path(workspace)
    states = sorted(ws.glob(f"site-*/**/fedpartial_state/{STATE_FILE}"))
    if not states:
        raise FileNotFoundError(f"no site state ({STATE_FILE}) under {ws}")
    pooled, classes, sites, tables = None, None, {}, {}
    for path in states:
        site = path.relative_to(ws).parts[0]
        state = torch.load(path, map_location="cpu", weights_only=True)
        if TAGS_KEY not in state:
            raise ValueError(f"{path}: no {TAGS_KEY} (not a FedMLP run, or no stage-2 round ran)")
        classes, annotated, truth = site_truth(site, ws / site, tables)
        counts = tag_quality(state[TAGS_KEY].numpy(), truth, ~annotated)
        sites[site] = summarise(counts, classes)
        pooled = counts if pooled is None else {k: pooled[k] + v for k, v in counts.items()}
    return {
        "workspace": str(ws),
        "classes": classes,
        "pooled": summarise(pooled, classes),
        "sites": sites,
        "counts": {k: v.tolist() for k, v in pooled.items()},
    }


def render(rows: list[dict]) -> str:
    """A markdown table of :func:`summarise` rows (shares in %)."""

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}"

    lines = [
        "| class | missing entries | prevalence | positive tags | precision | recall | negative tags | precision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['class']} | {r['entries']} | {pct(r['prevalence'])} | {r['pos_tags']} | "
            f"{pct(r['pos_precision'])} | {pct(r['pos_recall'])} | {r['neg_tags']} | {pct(r['neg_precision'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "workspace", nargs="+", help="finished simulator workspaces of FedMLP jobs on simulated splits (pooled)"
    )
    ap.add_argument("--json", help="also write the per-workspace reports and the pooled rows here")
    a = ap.parse_args(argv)
    try:
        reports = [audit(ws) for ws in a.workspace]
    except (FileNotFoundError, ValueError) as e:
        print(f"tag_audit: {e}", file=sys.stderr)
        return 2
    classes = reports[0]["classes"]
    if any(r["classes"] != classes for r in reports):
        print("tag_audit: the workspaces have different class lists; audit them one by one", file=sys.stderr)
        return 2
    counts = {k: np.sum([np.asarray(r["counts"][k]) for r in reports], axis=0) for k in reports[0]["counts"]}
    pooled = summarise(counts, classes)
    print(
        "FedMLP pseudo labels against the source's labels (simulation only), all sites of "
        + ", ".join(r["workspace"] for r in reports)
        + ":"
    )
    print(render(pooled))
    if a.json:
        Path(a.json).write_text(json.dumps({"pooled": pooled, "workspaces": reports}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
