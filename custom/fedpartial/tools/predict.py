"""Use a trained global model: per-class probabilities for new images, or scores on a labelled manifest.

::

    fedpartial-predict RUN --images scans/ -o predictions.csv        # a folder of PNG / JPG / DICOM images
    fedpartial-predict RUN --manifest new_cases.csv -o predictions.csv
    fedpartial-evaluate RUN --manifest test.csv [--split test] [--json scores.json]
    fedpartial-evaluate RUN --manifest test.csv --by source      # also within each source, and their mean

``RUN`` is a simulator workspace (``nvflare simulator ... -w WS``), a downloaded job result
(``nvflare job download`` / ``download_job``), a run folder holding ``app_server/``, or a model file
(``FL_global_model.pt``). The model architecture and the image pipeline (size, channels, CT windows,
normalisation) are read from the job configuration stored with the run (``app_server/config``; override with
``--job-config DIR``), and each image is decoded as the sites' image stores hold it (decoded once, CT windows,
resized by Pillow, rounded to uint8: :class:`fedpartial.data.store.DecodedImages`, ``cache: none``), then
converted and normalised as in training's evaluation, so a probability here equals the one the same image got
during training; an exported bundle (``fedpartial-export``) decodes the same way. ``--model best`` (default) takes
``best_FL_global_model.pt`` (best validation round) when the run has it, else the last global model;
``--model last`` takes ``FL_global_model.pt``.

A site's own model (methods that keep layers local: FedBN's norm layers, PFL's classifier, individual training's
whole model): ``--site site-2`` takes the global model with site-2's own local layers, as that site scored it in
the run's final evaluation (``results.json``: ``final[model].per_site``), from
``fedpartial_state/last_local_model.pt`` in the site's run folder (found under a simulator workspace; at a real
site, pass that file: ``--site <site workspace>/<job id>/fedpartial_state/last_local_model.pt``; the site is then
named by its workspace folder).

Decisions (multi-label): ``--thresholds 0.5`` (or any number) adds a 0/1 ``pred_<class>`` column per class
(probability >= threshold); ``--thresholds validation`` uses the per-class thresholds chosen on the validation
set for that model file during the run (``thresholds.json`` next to the model, or the run's ``results.json``;
a class without one uses 0.5). Without ``--thresholds`` the CSV holds the probabilities only. For
``fedpartial-evaluate`` the thresholded metrics (BACC, F1, precision, recall) use 0.5 unless ``--thresholds``
says otherwise. A single-label model predicts the argmax: thresholds do not apply (an error).

Checks before any image is read: the model file's archive checksums (a damaged copy is one line naming it) and
its tensors' shapes against the model the job's configuration builds; a folder holding several runs is refused,
naming them (pass one as ``RUN``); an output (``-o``, ``--json``, the figures) that is an input (the run, its model
file or its folder of model files, the job configuration, the manifest, an image), compared by real path, is
refused naming both. An image that cannot be read is left out as an exported bundle leaves it out: a line naming
it, its row after the others with empty cells and the reason in a last column ``error``; the exit status is 2 only
when no image could be read.

``--by COLUMN`` (``fedpartial-evaluate``): any column of the manifest (a source, scanner, site, or ``split`` /
``patient_id``; a column the job does not know is read past, not taken for a class) groups the rows; each group is
scored on its own rows (the same metrics, thresholds and undefined-class rules), and the table adds one row per
group, the unweighted mean over the groups (a metric undefined in a group left out) and the pooled score; the JSON
has them under ``by``. A pooled AUROC can be high because the groups' base rates differ (a model that only tells
the hospitals apart) or low although every hospital's ranking is good: the two side by side tell which.

Figures (``fedpartial-evaluate``): per-class ROC and precision-recall curves with the operating threshold marked
(``--thresholds``, else 0.5 as an open dot; none for a single-label model), the per-class AUROC with its bootstrap
interval and, from the run's ``results.json``, each site's test AUROC per class, as PNG files beside
``evaluation.md`` (the table and the figures) in ``--figures DIR`` (default: the ``--json`` file's folder, else
``./evaluation``); ``--no-figures`` skips them. Both commands show their progress over the batches (a tqdm bar on
a terminal, ``k / N`` lines otherwise).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ..data.manifest import RESERVED_COLS, Manifest, read_manifest
from ..data.presets import resolve_dataset
from ..data.sitedata import SiteDatasets
from ..data.store import DecodedImages, Preprocessing
from ..evaluation import predict, scored_mask, scores_metrics
from ..fl.checkpoint import verify_archive
from ..fl.keys import BEST_MODEL, LAST_MODEL, LOCAL_MODEL_FILE, STATE_DIR
from ..fl.report import RESULTS_FILE, THRESHOLDS_FILE
from ..fl.spec import global_model_note, local_parts
from ..metrics import format_table
from ..models import PartialLabelNet, load_weights, read_state, start_normalisation
from ..plots import FIGURE_NAMES, auc_ci_figure, curves_from_scores, final_figures, roc_pr_figures, save_figure
from .bundle_runtime import ERROR_KEY, IMAGE_SUFFIXES, Progress, list_images, read_or_leave_out

SERVER_CONFIG, CLIENT_CONFIG = "config_fed_server.json", "config_fed_client.json"
__all__ = [
    "IMAGE_SUFFIXES",
    "LoadedModel",
    "find_model",
    "load_model",
    "find_thresholds",
    "resolve_thresholds",
    "image_manifest",
    "predict_manifest",
    "evaluate_manifest",
]


@dataclass
class LoadedModel:
    """A global model with what is needed to feed it: the resolved dataset config (classes, task, pipeline)."""

    net: PartialLabelNet
    dataset: dict
    path: Path
    note: str | None = None  # what the global model holds when the method keeps parts local at the sites
    site: str | None = None  # the site whose own local layers the model holds (``--site``)
    site_path: Path | None = None  # the file those layers were read from
    config_dir: Path | None = None  # the folder of the job configuration the model was built from

    @property
    def classes(self) -> list[str]:
        return list(self.dataset["classes"])

    @property
    def task(self) -> str:
        return self.dataset["task"]


def find_model(run: str | Path, which: str = "best") -> Path:
    """The global model file of a run (see the module docstring); prefers the server's ``app_server`` copy. A
    folder holding the model files of more than one run (two ``app_server`` folders, e.g. two jobs downloaded
    into one folder) is a ``ValueError`` naming them: which one is meant is for the user to say."""
    if which not in ("best", "last"):
        raise ValueError(f"--model must be 'best' or 'last', got {which!r}")
    run = Path(run)
    if run.is_file():
        return run
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is neither a run folder nor a model file")
    found = [p for name in (BEST_MODEL, LAST_MODEL) for p in run.rglob(name) if p.is_file()]
    server = [p for p in found if "app_server" in p.relative_to(run).parts] or found
    folders = sorted({p.parent for p in server})
    if len(folders) > 1:
        shown = ", ".join(str(f.relative_to(run)) for f in folders[:5]) + (", ..." if len(folders) > 5 else "")
        raise ValueError(
            f"{run} holds {len(folders)} runs ({shown}): pass one of them as RUN (its folder or its model file)"
        )
    names = [BEST_MODEL, LAST_MODEL] if which == "best" else [LAST_MODEL]
    for name in names:
        hits = [p for p in server if p.name == name]
        if hits:
            return hits[0]
    raise FileNotFoundError(f"no {' or '.join(names)} under {run} (is it a finished run or a downloaded job?)")


def find_job_config(model_path: Path, config_dir: str | Path | None = None) -> Path:
    """The folder holding the run's ``config_fed_server.json`` and ``config_fed_client.json``."""
    candidates = (
        [Path(config_dir)]
        if config_dir
        else [
            model_path.parent / "config",
            model_path.parent,
            *(p / "app_server" / "config" for p in model_path.parents),
        ]
    )
    for c in candidates:
        if (c / SERVER_CONFIG).is_file() and (c / CLIENT_CONFIG).is_file():
            return c
    where = config_dir or f"next to {model_path}"
    raise FileNotFoundError(f"no {SERVER_CONFIG} + {CLIENT_CONFIG} {where}; pass --job-config JOB/app/config")


def find_site_model(run: str | Path, site: str) -> Path:
    """A site's ``fedpartial_state/last_local_model.pt``: ``site`` itself when it is that file, else the one under
    ``run`` (a simulator workspace) in a folder named ``site``."""
    given = Path(site).expanduser()
    if given.suffix == ".pt" or given.is_file():
        if not given.is_file():
            raise FileNotFoundError(f"--site {site}: no such file")
        return given.resolve()
    run = Path(run)
    hits = (
        sorted(h for h in run.rglob(f"{STATE_DIR}/{LOCAL_MODEL_FILE}") if site in h.relative_to(run).parts)
        if run.is_dir()
        else []
    )
    if len(hits) > 1:
        raise ValueError(f"--site {site}: {len(hits)} files under {run} ({', '.join(map(str, hits[:3]))}); pass one")
    if not hits:
        raise FileNotFoundError(
            f"--site {site}: no {site}/.../{STATE_DIR}/{LOCAL_MODEL_FILE} under {run} (a simulator workspace has one "
            f"per site); a real site keeps it in its own workspace: pass <site workspace>/<job id>/{STATE_DIR}/"
            f"{LOCAL_MODEL_FILE} as --site"
        )
    return hits[0]


def with_site_layers(net: PartialLabelNet, own: dict, parts: list[str], where: str) -> None:
    """Load a site's own ``parts`` (parameter groups, :func:`fedpartial.models.parameter_groups`) from its
    state dict ``own`` into ``net``, which holds the global model; the other tensors stay global."""
    groups = net.parameter_groups()
    keys = [k for g in parts for k in groups[g]]
    state = net.state_dict()
    bad = [k for k in keys if k not in own or tuple(own[k].shape) != tuple(state[k].shape)]
    if bad:
        raise ValueError(
            f"{where} does not hold this model's {' and '.join(parts)} layers ({len(bad)} of "
            f"{len(keys)} tensors missing or of another shape, e.g. {bad[0]}): is it this run's?"
        )
    net.load_state_dict({**state, **{k: torch.as_tensor(own[k]).to(state[k].dtype) for k in keys}})


def load_model(
    run: str | Path,
    which: str = "best",
    config_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    site: str | None = None,
) -> LoadedModel:
    """Load a run's global model (PTFileModelPersistor's ``{"model": state_dict}`` or a plain state dict); with
    ``site`` (a site name or its ``last_local_model.pt``), that site's own model: the global one with the site's
    local layers."""
    path = find_model(run, which)
    cfg_dir = find_job_config(path, config_dir)
    server = json.loads((cfg_dir / SERVER_CONFIG).read_text())
    client = json.loads((cfg_dir / CLIENT_CONFIG).read_text())
    model_args = next((c.get("args", {}) for c in server.get("components", []) if c.get("id") == "model"), None)
    if model_args is None:
        raise ValueError(f"{cfg_dir / SERVER_CONFIG} has no 'model' component")
    executor_args = client["executors"][0]["executor"]["args"]
    dataset = resolve_dataset(executor_args["dataset"], f"{cfg_dir / CLIENT_CONFIG} 'dataset'")
    dataset = start_normalisation(dataset, model_args, int(dataset["channels"]))  # as the weights' start expects
    net = PartialLabelNet(**{k: v for k, v in model_args.items() if k != "pretrained"})
    if net.num_classes != len(dataset["classes"]):
        raise ValueError(f"model has {net.num_classes} outputs, the job's dataset {len(dataset['classes'])} classes")
    state = read_state(path)  # tensors only: no pickled code runs
    verify_archive(path)  # every tensor's bytes as saved (the loader does not check them)
    state = state.get("model", state)
    if not isinstance(state, dict):
        raise ValueError(f"model file {path} holds no model state")
    load_weights(net, {k: np.asarray(v) for k, v in state.items()}, path)
    method = str(executor_args.get("method", "fedavg"))
    if method.startswith("{") and method.endswith("}"):  # an NVFlare config variable, e.g. "{method}"
        method = client.get(method[1:-1], method)
    parts = local_parts(method, executor_args.get("method_args"))
    note = global_model_note(parts)
    site_file = None
    if site is not None:
        if not parts:
            raise ValueError(
                f"--site {site}: method {method!r} keeps no layers local, so the global model is every "
                "site's model: leave --site out"
            )
        file = site_file = find_site_model(run, site)
        own = read_state(file, "--site: model state")
        verify_archive(file, "--site: model state")
        with_site_layers(net, own, parts, str(file))
        if Path(site).expanduser().resolve() == file:  # <site workspace>/<job id>/fedpartial_state/<file>
            site = file.parents[2].name if len(file.parents) > 2 else file.stem
        note = (
            f"{site}'s own model: the global model ({path.name}) with {site}'s own {' and '.join(parts)} layers "
            f"({file}), as {site} scored it in the run's final evaluation"
        )
    return LoadedModel(net.to(device).eval(), dataset, path, note, site, site_file, cfg_dir.resolve())


def find_thresholds(model_path: str | Path, site: str | None = None) -> dict:
    """The per-class thresholds chosen on validation for this model file: ``{"criterion", "thresholds": {class:
    value | None}, "chosen_on", ...}`` from ``thresholds.json`` next to it, else from a ``results.json`` in its
    folder or the one above (the run folder). ``site``: those chosen on that site's own validation scores (a site's
    own model, ``--site``) where the run recorded them, else the pooled ones."""
    model_path = Path(model_path)
    candidates = [
        model_path.parent / THRESHOLDS_FILE,
        model_path.parent / RESULTS_FILE,
        model_path.parent.parent / RESULTS_FILE,
    ]
    for path in candidates:
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        data = data.get("thresholds", {}) if path.name == RESULTS_FILE else data
        entry = (data.get("models") or {}).get(model_path.name)
        if entry:
            own = (entry.get("sites") or {}).get(site) if site else None
            if own:
                return {**own, "chosen_on": f"{site}'s own validation scores"}
            return {
                **{k: v for k, v in entry.items() if k != "sites"},
                "chosen_on": "the validation scores of every site that scored " + model_path.name,
            }
        if path.name == THRESHOLDS_FILE or data.get("note"):
            raise ValueError(f"{path} has no thresholds for {model_path.name} ({data.get('note', 'none recorded')})")
    raise FileNotFoundError(
        f"no {THRESHOLDS_FILE} next to {model_path} (nor thresholds in the run's {RESULTS_FILE}): "
        "the run predates validation thresholds or is single-label; use --thresholds 0.5"
    )


def resolve_thresholds(model: LoadedModel, spec: str | None) -> list[float] | None:
    """``--thresholds``: None (no decisions), a number (every class), or ``validation`` (the run's per-class
    thresholds for this model file, 0.5 where none was chosen). Returns ``C`` values in class order."""
    if spec is None:
        return None
    if model.task != "multilabel":
        raise ValueError(
            "a single-label model predicts the argmax class; --thresholds applies to multi-label models only"
        )
    if spec == "validation":
        entry = find_thresholds(model.path, model.site)
        chosen = entry.get("thresholds") or {}
        unknown = sorted(set(chosen) - set(model.classes))
        if unknown:
            raise ValueError(f"thresholds for {model.path.name} name classes {unknown} the model does not have")
        return [0.5 if chosen.get(c) is None else float(chosen[c]) for c in model.classes]
    try:
        value = float(spec)
    except ValueError:
        raise ValueError(f"--thresholds must be a number or 'validation', got {spec!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"--thresholds {value} lies outside [0, 1]")
    return [value] * len(model.classes)


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same real path (symbolic links, ``./x`` and ``x``), or, both
    existing, the same file on disk (a hard link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def input_named(
    out: str | Path, model: LoadedModel, run: str | Path, inputs: dict[str, list] | None = None
) -> str | None:
    """What an output path ``out`` would overwrite of the command's inputs (``"the model file X"``, ...), or None:
    the run itself, its model file (and a site's own model file), the job configuration, every file of the
    folder holding the run's model files (its other model, records and configuration; a run given as a model
    file: the files there the run wrote), and ``inputs`` (``{"manifest": [path], "input image": paths}``)."""
    out = Path(out).expanduser()
    real = out.resolve()
    named = [("the run", Path(run)), ("the model file", model.path)]
    if model.site_path is not None:
        named.append(("the site's model file", model.site_path))
    if model.config_dir is not None:
        named += [("the job configuration", model.config_dir / name) for name in (SERVER_CONFIG, CLIENT_CONFIG)]
    for what, paths in (inputs or {}).items():
        named += [(what, Path(p)) for p in paths]
    for what, path in named:
        if _same_file(out, path):
            return f"{what} {path}"
    folder = model.path.parent.resolve()
    if Path(run).is_dir():  # the run's own folder of model files (app_server): everything in it is the run's
        if real.is_relative_to(folder):
            return f"inside {folder}, the run's folder of model files, configuration and records"
    elif real.parent == folder and out.name in (BEST_MODEL, LAST_MODEL, RESULTS_FILE, THRESHOLDS_FILE):
        return f"the run's {out.name} {folder / out.name}"
    return None


def check_outputs(option_paths: list[tuple[str, str | Path]], model: LoadedModel, run, inputs=None) -> None:
    """A ``ValueError`` of one line for the first output (``(option, path)``) that is an input of the command
    (:func:`input_named`), naming both: nothing the user gave is overwritten."""
    for option, path in option_paths:
        what = input_named(path, model, run, inputs)
        if what is None:
            continue
        if what.startswith("inside"):
            raise ValueError(f"{option} {path} is {what}: choose an output outside it")
        raise ValueError(f"{option} {path} is {what}: it would be overwritten; choose another output")


def add_decisions(df: pd.DataFrame, classes: list[str], thresholds: list[float]) -> pd.DataFrame:
    """``pred_<class>`` = 1 where ``prob_<class> >= threshold`` of that class, else 0 (after the probabilities)."""
    out = df.copy()
    for c, t in zip(classes, thresholds):
        out[f"pred_{c}"] = (out[f"prob_{c}"].to_numpy() >= t).astype(int)
    return out


def image_manifest(folder: str | Path, classes: list[str], task: str = "multilabel") -> Manifest:
    """An unlabelled manifest over every PNG / JPG / DICOM under ``folder`` (sorted, recursive)."""
    paths = list_images(folder)  # the listing an exported bundle uses too
    n, c = len(paths), len(classes)
    return Manifest(
        paths=paths,
        labels=np.zeros((n, c), np.float32),
        mask=np.zeros((n, c), bool),
        classes=list(classes),
        patient_ids=[""] * n,
        splits=["test"] * n,
        lines=list(range(2, n + 2)),
        file=str(Path(folder)),
        task=task,
    )


def read_input_manifest(
    file: str | Path,
    model: LoadedModel,
    data_root: str | Path | None = None,
    split: str | None = None,
    labelled: bool = False,
    by: str | None = None,
) -> Manifest:
    """A manifest CSV (the site contract; errors name the file and line), optionally one split's rows; ``by``: a
    column that is no class (``--by``), read past."""
    ignore = [by] if by and by not in RESERVED_COLS else []
    m = read_manifest(
        file, model.classes, data_root=data_root, task=model.task, require_annotated=labelled, ignore_columns=ignore
    )
    if split:
        m = m.subset(split)
        if len(m) == 0:
            raise ValueError(f"{file} has no rows with split '{split}'")
    return m


def _csv_rows(file: str | Path, column: str) -> tuple[list[list[str]], int]:
    """The CSV's rows and the position of ``column`` in its header; ``ValueError`` naming the columns when it has
    none of that name."""
    with open(file, newline="", encoding="utf-8-sig") as fh:
        rows = list(csv.reader(fh))
    header = [h.strip() for h in rows[0]] if rows else []
    if column not in header:
        raise ValueError(f"{file} has no column '{column}' for --by (its columns: {', '.join(header)})")
    return rows, header.index(column)


def group_values(file: str | Path, manifest: Manifest, column: str) -> list[str]:
    """The value of ``column`` of the manifest CSV ``file`` for each row of ``manifest`` (read from it, by the
    row's CSV line); ``ValueError`` naming the columns when it has none of that name."""
    rows, k = _csv_rows(file, column)
    return [rows[line - 1][k].strip() for line in manifest.lines]


def scores_by_group(
    scores: dict, groups: list[str], task: str, classes: list[str], threshold: float | list[float] = 0.5
) -> dict:
    """The metrics within each group of rows (``groups``: one value per row of ``scores``, :func:`score_manifest`'s
    output) and their unweighted mean over the groups (a metric undefined in a group, e.g. an AUROC where the
    group holds one label only, is left out of that mean): ``{"groups": {value: {"n", "macro", "per_class"}},
    "mean": {metric: value}}``. A model that ranks well within each hospital but whose pooled score rests on the
    hospitals' differing base rates (or the reverse) shows here."""
    values = np.asarray(groups, dtype=object)
    out: dict = {"groups": {}, "mean": {}}
    for g in sorted(set(groups)):
        idx = np.flatnonzero(values == g)
        res = scores_metrics({k: v[idx] for k, v in scores.items()}, task, classes, threshold=threshold)
        out["groups"][g] = {"n": int(len(idx)), "macro": res["macro"], "per_class": res["per_class"]}
    metrics = sorted({m for r in out["groups"].values() for m in r["macro"]})
    for m in metrics:
        vals = [r["macro"].get(m) for r in out["groups"].values()]
        vals = [float(v) for v in vals if isinstance(v, (int, float)) and np.isfinite(v)]
        out["mean"][m] = float(np.mean(vals)) if vals else None
    return out


def group_table(by: dict, pooled: dict, column: str, task: str) -> str:
    """``--by``'s table: one row per group (its rows and macro metrics), the mean over the groups, the pooled."""
    cols = ["auc", "map", "bacc", "f1"] if task == "multilabel" else ["auc", "bacc", "f1", "accuracy"]

    def fmt(v) -> str:
        return f"{100 * v:.2f}" if isinstance(v, (int, float)) and np.isfinite(v) else "n/a"

    rows = [[str(g), str(r["n"])] + [fmt(r["macro"].get(c)) for c in cols] for g, r in by["groups"].items()]
    rows.append(["mean of groups", ""] + [fmt(by["mean"].get(c)) for c in cols])
    rows.append(["pooled", str(pooled.get("n", ""))] + [fmt(pooled["macro"].get(c)) for c in cols])
    header = [column, "n"] + [c.upper() for c in cols]
    w0 = max(len(r[0]) for r in rows + [header])
    line = lambda r: f"{r[0]:<{w0}}  {r[1]:>6}  " + "  ".join(f"{x:>7}" for x in r[2:])  # noqa: E731
    sep = "-" * len(line(header))
    return "\n".join(
        [f"within the groups of '{column}' (macro, %)", line(header), sep, *map(line, rows[:-2]), sep]
        + [line(r) for r in rows[-2:]]
    )


def _loader(model: LoadedModel, manifest: Manifest, batch_size: int):
    """Training's evaluation over ``manifest``: each file decoded as a store row (nothing kept), normalised."""
    return SiteDatasets({"input": manifest}, {**model.dataset, "cache": "none"}).eval_loader("input", batch_size)


def score_manifest(model: LoadedModel, manifest: Manifest, batch_size: int = 64, label: str = "predict") -> dict:
    """:func:`fedpartial.evaluation.predict` over ``manifest`` (``{"probs", "label", "mask", "index"}``), with a
    progress bar / ``k / N`` lines on stderr."""
    loader = _loader(model, manifest, batch_size)
    return predict(model.net, Progress(loader, f"{label}: batch"), model.task, next(model.net.parameters()).device)


class ReadableImages(DecodedImages):
    """:class:`~fedpartial.data.store.DecodedImages` that leave out a file that cannot be read, as the exported
    bundle does (:func:`~fedpartial.tools.bundle_runtime.read_or_leave_out`: a line naming it, its reason kept in
    :attr:`errors` ``{row: why}``), its row zeros in the batch (scored, then dropped)."""

    def __init__(self, paths, prep: Preprocessing):
        self.errors: dict[int, str] = {}
        super().__init__(paths, prep)

    def _channels(self, row: int) -> int:
        try:
            return super()._channels(row)
        except Exception:  # noqa: BLE001 - an unreadable first file: it is left out when its row is read
            return 1

    def __getitem__(self, index):
        if not isinstance(index, (int, np.integer)):
            return super().__getitem__(index)
        row = int(index)
        x, why = read_or_leave_out(self.paths[row], self.prep)
        if x is None:
            self.errors[row] = why
            return np.zeros((1, self.image_size, self.image_size), np.uint8)
        return x


class _InputImages(SiteDatasets):
    """The one split ``input`` over :class:`ReadableImages` (training's evaluation batches and normalisation)."""

    def __init__(self, manifest: Manifest, dataset: dict, images: ReadableImages):
        super().__init__({"input": manifest}, {**dataset, "cache": "none"})
        self._input = images

    def images(self, split: str):
        return self._input


def predict_manifest(
    model: LoadedModel, manifest: Manifest, batch_size: int = 64, thresholds: list[float] | None = None
) -> pd.DataFrame:
    """One row per image: ``image`` and ``prob_<class>`` for every class, then the decisions ``pred_<class>`` at
    ``thresholds`` when given (:func:`add_decisions`). An image that cannot be read is left out as the exported
    bundle leaves it out: named on stderr, listed after the others with empty cells and the reason in a last
    column ``error`` (present only then)."""
    images = ReadableImages(manifest.paths, Preprocessing.of({**model.dataset, "cache": "none"}))
    loader = _InputImages(manifest, model.dataset, images).eval_loader("input", batch_size)
    probs = predict(model.net, Progress(loader, "predict: batch"), model.task, next(model.net.parameters()).device)
    df = pd.DataFrame(probs["probs"], columns=[f"prob_{c}" for c in model.classes])
    df.insert(0, "image", manifest.paths)
    if thresholds is not None:
        df = add_decisions(df, model.classes, thresholds)
    if images.errors:
        bad = sorted(images.errors)
        good = df.drop(index=bad)
        left = pd.DataFrame({"image": [manifest.paths[i] for i in bad]})
        df = pd.concat([good, left], ignore_index=True)
        for c in df.columns[1:]:
            if c.startswith("pred_"):
                df[c] = df[c].astype("Int64")
        df[ERROR_KEY] = [""] * len(good) + [images.errors[i] for i in bad]
    return df


def evaluate_manifest(
    model: LoadedModel,
    manifest: Manifest,
    batch_size: int = 64,
    thresholds: list[float] | None = None,
    scores: dict | None = None,
) -> dict:
    """The project's metrics (``fedpartial.metrics``) of the model on a labelled manifest; multi-label
    thresholded metrics at ``thresholds`` (``C`` values) instead of 0.5 when given. ``scores``: the manifest's
    :func:`score_manifest` output when already computed."""
    pred = scores if scores is not None else score_manifest(model, manifest, batch_size, "evaluate")
    if thresholds is None or model.task != "multilabel":
        return scores_metrics(pred, model.task, model.classes)
    res = scores_metrics(pred, model.task, model.classes, threshold=thresholds)
    res["thresholds"] = dict(zip(model.classes, thresholds))
    return res


def evaluation_figures(
    model: LoadedModel, scores: dict, res: dict, thresholds: list[float] | None, folder: str | Path, prefix: str = ""
) -> dict[str, str]:
    """The figures of ``fedpartial-evaluate`` (module docstring) as PNG files ``folder/<prefix><name>.png``:
    ``roc``, ``pr``, ``auc_ci`` from the scores, ``sites`` from the run's ``results.json`` when there is one.
    Returns ``{name: path}``."""

    classes, folder = model.classes, Path(folder)
    title = f"{model.path.name} on {len(scores['probs'])} images"
    curves = curves_from_scores(scores["label"], scores["probs"], classes, scored_mask(scores, model.task))
    ci = ((res.get("ci") or {}).get("auc") or {}).get("per_class") or {}
    multilabel = model.task == "multilabel"
    thr = dict(zip(classes, thresholds)) if thresholds is not None and multilabel else {}
    figs = dict(zip(("roc", "pr"), roc_pr_figures(curves, thr, ci, title, 0.5 if multilabel else None)))
    figs["auc_ci"] = auc_ci_figure(res, title=title)
    for path in (model.path.parent / RESULTS_FILE, model.path.parent.parent / RESULTS_FILE):
        if path.is_file():
            sites = final_figures(json.loads(path.read_text()), model.path.name).get("sites")
            if sites is not None:
                figs["sites"] = sites
            break
    return {name: save_figure(fig, folder / f"{prefix}{FIGURE_NAMES[name]}") for name, fig in figs.items()}


# ------------------------------------------------------------------------------------------------------------ CLI


def _parser(prog: str, doc: str, evaluate_mode: bool) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="simulator workspace, downloaded job result, run folder or model .pt file")
    src = ap.add_mutually_exclusive_group(required=True)
    if not evaluate_mode:
        src.add_argument("--images", help="folder of PNG / JPG / DICOM images (recursive)")
    src.add_argument("--manifest", help="manifest CSV (image column relative to --data-root)")
    ap.add_argument("--data-root", help="folder the manifest's image paths are relative to (default: its folder)")
    ap.add_argument("--split", help="only the manifest rows of this split (train / val / test)")
    ap.add_argument(
        "--model",
        default="best",
        choices=["best", "last"],
        help="best validation round (default, falls back to last) or the last global model",
    )
    ap.add_argument("--job-config", help="folder with the job's config_fed_server/client.json (default: the run's)")
    ap.add_argument(
        "--site",
        help="a site's own model (methods keeping layers local): a site of a simulator "
        "workspace, or the site's fedpartial_state/last_local_model.pt",
    )
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--thresholds",
        default=None,
        metavar="0.5|X|validation",
        help="multi-label decisions: a probability threshold for every class, or 'validation' for the "
        "per-class thresholds chosen on the run's validation set; "
        + (
            "metrics at 0.5 when not given"
            if evaluate_mode
            else "adds pred_<class> 0/1 columns (without it: probabilities only)"
        ),
    )
    if evaluate_mode:
        ap.add_argument("--json", help="also write the metrics as JSON to this file")
        ap.add_argument(
            "--by",
            metavar="COLUMN",
            help="also score within the groups of this manifest column (e.g. source, scanner, site) and "
            "give their mean beside the pooled score",
        )
        ap.add_argument(
            "--figures",
            metavar="DIR",
            help="folder of the figures and evaluation.md (default: the --json file's folder, else ./evaluation)",
        )
        ap.add_argument("--no-figures", action="store_true", help="print the table only")
    else:
        ap.add_argument("-o", "--out", required=True, help="output CSV")
    return ap


def _load(args) -> LoadedModel:
    model = load_model(args.run, args.model, args.job_config, args.device, site=args.site)
    print(
        f"model {model.path} ({model.net.arch}, {len(model.classes)} classes: {', '.join(model.classes)})",
        file=sys.stderr,
    )
    if model.note:
        print(f"note: {model.note}", file=sys.stderr)
    return model


def _cli(prog: str, run, argv: list[str] | None) -> int:
    """Run a command; bad input (missing run / config / image, bad manifest, an unreadable or another job's model
    file) ends as one error line, exit 2."""
    args = _parser(prog, __doc__, prog == "fedpartial-evaluate").parse_args(argv)
    try:
        run(args)
    except (OSError, ValueError) as e:  # ManifestError / ImageLoadError name the file (and line)
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _predict(args) -> None:
    model = _load(args)
    given = {"the manifest": [args.manifest]} if args.manifest else {}
    check_outputs([("-o", args.out)], model, args.run, given)  # before any image is read
    if args.images:
        manifest = image_manifest(args.images, model.classes, model.task)
    else:
        manifest = read_input_manifest(args.manifest, model, args.data_root, args.split)
    check_outputs([("-o", args.out)], model, args.run, {"the input image": manifest.paths})
    thresholds = resolve_thresholds(model, args.thresholds)
    if thresholds is not None:
        print(f"decisions at thresholds {dict(zip(model.classes, thresholds))}", file=sys.stderr)
    df = predict_manifest(model, manifest, args.batch_size, thresholds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False, float_format="%.6f")
    left = int((df[ERROR_KEY] != "").sum()) if ERROR_KEY in df else 0
    skipped = f"; {left} image(s) left out (unreadable: the 'error' column says why)" if left else ""
    print(f"wrote {len(df) - left} predictions to {out}{skipped}", file=sys.stderr)
    if left and left == len(df):
        raise ValueError(f"none of the {left} images could be read")


def _evaluate(args) -> None:
    model = _load(args)
    outputs = [("--json", args.json)] if args.json else []
    if not args.no_figures:
        folder = Path(args.figures) if args.figures else (Path(args.json).parent if args.json else Path("evaluation"))
        prefix = Path(args.manifest).stem + (f"_{args.split}" if args.split else "") + "_"
        outputs += [("--figures", folder / f"{prefix}{name}") for name in (*FIGURE_NAMES.values(), "evaluation.md")]
    check_outputs(outputs, model, args.run, {"the manifest": [args.manifest]})
    if args.by:
        _csv_rows(args.manifest, args.by)  # a column the manifest lacks: said before its rows are checked
    manifest = read_input_manifest(args.manifest, model, args.data_root, args.split, labelled=True, by=args.by)
    check_outputs(outputs, model, args.run, {"the input image": manifest.paths})
    groups = group_values(args.manifest, manifest, args.by) if args.by else None  # before any image is read
    thresholds = resolve_thresholds(model, args.thresholds)
    scores = score_manifest(model, manifest, args.batch_size, "evaluate")
    res = evaluate_manifest(model, manifest, args.batch_size, thresholds, scores=scores)
    if groups is not None:
        thr = thresholds if thresholds is not None and model.task == "multilabel" else 0.5
        res["by"] = {"column": args.by, **scores_by_group(scores, groups, model.task, model.classes, thr)}
    if thresholds is not None:
        print(f"thresholded metrics at {dict(zip(model.classes, thresholds))}")
    table = format_table(
        res, title=f"{model.path.name} on {args.manifest}" + (f" ({args.split})" if args.split else "")
    )
    if groups is not None:
        table += "\n\n" + group_table(res["by"], res, args.by, model.task)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float))
    if not args.no_figures:
        try:
            figs = evaluation_figures(model, scores, res, thresholds, folder, prefix)
        except ImportError as e:  # matplotlib is in requirements.txt; a bare install may lack it
            print(f"(no figures: {e})", file=sys.stderr)
            return
        md = folder / f"{prefix}evaluation.md"
        md.write_text(
            "\n".join(["```", table, "```", ""] + [f"![{name}]({Path(p).name})\n" for name, p in figs.items()])
        )
        print(f"figures: {', '.join(figs.values())}; table and figures: {md}")


def main(argv: list[str] | None = None) -> int:
    """``fedpartial-predict``: per-class probabilities to CSV."""
    return _cli("fedpartial-predict", _predict, argv)


def evaluate_main(argv: list[str] | None = None) -> int:
    """``fedpartial-evaluate``: the project's metrics on a labelled manifest."""
    return _cli("fedpartial-evaluate", _evaluate, argv)


if __name__ == "__main__":
    sys.exit(main())
