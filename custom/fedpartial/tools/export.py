"""Export a run's trained global model (``--site``: a site's own model, for methods that keep layers local) as a
MONAI bundle that a hospital runs without this package.

::

    fedpartial-export RUN -o BUNDLE [--model best|last] [--no-torchscript] [--onnx]
    python -m monai.bundle run --config_file BUNDLE/configs/inference.json --dataset_dir IMAGES --output_dir OUT

``RUN`` is what ``fedpartial-predict`` takes (a simulator workspace, a downloaded job result, a run folder or a
model file). The bundle (MONAI Bundle Specification):

- ``configs/metadata.json``: MONAI's metadata keys (``version``, ``monai_version``, ``pytorch_version``,
  ``numpy_version``, ``optional_packages_version``, ``task``, ``description``, ``authors``, ``copyright``,
  ``network_data_format`` with the input tensor and the class names as the output channels), plus
  ``thresholds`` (per class, chosen on the run's validation set; 0.5 where none was chosen), ``preprocessing``,
  ``eval_metrics`` (test metrics with bootstrap intervals) and ``training`` (job, method, rounds, sites with their
  sizes and annotated classes, a data fingerprint, the privacy-ledger summary);
- ``configs/inference.json``: a folder of PNG / JPG / DICOM images -> ``OUT/predictions.csv`` with
  ``fedpartial-predict``'s columns (``image``, ``prob_<class>``) plus the decisions (multi-label ``pred_<class>``
  at the thresholds, single-label ``prediction`` = the argmax class); MONAI transforms and the TorchScript model,
  with the image decoder in ``scripts/image_io.py`` (training's own decoding module
  :mod:`fedpartial.data.decode`, copied whole, then :mod:`fedpartial.tools.bundle_runtime`);
- ``models/model.pt`` (the state dict), ``models/model.ts`` (TorchScript, traced and checked against the
  model), ``models/model.onnx`` with ``--onnx`` (needs the ``onnx`` package: ``pip install onnx``);
- ``docs/README.md``: the model card (data, sites, metrics with intervals, thresholds, known limits) with its
  figures (``docs/*.png``);
- ``.fedpartial-export.json``: the bundle's own files with their sha256; ``--force`` replaces those and keeps
  anything else in the folder (a user's notes in ``models/``, pages in ``docs/``, the inference's ``eval/``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from ..data import decode
from ..data.catalog import DATASETS
from ..data.store import file_sha256
from ..fl.report import RESULTS_FILE
from ..plots import FIGURE_NAMES
from . import bundle_runtime
from .model_card import write_model_card
from .predict import LoadedModel, find_thresholds, load_model

BUNDLE_FILES = (
    "configs/metadata.json",
    "configs/inference.json",
    "models/model.pt",
    "models/model.ts",
    "scripts/__init__.py",
    "scripts/image_io.py",
    "docs/README.md",
)
RUNTIME_MODULE = "scripts.image_io"
DECODER_START, DECODER_END = "# --- decoder (replaced at export) ---", "# --- end decoder ---"
FUTURE_IMPORT = "from __future__ import annotations\n"  # the bundle's file has the decoder's, at its top
MODALITY = {preset: d.modality for d in DATASETS.values() if d.modality for preset in d.presets}
"""DICOM modality code by preset (a model's ``dataset.name``), from the catalog (XC: external-camera photography)."""
BATCH_SIZE = 64


# ------------------------------------------------------------------------------------------------ the runtime


def decoder_source() -> str:
    """Training's image decoding as the bundle holds it: the file of :mod:`fedpartial.data.decode`, whole and
    unchanged (standalone: NumPy, Pillow and, when a DICOM file is read, pydicom only)."""
    return Path(decode.__file__).read_text()


def runtime_source() -> str:
    """``scripts/image_io.py``: :func:`decoder_source` (``fedpartial/data/decode.py`` copied whole), then
    :mod:`fedpartial.tools.bundle_runtime` without its decoder block (its docstring as comments, its imports and
    the rest as they are; the result imports nothing of this package)."""
    text = Path(bundle_runtime.__file__).read_text()
    head, rest = text.split(DECODER_START, 1)
    _, tail = rest.split(DECODER_END, 1)
    doc, imports = head.split(FUTURE_IMPORT, 1)
    comments = "".join(f"# {line}".rstrip() + "\n" for line in doc.strip().strip('"').strip().splitlines())
    text = (
        decoder_source().rstrip("\n")
        + "\n\n\n# --- the bundle's runtime: fedpartial/tools/bundle_runtime.py, copied at export ---\n#\n"
        + comments
        + "\n"
        + imports.strip("\n")
        + "\n"
        + tail
    )
    if "fedpartial." in "".join(line for line in text.splitlines(True) if line.lstrip().startswith(("import", "from"))):
        raise RuntimeError("the bundle's scripts/image_io.py would import this package")
    return text


# ----------------------------------------------------------------------------------------------- the contents


def run_results(model: LoadedModel) -> dict:
    """The run's ``results.json`` (in the model's folder or the one above), or {} when absent."""
    for folder in (model.path.parent, model.path.parent.parent):
        if (folder / RESULTS_FILE).is_file():
            return json.loads((folder / RESULTS_FILE).read_text())
    return {}


def bundle_thresholds(model: LoadedModel) -> dict:
    """``{"values": [C floats], "chosen": {class: threshold | None}, "criterion", "n_val"}`` for a multi-label
    model (0.5 where no threshold was chosen on validation), ``{}`` for a single-label one (the argmax decides)."""
    if model.task != "multilabel":
        return {}
    try:
        entry = find_thresholds(model.path, model.site)
    except (FileNotFoundError, ValueError):
        entry = {}
    chosen = {c: (entry.get("thresholds") or {}).get(c) for c in model.classes}
    return {
        "values": [0.5 if chosen[c] is None else float(chosen[c]) for c in model.classes],
        "chosen": chosen,
        "criterion": entry.get("criterion"),
        "n_val": entry.get("n_val") or {},
        "chosen_on": entry.get("chosen_on"),
        "note": "predict class c when prob_c >= values[c]; chosen on validation (chosen_on), 0.5 where none "
        "was chosen (null under 'chosen')",
    }


def preprocessing_spec(model: LoadedModel) -> dict:
    """The image pipeline of training (the sites' image stores) and evaluation, as the bundle applies it."""
    ds = model.dataset
    windows = [list(map(float, w)) for w in ds.get("ct_windows") or []] or None
    mode = ds.get("resize_mode", "area")
    return {
        "image_size": int(ds["image_size"]),
        "channels": int(ds["channels"]),
        "ct_windows": windows,
        "mean": ds.get("mean"),
        "std": ds.get("std"),
        "resize_mode": mode,
        "steps": [
            "decode: PNG / JPG 8-bit as stored, 16-bit (grey or colour) scaled by its significant bits to "
            "[0, 255]; DICOM CT -> Hounsfield units"
            + (f" -> CT windows {windows} (center, width) as channels" if windows else " -> min-max")
            + "; other DICOM -> Modality LUT -> VOI LUT / window (radiographs), MONOCHROME1 inverted, scaled by "
            "its range",
            f"resize to {ds['image_size']} x {ds['image_size']} ({mode}, Pillow) and round to uint8, "
            "as the sites' image stores hold them",
            f"channels: a grayscale image repeated to {ds['channels']}"
            + (", colour to its luma" if int(ds["channels"]) == 1 else ""),
            "divide by 255; normalise (x - mean) / std per channel"
            if ds.get("mean") or ds.get("std")
            else "divide by 255 (values in [0, 1])",
        ],
    }


def channel_names(pre: dict) -> dict[str, str]:
    if pre["ct_windows"]:
        names = {(40.0, 80.0): "brain", (80.0, 200.0): "subdural", (600.0, 2800.0): "bone"}
        return {
            str(i): f"{names.get(tuple(w), 'CT')} window (center {w[0]:g}, width {w[1]:g} HU)"
            for i, w in enumerate(pre["ct_windows"])
        }
    return {"0": "gray"} if pre["channels"] == 1 else {str(i): n for i, n in enumerate("RGB"[: pre["channels"]])}


def data_fingerprint(model: LoadedModel, results: dict) -> str:
    """sha256 of the dataset configuration and the federation's data record (per-site sizes, annotated classes,
    shared evaluation sets): what identifies the training data without any image leaving a site."""
    ds = {k: v for k, v in model.dataset.items() if k != "cache"}
    blob = json.dumps({"dataset": ds, "data": results.get("data")}, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def training_record(model: LoadedModel, results: dict) -> dict:
    """Provenance: job, method and options, rounds, sites (sizes, annotated classes), data fingerprint, privacy."""
    classes = model.classes
    sites = {
        s: {
            "n_train": i.get("n_train"),
            "n_val": i.get("n_val"),
            "n_test": i.get("n_test"),
            "annotated_classes": [classes[k] for k in i.get("annotated", []) if k < len(classes)],
        }
        for s, i in ((results.get("data") or {}).get("sites") or {}).items()
    }
    privacy = {
        s: {k: t.get(k) for k in ("scope", "min_count", "releases", "rounds", "epsilon", "delta")}
        for s, t in (results.get("privacy") or {}).items()
    }
    cfg = (
        json.loads((model.path.parent / "config" / "config_fed_client.json").read_text())
        if (model.path.parent / "config" / "config_fed_client.json").is_file()
        else {}
    )
    args = ((cfg.get("executors") or [{}])[0].get("executor") or {}).get("args") or {}
    return {
        "job": args.get("run_name") or model.path.parent.parent.name,
        "method": results.get("method"),
        "method_options": results.get("method_options"),
        "dataset": results.get("dataset"),
        "setting": results.get("setting"),
        "rounds": results.get("num_rounds"),
        "best_round": (results.get("best") or {}).get("trained_rounds"),
        "model_file": model.path.name,
        "architecture": model.net.arch,
        "sites": sites,
        "data_fingerprint": data_fingerprint(model, results),
        "privacy": privacy,
        "degraded": results.get("degraded"),
        "global_model_note": model.note,
        "site": model.site,
        "exported": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def final_result(model: LoadedModel, results: dict) -> dict:
    """``results.json``'s final evaluation of the exported model file (``{"test", "val", "per_site", ...}``); for a
    site's own model, that site's evaluation of it (``{"test", "val"}``: its own layers on the shared sets)."""
    final = ((results.get("final") or {}).get(model.path.name)) or {}
    if model.site is None:
        return final
    own = (final.get("per_site") or {}).get(model.site)
    if own is None and final.get("sites") == [model.site]:
        own = final
    return {k: v for k, v in (own or {}).items() if k in ("test", "val")}


def eval_metrics(final: dict) -> dict:
    test = final.get("test") or {}
    ci = (test.get("ci") or {}).get("auc") or {}
    return (
        {
            "split": "test",
            "n": test.get("n"),
            "macro": test.get("macro") or {},
            "per_class": test.get("per_class") or {},
            "auc_ci95": ci,
        }
        if test
        else {}
    )


def metadata(model: LoadedModel, results: dict, thresholds: dict, pre: dict) -> dict:
    """``configs/metadata.json``: MONAI's bundle metadata keys plus this model's thresholds and provenance."""
    import monai
    import PIL
    import pydicom

    task = "multi-label" if model.task == "multilabel" else "single-label"
    train = training_record(model, results)
    n_sites = len(train["sites"])
    classes = model.classes
    return {
        "schema": "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/"
        "meta_schema_20220324.json",
        "version": "0.1.0",
        "changelog": {"0.1.0": f"exported from job {train['job']} ({train['model_file']}, {train['rounds']} rounds)"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": np.__version__,
        "required_packages_version": {
            "pillow": PIL.__version__,
            "pydicom": pydicom.__version__,
            "pytorch-ignite": _version("pytorch-ignite"),
            "fire": _version("fire"),
        },
        "optional_packages_version": {"tqdm": _version("tqdm")},
        "name": train["job"] + (f" ({model.site}'s own model)" if model.site else ""),
        "task": f"{task} classification of {', '.join(classes)}",
        "description": f"{model.net.arch} trained with {train['method']} across {n_sites} sites with partial labels "
        f"({train['setting'] or 'see training'}); the model file is {train['model_file']}"
        + (f", with {model.site}'s own local layers." if model.site else "."),
        "authors": f"the {train['job']} federation ({n_sites} sites)",
        "copyright": "the federation's sites",
        "intended_use": "research; not validated for clinical decisions",
        "data_source": f"{train['dataset']} (per-site manifests; images never left the sites)",
        "data_type": "png, jpg, dicom",
        "image_classes": f"{pre['channels']} channel(s): {'; '.join(channel_names(pre).values())}",
        "pred_classes": f"{len(classes)} channels, one per class: {', '.join(classes)}",
        "network_data_format": {
            "inputs": {
                "image": {
                    "type": "image",
                    "format": "magnitude",
                    "modality": MODALITY.get(str(model.dataset.get("name")), "n/a"),
                    "num_channels": pre["channels"],
                    "spatial_shape": [pre["image_size"], pre["image_size"]],
                    "dtype": "float32",
                    "value_range": [] if pre["mean"] or pre["std"] else [0, 1],
                    "is_patch_data": False,
                    "channel_def": channel_names(pre),
                }
            },
            "outputs": {
                "pred": {
                    "type": "probabilities",
                    "format": "classes",
                    "modality": "n/a",
                    "num_channels": len(classes),
                    "spatial_shape": [],
                    "dtype": "float32",
                    "value_range": [],
                    "is_patch_data": False,
                    "channel_def": {str(i): c for i, c in enumerate(classes)},
                    "description": "logits; "
                    + ("sigmoid per class" if model.task == "multilabel" else "softmax")
                    + " gives the probabilities (configs/inference.json's postprocessing)",
                }
            },
        },
        "task_type": model.task,
        "thresholds": thresholds,
        "preprocessing": pre,
        "eval_metrics": eval_metrics(final_result(model, results)),
        "training": train,
    }


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def inference_config(model: LoadedModel, thresholds: dict, pre: dict) -> dict:
    """``configs/inference.json`` (MONAI config syntax)."""
    norm = []
    if pre["mean"] is not None or pre["std"] is not None:
        n = len(pre["mean"] if pre["mean"] is not None else pre["std"])
        norm = [
            {
                "_target_": "NormalizeIntensityd",
                "keys": "image",
                "channel_wise": True,
                "subtrahend": [float(m) for m in (pre["mean"] or [0.0] * n)],
                "divisor": [float(s) for s in (pre["std"] or [1.0] * n)],
            }
        ]
    typed = {
        "_target_": "EnsureTyped",
        "keys": "image",
        "data_type": "tensor",
        "dtype": "$torch.float32",
        "track_meta": False,
    }
    return {
        "imports": ["$import os"],
        "runtime": f"$__import__('{RUNTIME_MODULE}', fromlist=['PredictionWriter'])",
        "bundle_root": "$os.path.dirname(os.path.dirname(os.path.abspath(@runtime.__file__)))",
        "dataset_dir": "/workspace/data",
        "output_dir": "$@bundle_root + '/eval'",
        "device": "$torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')",
        "classes": model.classes,
        "task": model.task,
        "thresholds": thresholds.get("values"),
        "image_size": pre["image_size"],
        "channels": pre["channels"],
        "ct_windows": pre["ct_windows"],
        "batch_size": BATCH_SIZE,
        "datalist": "$@runtime.bundle_images(@dataset_dir)",
        "preprocessing": {
            "_target_": "Compose",
            "transforms": [
                {
                    "_target_": f"{RUNTIME_MODULE}.LoadImageAnyd",
                    "keys": "image",
                    "channels": "@channels",
                    "image_size": "@image_size",
                    "ct_windows": "@ct_windows",
                    "resize_mode": pre["resize_mode"],
                },
                typed,
                *([*norm, typed] if norm else []),
            ],
        },
        "dataset": {
            "_target_": "Dataset",
            "data": "$[{'image': p, 'path': p} for p in @datalist]",
            "transform": "@preprocessing",
        },
        "dataloader": {
            "_target_": "DataLoader",
            "dataset": "@dataset",
            "batch_size": "@batch_size",
            "shuffle": False,
            "num_workers": 0,
        },
        "network_def": "$torch.jit.load(@bundle_root + '/models/model.ts', map_location='cpu')",
        "network": "$@network_def.to(@device)",
        "inferer": {"_target_": "SimpleInferer"},
        "postprocessing": {
            "_target_": "Compose",
            "transforms": [
                {
                    "_target_": "Activationsd",
                    "keys": "pred",
                    "sigmoid": model.task == "multilabel",
                    "softmax": model.task != "multilabel",
                }
            ],
        },
        "handlers": [
            {
                "_target_": f"{RUNTIME_MODULE}.PredictionWriter",
                "output_dir": "@output_dir",
                "classes": "@classes",
                "task": "@task",
                "thresholds": "@thresholds",
            }
        ],
        "evaluator": {
            "_target_": "SupervisedEvaluator",
            "device": "@device",
            "val_data_loader": "@dataloader",
            "network": "@network",
            "inferer": "@inferer",
            "postprocessing": "@postprocessing",
            "val_handlers": "@handlers",
        },
        "run": ["$@evaluator.run()"],
    }


def trace(model: LoadedModel) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` of the model on CPU, checked against the model on a random batch (max abs 1e-5)."""
    net = model.net.to("cpu").eval()
    size = int(model.dataset["image_size"])
    x = torch.rand(2, int(model.dataset["channels"]), size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 prefers torch.export; MONAI runs .ts
        ts = torch.jit.trace(net, x[:1], check_trace=False)
        diff = float((ts(x) - net(x)).abs().max())
    if not diff <= 1e-5:
        raise RuntimeError(f"the traced model differs from the model by {diff:g} on a random batch")
    return ts


def export_onnx(model: LoadedModel, path: Path) -> None:
    try:
        import onnx  # noqa: F401 - torch's exporter needs it
    except ImportError:
        raise RuntimeError(
            "--onnx needs the onnx package: pip install onnx (or pip install 'fedpartial[onnx]')"
        ) from None
    size = int(model.dataset["image_size"])
    x = torch.rand(1, int(model.dataset["channels"]), size, size)
    with warnings.catch_warnings():  # torch's TorchScript-based exporter: only onnx needed (no onnxscript)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model.net.to("cpu").eval(),
            (x,),
            str(path),
            input_names=["image"],
            output_names=["logits"],
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
            dynamo=False,
        )


# ------------------------------------------------------------------------------------------------ the export


def export_bundle(
    run: str | Path,
    out: str | Path,
    which: str = "best",
    torchscript: bool = True,
    onnx: bool = False,
    job_config: str | Path | None = None,
    overwrite: bool = False,
    say=None,
    site: str | None = None,
) -> Path:
    """Write the bundle of ``run``'s global model (``site``: that site's own model, see
    :func:`fedpartial.tools.predict.load_model`) to ``out`` (see the module docstring). Returns ``out``.
    ``say``: called with a line per step (the command line prints them to stderr). ``overwrite`` (``--force``):
    an existing bundle of this tool has its own files replaced; every other file in it is kept (and named)."""
    say = say or (lambda line: None)
    out = Path(out)
    check_output(out, run, job_config, overwrite)
    model = load_model(run, which, job_config, site=site)
    found = [
        ("model file", model.path),
        ("site's model file", model.site_path),
        ("job configuration", model.config_dir),
    ]
    kept = check_output(out, None, None, overwrite, found)  # the files found from the run
    out.expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
    final, out = (
        out,
        Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.expanduser().resolve().parent)),
    )
    try:
        _write_bundle(model, out, torchscript, onnx, say)
        clash = [rel for rel in kept if (out / rel).exists() or (out / rel).is_symlink()]
        if clash:
            raise FileExistsError(
                f"-o {final} holds {', '.join(clash)}, which the bundle did not write and would now write: move "
                f"{'it' if len(clash) == 1 else 'them'} out of the bundle first"
            )
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    replace_folder(out, final.expanduser().resolve(), kept, say)
    if kept:
        say(f"kept {len(kept)} file(s) that are not the bundle's: {', '.join(kept)}")
    return final


def check_output(
    out: Path,
    run: str | Path | None,
    job_config: str | Path | None,
    overwrite: bool,
    found: list[tuple[str, Path | None]] = (),
) -> list[str]:
    """Refuse, before anything is read or written, an output folder that is the run, holds it or lies inside it
    (``--force`` would delete the run), that is or holds the job configuration or a file ``found`` from the run
    (``(what, path)``: the model file, a site's model file, the configuration folder), or that exists and is not
    empty without ``overwrite``; with ``overwrite``, one that is not a bundle of this tool (:func:`is_bundle`: a
    job folder, a run's checkpoints) or whose own files changed since the export (:func:`own_files`). Returns the
    files of an existing bundle that are not its own (a user's notes, the inference's ``eval/``): ``--force``
    keeps them."""
    target = out.expanduser().resolve()
    for what, path in (("run", run), ("job configuration", job_config), *found):
        if path is None:
            continue
        src = Path(path).expanduser().resolve()
        if target == src or target in src.parents:
            raise ValueError(
                f"-o {out} {'is' if target == src else 'holds'} the {what} {path}: the bundle would "
                "replace it; choose a folder outside the run"
            )
        if what == "run" and src.is_dir() and src in target.parents:
            raise ValueError(f"-o {out} lies inside the {what} {path}: choose a folder outside the run")
    if target.is_file():
        raise FileExistsError(f"-o {out} is a file, not a folder")
    if not (target.is_dir() and any(target.iterdir())):
        return []
    if not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --force to replace it)")
    if not is_bundle(target):
        raise FileExistsError(
            f"-o {out} is not a bundle of fedpartial-export (no configs/metadata.json with its training record): "
            "--force replaces only such a bundle; choose a new or empty folder"
        )
    own = own_files(target)
    changed = [rel for rel, digest in own.items() if _changed(target / rel, digest)]
    if changed:
        raise FileExistsError(
            f"-o {out}: {', '.join(changed)} changed since the export ({BUNDLE_MANIFEST} lists {'its' if len(changed) == 1 else 'their'} "
            "checksums): --force would replace your edit; move it out of the bundle, or export to another folder"
        )
    return [rel for rel in _entries(target) if rel not in own and rel != BUNDLE_MANIFEST and not _derived(rel)]


BUNDLE_PARTS = frozenset({"configs", "models", "docs", "scripts"})
"""The folders a bundle of this tool holds (everything it writes)."""
BUNDLE_MANIFEST = ".fedpartial-export.json"
"""The bundle's list of its own files (relative path -> sha256), written last: what ``--force`` replaces."""
LEGACY_FILES = (*BUNDLE_FILES, "models/model.onnx", *(f"docs/{name}" for name in FIGURE_NAMES.values()))
"""A bundle's own files by name, for a bundle written before :data:`BUNDLE_MANIFEST` existed."""


def is_bundle(folder: Path) -> bool:
    """Whether ``folder`` is a bundle this tool wrote: ``configs/metadata.json`` with MONAI's version and the
    training record, and ``models/``."""
    try:
        meta = json.loads((folder / "configs" / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "monai_version" in meta and "training" in meta and (folder / "models").is_dir()


def own_files(folder: Path) -> dict[str, str | None]:
    """The files the export wrote into the bundle ``folder``: ``{relative path: sha256}`` from its
    :data:`BUNDLE_MANIFEST`; a bundle without one (written before it existed): the :data:`LEGACY_FILES` it holds,
    ``{path: None}`` (no checksum to compare)."""
    try:
        listed = json.loads((folder / BUNDLE_MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {rel: None for rel in LEGACY_FILES if (folder / rel).is_file()}
    return {str(rel): str(digest) for rel, digest in dict(listed).items() if _inside(folder, rel)}


def _inside(folder: Path, rel: str) -> bool:
    """A listed path that stays inside the bundle (a hand-edited list never names a file elsewhere)."""
    return not Path(rel).is_absolute() and ".." not in Path(rel).parts and bool(rel)


def _changed(path: Path, digest: str | None) -> bool:
    """Whether a file the export wrote was changed since (another file, a link or a folder in its place); a file
    that is gone is no change (nothing of the user's to keep)."""
    if not (path.exists() or path.is_symlink()):
        return False
    if path.is_symlink() or not path.is_file():
        return True
    return digest is not None and file_sha256(path) != digest


def _derived(rel: str) -> bool:
    """What running the bundle leaves in it (Python's ``__pycache__`` of ``scripts/``): the export's own."""
    return "__pycache__" in Path(rel).parts


def _entries(folder: Path) -> list[str]:
    """Every file, link and empty folder under ``folder`` (not following links), as sorted relative paths."""
    out = []
    for root, dirs, files in os.walk(folder):
        base = Path(root)
        for d in dirs:
            if (base / d).is_symlink():
                out.append((base / d).relative_to(folder).as_posix())
        if not dirs and not files and base != folder:
            out.append(base.relative_to(folder).as_posix())
        out += [(base / f).relative_to(folder).as_posix() for f in files]
    return sorted(out)


def replace_folder(new: Path, target: Path, keep: list[str] = (), say=None) -> Path:
    """Move the finished folder ``new`` to ``target``; ``keep``: files of an existing ``target`` (relative paths)
    moved into ``new`` first. An existing ``target`` is set aside and removed only once ``new`` is in its place
    (a failure in between puts it and the kept files back), and only when nothing but the bundle's own files is
    left in it (else it stays, named). Returns ``target``."""
    say = say or (lambda line: None)
    old, moved = None, []
    try:
        for rel in keep:
            dst = new / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(target / rel, dst)
            moved.append(rel)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=new.parent))
            os.rmdir(old)
            os.replace(target, old)
        os.replace(new, target)
    except BaseException:
        if old is not None and old.exists() and not target.exists():
            os.replace(old, target)
        for rel in reversed(moved):
            os.replace(new / rel, target / rel)
        raise
    if old is not None:
        own = own_files(old)
        left = [rel for rel in _entries(old) if rel not in own and rel != BUNDLE_MANIFEST and not _derived(rel)]
        left = [rel for rel in left if (old / rel).is_symlink() or not (old / rel).is_dir()]  # emptied folders go
        if left:
            say(
                f"note: {old} holds {', '.join(left[:5])}{', ...' if len(left) > 5 else ''} (not the bundle's): left there"
            )
        else:
            shutil.rmtree(old, ignore_errors=True)
    return target


def _write_bundle(model, out: Path, torchscript: bool, onnx: bool, say) -> None:
    """The bundle's files, written into the (new, empty) folder ``out``."""
    say(f"model {model.path} ({model.net.arch}, {model.task}, {len(model.classes)} classes)")
    if model.note:
        say(f"note: {model.note}")
    results = run_results(model)
    if model.site and results and not final_result(model, results):
        scored = sorted((((results.get("final") or {}).get(model.path.name) or {}).get("per_site")) or {})
        say(
            f"note: the run's results.json has no final evaluation by {model.site!r} (its sites: {scored}): the "
            "bundle's eval_metrics and model card have no test metrics"
        )
    thresholds = bundle_thresholds(model)
    pre = preprocessing_spec(model)
    for d in sorted(BUNDLE_PARTS):
        (out / d).mkdir(parents=True, exist_ok=True)
    torch.save(model.net.state_dict(), out / "models" / "model.pt")
    meta = metadata(model, results, thresholds, pre)
    (out / "configs" / "metadata.json").write_text(json.dumps(meta, indent=2, default=_json_default))
    say("configs/metadata.json, models/model.pt")
    if torchscript:
        say("models/model.ts (traced, checked against the model), configs/inference.json, scripts/image_io.py")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(trace(model), str(out / "models" / "model.ts"))
        (out / "scripts" / "__init__.py").write_text('"""The bundle\'s own code (MONAI bundles\' scripts/)."""\n')
        (out / "scripts" / "image_io.py").write_text(runtime_source())
        (out / "configs" / "inference.json").write_text(json.dumps(inference_config(model, thresholds, pre), indent=2))
    if onnx:
        say("models/model.onnx")
        export_onnx(model, out / "models" / "model.onnx")

    say("docs/README.md (model card) and its figures")
    own = final_result(model, results)
    if model.site and results:  # the card's figures from the site's own evaluation, not from the pooled one
        results = {**results, "final": {model.path.name: {**own, "sites": [model.site]}}}
    write_model_card(out, meta, own, results)
    files = {p.relative_to(out).as_posix(): file_sha256(p) for p in sorted(out.rglob("*")) if p.is_file()}
    (out / BUNDLE_MANIFEST).write_text(
        json.dumps({"format": 1, "written_by": "fedpartial-export", "files": files}, indent=1) + "\n"
    )


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fedpartial-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run", help="simulator workspace, downloaded job result, run folder or model .pt file")
    ap.add_argument("-o", "--out", required=True, help="the bundle's folder (created)")
    ap.add_argument(
        "--model",
        default="best",
        choices=["best", "last"],
        help="best validation round (default, falls back to last) or the last global model",
    )
    ap.add_argument(
        "--torchscript",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="models/model.ts and configs/inference.json (default; --no-torchscript: weights, metadata "
        "and model card only)",
    )
    ap.add_argument("--onnx", action="store_true", help="also models/model.onnx (needs: pip install onnx)")
    ap.add_argument("--job-config", help="folder with the job's config_fed_server/client.json (default: the run's)")
    ap.add_argument(
        "--site",
        help="a site's own model (methods keeping layers local: FedBN, PFL, ...): a site of a "
        "simulator workspace, or the site's fedpartial_state/last_local_model.pt",
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="replace the files of an existing bundle of this tool (its .fedpartial-export.json lists them); "
        "every other file in it is kept and named; another folder is refused",
    )
    a = ap.parse_args(argv)
    try:
        out = export_bundle(
            a.run,
            a.out,
            a.model,
            a.torchscript,
            a.onnx,
            a.job_config,
            a.force,
            say=lambda line: print(f"fedpartial-export: {line}", file=sys.stderr, flush=True),
            site=a.site,
        )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"fedpartial-export: error: {e}", file=sys.stderr)
        return 2
    print(f"bundle written to {out}")
    if a.torchscript:
        print(
            f"run it: python -m monai.bundle run --config_file {out}/configs/inference.json "
            f"--dataset_dir IMAGES --output_dir OUT"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
