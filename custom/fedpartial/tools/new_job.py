"""Start a new job: write ``<folder>/job.py`` (the job's recipe, :mod:`fedpartial.recipes`) for a method and a
dataset preset, and export it next to it::

    python -m fedpartial.tools.new_job jobs/fedavg_pl_ich --method fedavg_pl --dataset ich_phantom --sites 5

A federation with its own class names and task (its sites bring their data)::

    python -m fedpartial.tools.new_job jobs/derm_consortium --method fedavg_pl --dataset derm_consortium \
        --classes MEL NV BCC AKIEC BKL DF VASC --task multiclass --channels 3 --sites 3

``job.py`` is the job's one source: edit it, then ``make jobs`` re-exports ``meta.json``,
``app/config/config_fed_{server,client}.json`` and ``app/custom`` (build outputs). The configuration layout
itself is the recipe's (:mod:`fedpartial.job_layout`); this tool only writes the ``job.py``.

Existing exported folders (not made by ``make jobs``) are brought to the reliability settings of
:func:`fedpartial.job_layout.harden` with::

    python -m fedpartial.tools.new_job --harden jobs/*
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..data.presets import PRESETS
from ..job_layout import harden_job
from .build_jobs import export_job

LINE_LENGTH = 120  # pyproject.toml [tool.ruff]
NAMED_RECIPES = {
    "fedmlp": "FedMLPRecipe",
    "fedlsm": "FedLSMRecipe",
    "fedirm": "FedIRMRecipe",
    "surgical": "SurgicalRecipe",
}


def _literal(v) -> str:
    """A Python literal of a JSON-like value (double-quoted strings)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def _wrapped(v, indent: int) -> str:
    """:func:`_literal`, or, for a long dict / list, one entry per line with a trailing comma (the formatter's
    layout: ``ruff format`` leaves a written ``job.py`` as it is)."""
    one = _literal(v)
    if len(one) + indent <= 100 or not isinstance(v, (dict, list)) or not v:
        return one
    pad = " " * (indent + 4)
    if isinstance(v, dict):
        rows = [f"{_literal(k)}: {_wrapped(x, indent + 4)}" for k, x in v.items()]
        return "{\n" + "".join(f"{pad}{r},\n" for r in rows) + " " * indent + "}"
    return "[\n" + "".join(f"{pad}{_wrapped(x, indent + 4)},\n" for x in v) + " " * indent + "]"


def job_py_text(name: str, method: str, title: str, **kwargs) -> str:
    """The text of a ``jobs/<name>/job.py``: ``recipe``, the recipe class with the job's keyword arguments bound
    (``functools.partial``: ``recipe(num_rounds=2)`` overrides one); a named recipe for the four papers' methods,
    whose options are keywords, else :class:`PartialLabelRecipe` with ``method_args``. Settings a results table's
    jobs share go to :mod:`fedpartial.table_settings` by hand."""
    import textwrap

    cls = NAMED_RECIPES.get(method, "PartialLabelRecipe")
    kw = {"name": name} if cls != "PartialLabelRecipe" else {"name": name, "method": method}
    method_args = kwargs.pop("method_args", None) or {}
    kw.update(kwargs)
    if cls != "PartialLabelRecipe":
        kw.update(method_args)
    elif method_args:
        kw["method_args"] = method_args
    head = textwrap.fill(f"{title} (README.md).", 113)
    call = f"recipe = partial({cls}, " + ", ".join(f"{k}={_literal(v)}" for k, v in kw.items()) + ")"
    if len(call) > LINE_LENGTH:  # one argument per line, as the formatter writes it
        call = f"recipe = partial(\n    {cls},\n" + "".join(f"    {k}={_wrapped(v, 4)},\n" for k, v in kw.items()) + ")"
    lines = [
        '"""' + head,
        "",
        f"Run: ``python jobs/{name}/job.py`` (``--help``: rounds, sites, GPUs, data, export).",
        '"""',
        "",
        "from functools import partial",
        "",
        f"from fedpartial.recipes import {cls}, job_main",
        "",
        call,
        "",
        'if __name__ == "__main__":',
        "    job_main(recipe)",
        "",
    ]
    return "\n".join(lines)


def write_job(
    folder: str | Path,
    method: str,
    dataset: dict,
    num_sites: int,
    num_rounds: int = 20,
    model: dict | None = None,
    train: dict | None = None,
    evaluation: dict | None = None,
    method_args: dict | None = None,
    seed: int = 0,
    max_missing: int | None = None,
    job_py: bool = False,
) -> Path:
    """Export the job of these arguments (:class:`fedpartial.recipes.PartialLabelRecipe`) into ``folder``
    (checked first: nothing is written for a bad option); with ``job_py`` write its ``job.py`` and export that
    (``make jobs`` does the same later)."""
    from ..recipes import PartialLabelRecipe  # imported where used: loads NVFlare's Job API

    folder = Path(folder)
    kwargs = {
        k: v
        for k, v in dict(
            num_rounds=num_rounds,
            model=model,
            train=train,
            evaluation=evaluation,
            method_args=method_args,
            seed=seed or None,
            max_missing=max_missing,
        ).items()
        if v is not None
    }
    dataset = dataset["preset"] if isinstance(dataset, dict) and list(dataset) == ["preset"] else dataset
    recipe = PartialLabelRecipe(name=folder.name, method=method, dataset=dataset, num_sites=num_sites, **kwargs)
    if not job_py:
        return recipe.export(str(folder.parent))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.py").write_text(
        job_py_text(folder.name, method, f"{method} on {folder.name}", dataset=dataset, num_sites=num_sites, **kwargs)
    )
    return export_job(folder)


def dataset_arg(
    dataset: str,
    classes: list[str] | None = None,
    task: str | None = None,
    channels: int | None = None,
    image_size: int | None = None,
) -> dict:
    """``new_job``'s dataset: a JSON config, a preset (``--classes`` / ``--task`` / ... override it), or a
    federation's own dataset by name (``--classes``, ``--task`` and ``--channels`` required)."""
    if dataset.strip().startswith("{"):
        return json.loads(dataset)
    own = {
        "classes": [c for item in classes for c in item.split(",") if c] if classes else None,
        "task": task,
        "channels": channels,
        "image_size": image_size,
    }
    own = {k: v for k, v in own.items() if v is not None}
    if dataset in PRESETS:
        return {"preset": dataset, **own}
    missing = [f"--{k}" for k in ("classes", "task", "channels") if k not in own]
    if missing:
        raise ValueError(
            f"--dataset {dataset!r} is no preset ({', '.join(sorted(PRESETS))}); a federation's own "
            f"dataset needs {', '.join(missing)}"
        )
    return {"name": dataset, "image_size": 64, **own}


def main(argv=None) -> int:
    argv = list(__import__("sys").argv[1:] if argv is None else argv)
    if argv and argv[0] == "--harden":
        hp = argparse.ArgumentParser(
            prog="new_job --harden", description="apply the reliability settings to job folders"
        )
        hp.add_argument("folders", nargs="+")
        hp.add_argument("--max-missing", type=int, default=None)
        h = hp.parse_args(argv[1:])
        for f in h.folders:
            if list(Path(f).glob("*/config/config_fed_server.json")):
                print(f"hardened {harden_job(f, h.max_missing)}")
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--method", required=True)
    ap.add_argument(
        "--dataset",
        required=True,
        help="a preset name, a JSON dataset config, or the name of a federation's own dataset (then "
        "--classes, --task and --channels say what it is; its sites bring their data: "
        "local/fedpartial_data.json, or job.py --site-data in the simulator)",
    )
    ap.add_argument("--classes", nargs="+", help="the federation's classes, in order (space or comma separated)")
    ap.add_argument("--task", choices=("multilabel", "multiclass"), help="the federation's task")
    ap.add_argument("--channels", type=int, help="image channels the model sees (1 grayscale, 3 colour)")
    ap.add_argument("--image-size", type=int, help="image side the sites resize to (default: the preset's, else 64)")
    ap.add_argument("--sites", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--max-missing",
        type=int,
        default=None,
        help="sites that may be missing from the data check or a round (default 1 with >= 3 sites)",
    )
    ap.add_argument("--method-args", default="{}", help="JSON")
    ap.add_argument("--train", default=None, help="JSON training options")
    ap.add_argument("--model", default=None, help="JSON model options")
    a = ap.parse_args(argv)
    try:
        dataset = dataset_arg(a.dataset, a.classes, a.task, a.channels, a.image_size)
    except ValueError as e:
        ap.error(str(e))
    write_job(
        a.folder,
        a.method,
        dataset,
        a.sites,
        a.rounds,
        json.loads(a.model) if a.model else None,
        json.loads(a.train) if a.train else None,
        None,
        json.loads(a.method_args),
        max_missing=a.max_missing,
        job_py=True,
    )
    print(f"wrote {a.folder}/job.py and exported it there (edit job.py, then `make jobs`)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
