"""Start a new job: write ``<folder>/job.py`` (the job's recipe, :mod:`fedpartial.recipes`) for a method and a
dataset preset, and export it next to it::

    python -m fedpartial.tools.new_job jobs/fedavg_pl_ich --method fedavg_pl --dataset ich_phantom --sites 5

``job.py`` is the job's one source: edit it, then ``make jobs`` re-exports ``meta.json``,
``app/config/config_fed_{server,client}.json`` and ``app/custom`` (build outputs). This module also holds the
configuration layout the recipes build (:func:`server_config`, :func:`client_config`).

Every job tolerates a dead, slow or failing site (:func:`harden`): ``max_missing_sites`` (``--max-missing``;
default 1 with 3 or more sites) may be absent from the data check and from any round (the workflow aggregates
once ``min_clients - max_missing_sites`` sites answered), training tasks time out (``train_timeout``), the data
check and the cross-site evaluation have real timeouts, and the aggregator bounds each update's change relative
to the model's last global step (and refuses a reversed one). Existing job folders are brought to the same settings with::

    python -m fedpartial.tools.new_job --harden jobs/*
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..data.presets import resolve_dataset

PT = "nvflare.app_opt.pt"
WF = "nvflare.app_common.workflows"

# timeouts (seconds): a normal round of the shipped jobs takes seconds (phantoms, small CNN) to a few minutes
# (DenseNet-121 on real images, one local epoch); a site silent for an hour is treated as dead for that round
TRAIN_TIMEOUT = 3600
WAIT_AFTER_MIN = 30  # once all but max_missing sites answered, wait this long for the rest
DATA_CHECK_TIMEOUT = 900  # reading + checking every manifest row and image header
SUBMIT_MODEL_TIMEOUT = 300
VALIDATION_TIMEOUT = 1800
MAX_CHANGE_RATIO = 25.0


def default_max_missing(num_sites: int) -> int:
    """Sites that may be missing by default: 1 with 3 or more sites, else 0 (two sites cannot lose one)."""
    return 1 if num_sites >= 3 else 0


def harden(cfg: dict, max_missing: int) -> dict:
    """Set the reliability settings on a server config in place (idempotent): ``max_missing_sites``, the data
    check's timeout and tolerance, ``train_timeout`` / ``wait_time_after_min_received`` / ``max_missing`` on the
    training workflow, the cross-site evaluation timeouts and the aggregator's update bound (existing aggregator
    bound settings are kept). Returns ``cfg``."""
    n = cfg.get("min_clients")
    if isinstance(n, int) and not 0 <= max_missing < n:
        raise ValueError(f"max_missing must be in [0, {n}) for a job of {n} sites, got {max_missing}")
    cfg["max_missing_sites"] = int(max_missing)
    for comp in cfg.get("components", []):
        path, args = comp.get("path", ""), comp.setdefault("args", {})
        if path.endswith("PartialLabelAggregator"):
            args.setdefault("max_change_ratio", MAX_CHANGE_RATIO)
            args.setdefault("on_large_change", "reject")
        elif path.endswith("DataSummaryProcessor"):
            args["max_missing"] = "{max_missing_sites}"
    for wf in cfg.get("workflows", []):
        path, args = wf.get("path", ""), wf.setdefault("args", {})
        if path.endswith("BroadcastAndProcess") and args.get("task_name") == "data_summary":
            args["timeout"] = DATA_CHECK_TIMEOUT
        elif path.endswith("ScatterAndGather"):
            args.update({"max_missing": "{max_missing_sites}", "train_timeout": TRAIN_TIMEOUT,
                         "wait_time_after_min_received": WAIT_AFTER_MIN})
        elif path.endswith(("CrossSiteModelEval", "CrossSiteEval")):
            args.update({"submit_model_timeout": SUBMIT_MODEL_TIMEOUT, "validation_timeout": VALIDATION_TIMEOUT})
    return cfg


MIN_COUNT = 5
CLIENT_RESULT_FILTERS = [{"tasks": ["train"], "filters": [
    {"path": "fedpartial.fl.data_check.MinCountFilter", "args": {"min_count": MIN_COUNT}}]}]


def harden_client(cfg: dict) -> dict:
    """Add the site's :class:`~fedpartial.fl.data_check.MinCountFilter` to a client config (in place, idempotent)."""
    filters = cfg.setdefault("task_result_filters", [])
    if not any(f.get("path", "").endswith("MinCountFilter") for e in filters for f in e.get("filters", [])):
        filters.extend(json.loads(json.dumps(CLIENT_RESULT_FILTERS)))
    return cfg


def training_entries(cfg: dict) -> list[dict]:
    """The entries of a server or client config that take the checkpoint / resume arguments: the training
    workflow (``ScatterAndGather``) and the site executor (``PartialLabelExecutor``)."""
    entries = cfg.get("workflows", []) + [e.get("executor", {}) for e in cfg.get("executors", [])]
    return [e for e in entries if e.get("path", "").endswith(("ScatterAndGather", "PartialLabelExecutor"))]


def set_run_name(cfg: dict, name: str) -> dict:
    """Name the run's checkpoint folder after the job (server workflow and site executor, in place, kept when
    already set): a resumed job finds the checkpoints of the job of the same name (:mod:`fedpartial.fl.checkpoint`)."""
    for entry in training_entries(cfg):
        entry.setdefault("args", {}).setdefault("run_name", name)
    return cfg


def harden_job(folder: str | Path, max_missing: int | None = None) -> Path:
    """:func:`harden` a job folder's ``config_fed_server.json`` files (``max_missing``: the folder's own value,
    else :func:`default_max_missing` of its ``min_clients``)."""
    folder = Path(folder)
    for path in sorted(folder.glob("*/config/config_fed_server.json")):
        cfg = json.loads(path.read_text())
        k = max_missing if max_missing is not None else cfg.get("max_missing_sites",
                                                                  default_max_missing(int(cfg.get("min_clients", 0))))
        _rewrite(path, set_run_name(harden(cfg, int(k)), folder.name))
    for path in sorted(folder.glob("*/config/config_fed_client.json")):
        _rewrite(path, set_run_name(harden_client(json.loads(path.read_text())), folder.name))
    return folder


def _rewrite(path: Path, cfg: dict) -> None:
    """Write ``cfg`` to ``path`` unless the file already holds it (a hardened folder stays untouched)."""
    if json.loads(path.read_text()) != cfg:
        path.write_text(json.dumps(cfg, indent=2) + "\n")


def server_config(method: str, dataset: dict, model: dict, num_rounds: int, min_clients: int,
                  method_args: dict, key_metric: str = "auc", max_missing: int | None = None) -> dict:
    ds = resolve_dataset(dataset)
    if max_missing is None:
        max_missing = default_max_missing(min_clients)
    return harden({
        "format_version": 2, "num_rounds": num_rounds, "min_clients": min_clients, "method": method,
        "server": {"task_request_interval": 0.1},
        "task_data_filters": [{"tasks": ["train", "validate"], "filters": [
            {"path": "fedpartial.fl.data_check.SummaryFilter", "args": {"summary_id": "data_summary"}}]}],
        "task_result_filters": [],
        "components": [
            {"id": "model", "path": "fedpartial.models.PartialLabelNet",
             "args": {**model, "num_classes": len(ds["classes"])}},
            {"id": "persistor", "path": f"{PT}.file_model_persistor.PTFileModelPersistor", "args": {"model": "model"}},
            {"id": "shareable_generator", "args": {},
             "path": "nvflare.app_common.shareablegenerators.full_model_shareable_generator.FullModelShareableGenerator"},
            {"id": "aggregator", "path": "fedpartial.fl.aggregator.PartialLabelAggregator",
             "args": {"method": "{method}", "method_args": method_args}},
            {"id": "data_summary", "path": "fedpartial.fl.data_check.DataSummaryProcessor",
             "args": {"classes": ds["classes"]}},
            {"id": "model_selector", "path": "fedpartial.fl.selection.ModelSelector",
             "args": {"key_metric": key_metric}},
            {"id": "model_locator", "path": f"{PT}.file_model_locator.PTFileModelLocator",
             "args": {"pt_persistor_id": "persistor"}},
            {"id": "results", "path": "fedpartial.fl.results.ResultsRecorder",
             "args": {"key_metric": key_metric, "method": "{method}", "dataset": ds["name"]}},
            {"id": "tb_receiver", "path": "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
             "args": {"events": ["fed.analytix_log_stats"]}},
        ],
        "workflows": [
            {"id": "data_check", "path": f"{WF}.broadcast_and_process.BroadcastAndProcess",
             "args": {"processor": "data_summary", "task_name": "data_summary", "timeout": 0}},
            {"id": "scatter_and_gather", "path": "fedpartial.fl.selection.ScatterAndGather",
             "args": {"min_clients": "{min_clients}", "num_rounds": "{num_rounds}", "wait_time_after_min_received": 0,
                      "aggregator_id": "aggregator", "persistor_id": "persistor",
                      "shareable_generator_id": "shareable_generator", "train_task_name": "train",
                      "train_timeout": 0}},
            {"id": "cross_site_validate", "path": "fedpartial.fl.selection.CrossSiteEval",
             "args": {"model_locator_id": "model_locator", "submit_model_task_name": ""}},
        ],
    }, max_missing)


def client_config(method: str, dataset: dict, model: dict, train: dict, evaluation: dict, method_args: dict,
                  seed: int = 0) -> dict:
    return {
        "format_version": 2, "method": method,
        "executors": [{"tasks": ["data_summary", "train", "validate", "submit_model"], "executor": {
            "id": "executor", "path": "fedpartial.fl.executor.PartialLabelExecutor",
            "args": {"method": "{method}", "method_args": method_args, "dataset": dataset, "model": model,
                     "train": train, "evaluation": evaluation, "seed": seed}}}],
        "task_result_filters": CLIENT_RESULT_FILTERS, "task_data_filters": [],
        "components": [{"id": "event_to_fed", "path": "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
                        "args": {"events_to_convert": ["analytix_log_stats"], "fed_event_prefix": "fed."}}],
    }


NAMED_RECIPES = {"fedmlp": "FedMLPRecipe", "fedlsm": "FedLSMRecipe", "fedirm": "FedIRMRecipe",
                 "surgical": "SurgicalRecipe"}


def _literal(v) -> str:
    """A Python literal of a JSON-like value (double-quoted strings)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    return json.dumps(v) if isinstance(v, str) else repr(v)


def _wrapped(v, indent: int) -> str:
    """:func:`_literal`, a long dict one key per line and a long list packed into lines of at most 112 chars."""
    one = _literal(v)
    if len(one) + indent <= 100 or not isinstance(v, (dict, list)):
        return one
    pad = " " * (indent + 4)
    if isinstance(v, dict):
        return "{\n" + "".join(f"{pad}{_literal(k)}: {_wrapped(x, indent + 4)},\n" for k, x in v.items()) \
            + " " * indent + "}"
    rows, cur = [], ""
    for x in v:
        item = _literal(x) + ","
        if cur and len(pad) + len(cur) + len(item) + 1 > 112:
            rows, cur = rows + [cur], item
        else:
            cur = f"{cur} {item}" if cur else item
    return "[\n" + "".join(f"{pad}{r}\n" for r in rows + [cur]) + " " * indent + "]"


def job_py_text(name: str, method: str, title: str, **kwargs) -> str:
    """The text of a ``jobs/<name>/job.py``: its ``JOB`` keyword arguments and the recipe (a named recipe for the
    four papers' methods, whose options are keywords; else :class:`PartialLabelRecipe` with ``method_args``)."""
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
    lines = ['"""' + head, "", f"Run: ``python jobs/{name}/job.py`` (``--help``: rounds, sites, data, export).",
             '"""', "", f"from fedpartial.recipes import {cls}, job_main", "", "JOB = dict("]
    lines += [f"    {k}={_wrapped(v, 4)}," for k, v in kw.items()]
    lines += [")", "", "", f"def recipe(**overrides) -> {cls}:",
              f'    """The job\'s recipe (``overrides``: any {cls} keyword, e.g. ``num_rounds=2``)."""',
              f"    return {cls}(**{{**JOB, **overrides}})", "", "", 'if __name__ == "__main__":', "    job_main(recipe)", ""]
    return "\n".join(lines)


def write_job(folder: str | Path, method: str, dataset: dict, num_sites: int, num_rounds: int = 20,
              model: dict | None = None, train: dict | None = None, evaluation: dict | None = None,
              method_args: dict | None = None, seed: int = 0, max_missing: int | None = None,
              job_py: bool = False) -> Path:
    """Export the job of these arguments (:class:`fedpartial.recipes.PartialLabelRecipe`) into ``folder``
    (checked first: nothing is written for a bad option); with ``job_py`` also write its ``job.py``."""
    from ..recipes import PartialLabelRecipe

    folder = Path(folder)
    kwargs = {k: v for k, v in dict(num_rounds=num_rounds, model=model, train=train, evaluation=evaluation,
                                    method_args=method_args, seed=seed or None,
                                    max_missing=max_missing).items() if v is not None}
    dataset = dataset["preset"] if isinstance(dataset, dict) and list(dataset) == ["preset"] else dataset
    recipe = PartialLabelRecipe(name=folder.name, method=method, dataset=dataset, num_sites=num_sites, **kwargs)
    recipe.export(str(folder.parent))
    if job_py:
        (folder / "job.py").write_text(job_py_text(folder.name, method, f"{method} on {folder.name}",
                                                   dataset=dataset, num_sites=num_sites, **kwargs))
    return folder


def main(argv=None) -> int:
    argv = list(__import__("sys").argv[1:] if argv is None else argv)
    if argv and argv[0] == "--harden":
        hp = argparse.ArgumentParser(prog="new_job --harden", description="apply the reliability settings to job folders")
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
    ap.add_argument("--dataset", required=True, help="preset name or a JSON dataset config")
    ap.add_argument("--sites", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--max-missing", type=int, default=None,
                    help="sites that may be missing from the data check or a round (default 1 with >= 3 sites)")
    ap.add_argument("--method-args", default="{}", help="JSON")
    ap.add_argument("--train", default=None, help="JSON training options")
    ap.add_argument("--model", default=None, help="JSON model options")
    a = ap.parse_args(argv)
    dataset = json.loads(a.dataset) if a.dataset.strip().startswith("{") else {"preset": a.dataset}
    write_job(a.folder, a.method, dataset, a.sites, a.rounds, json.loads(a.model) if a.model else None,
              json.loads(a.train) if a.train else None, None, json.loads(a.method_args), max_missing=a.max_missing,
              job_py=True)
    print(f"wrote {a.folder}/job.py and exported it there (edit job.py, then `make jobs`)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
