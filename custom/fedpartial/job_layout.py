"""The bundle's job layout: the server and client configurations every recipe builds
(:func:`server_config`, :func:`client_config`), in NVFlare's config format with the job-level values
(``num_rounds``, ``min_clients``, ``method``, ``max_missing_sites``) as top-level variables the components refer to.

Every job tolerates a dead, slow or failing site (:func:`harden`): ``max_missing_sites`` (default 1 with 3 or more
sites) may be absent from the data check and from any round (the workflow aggregates once
``min_clients - max_missing_sites`` sites answered), training tasks time out (``train_timeout``), the data check and
the cross-site evaluation have real timeouts, and the aggregator bounds each update's change relative to the model's
last global step (and refuses a reversed one). :func:`harden_job` brings an existing exported folder to the same
settings (``python -m fedpartial.tools.new_job --harden jobs/*``).

:mod:`fedpartial.recipes` builds an NVFlare ``FedJob`` from these configurations; nothing here imports NVFlare.
"""

from __future__ import annotations

import json
from pathlib import Path

from .data.presets import resolve_dataset

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
            args.update(
                {
                    "max_missing": "{max_missing_sites}",
                    "train_timeout": TRAIN_TIMEOUT,
                    "wait_time_after_min_received": WAIT_AFTER_MIN,
                }
            )
        elif path.endswith(("CrossSiteModelEval", "CrossSiteEval")):
            args.update({"submit_model_timeout": SUBMIT_MODEL_TIMEOUT, "validation_timeout": VALIDATION_TIMEOUT})
    return cfg


MIN_COUNT = 5
CLIENT_RESULT_FILTERS = [
    {
        "tasks": ["train"],
        "filters": [{"path": "fedpartial.fl.data_check.MinCountFilter", "args": {"min_count": MIN_COUNT}}],
    }
]


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
        k = (
            max_missing
            if max_missing is not None
            else cfg.get("max_missing_sites", default_max_missing(int(cfg.get("min_clients", 0))))
        )
        _rewrite(path, set_run_name(harden(cfg, int(k)), folder.name))
    for path in sorted(folder.glob("*/config/config_fed_client.json")):
        _rewrite(path, set_run_name(harden_client(json.loads(path.read_text())), folder.name))
    return folder


def _rewrite(path: Path, cfg: dict) -> None:
    """Write ``cfg`` to ``path`` unless the file already holds it (a hardened folder stays untouched)."""
    if json.loads(path.read_text()) != cfg:
        path.write_text(json.dumps(cfg, indent=2) + "\n")


def server_config(
    method: str,
    dataset: dict,
    model: dict,
    num_rounds: int,
    min_clients: int,
    method_args: dict,
    key_metric: str = "auc",
    max_missing: int | None = None,
) -> dict:
    """The server configuration of a job: the initial model, persistor, the method's aggregator, the data check
    (``DataSummaryProcessor`` + ``BroadcastAndProcess``), ``ScatterAndGather``, cross-site evaluation, the model
    selector and the results recorder, with the job-level values as ``"{var}"`` references, :func:`harden`-ed
    (``min_clients``: the job's number of sites)."""
    ds = resolve_dataset(dataset)
    if max_missing is None:
        max_missing = default_max_missing(min_clients)
    return harden(
        {
            "format_version": 2,
            "num_rounds": num_rounds,
            "min_clients": min_clients,
            "method": method,
            "server": {"task_request_interval": 0.1},
            "task_data_filters": [
                {
                    "tasks": ["train", "validate"],
                    "filters": [
                        {"path": "fedpartial.fl.data_check.SummaryFilter", "args": {"summary_id": "data_summary"}}
                    ],
                }
            ],
            "task_result_filters": [],
            "components": [
                {
                    "id": "model",
                    "path": "fedpartial.models.PartialLabelNet",
                    "args": {**model, "num_classes": len(ds["classes"])},
                },
                {
                    "id": "persistor",
                    "path": f"{PT}.file_model_persistor.PTFileModelPersistor",
                    "args": {"model": "model"},
                },
                {
                    "id": "shareable_generator",
                    "args": {},
                    "path": "nvflare.app_common.shareablegenerators.full_model_shareable_generator.FullModelShareableGenerator",
                },
                {
                    "id": "aggregator",
                    "path": "fedpartial.fl.aggregator.PartialLabelAggregator",
                    "args": {"method": "{method}", "method_args": method_args},
                },
                {
                    "id": "data_summary",
                    "path": "fedpartial.fl.data_check.DataSummaryProcessor",
                    "args": {"classes": ds["classes"]},
                },
                {
                    "id": "model_selector",
                    "path": "fedpartial.fl.selection.ModelSelector",
                    "args": {"key_metric": key_metric},
                },
                {
                    "id": "model_locator",
                    "path": f"{PT}.file_model_locator.PTFileModelLocator",
                    "args": {"pt_persistor_id": "persistor"},
                },
                {
                    "id": "results",
                    "path": "fedpartial.fl.results.ResultsRecorder",
                    "args": {"key_metric": key_metric, "method": "{method}", "dataset": ds["name"]},
                },
                {
                    "id": "tb_receiver",
                    "path": "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
                    "args": {"events": ["fed.analytix_log_stats"]},
                },
            ],
            "workflows": [
                {
                    "id": "data_check",
                    "path": f"{WF}.broadcast_and_process.BroadcastAndProcess",
                    "args": {"processor": "data_summary", "task_name": "data_summary", "timeout": 0},
                },
                {
                    "id": "scatter_and_gather",
                    "path": "fedpartial.fl.selection.ScatterAndGather",
                    "args": {
                        "min_clients": "{min_clients}",
                        "num_rounds": "{num_rounds}",
                        "wait_time_after_min_received": 0,
                        "aggregator_id": "aggregator",
                        "persistor_id": "persistor",
                        "shareable_generator_id": "shareable_generator",
                        "train_task_name": "train",
                        "train_timeout": 0,
                    },
                },
                {
                    "id": "cross_site_validate",
                    "path": "fedpartial.fl.selection.CrossSiteEval",
                    "args": {"model_locator_id": "model_locator", "submit_model_task_name": ""},
                },
            ],
        },
        max_missing,
    )


def client_config(
    method: str, dataset: dict, model: dict, train: dict, evaluation: dict, method_args: dict, seed: int = 0
) -> dict:
    """The client configuration of a job: the site executor (data check, training, validation, model submission)
    with the whole job spec, the site's :class:`~fedpartial.fl.data_check.MinCountFilter` and the metrics sent as
    federated events."""
    return {
        "format_version": 2,
        "method": method,
        "executors": [
            {
                "tasks": ["data_summary", "train", "validate", "submit_model"],
                "executor": {
                    "id": "executor",
                    "path": "fedpartial.fl.executor.PartialLabelExecutor",
                    "args": {
                        "method": "{method}",
                        "method_args": method_args,
                        "dataset": dataset,
                        "model": model,
                        "train": train,
                        "evaluation": evaluation,
                        "seed": seed,
                    },
                },
            }
        ],
        "task_result_filters": CLIENT_RESULT_FILTERS,
        "task_data_filters": [],
        "components": [
            {
                "id": "event_to_fed",
                "path": "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
                "args": {"events_to_convert": ["analytix_log_stats"], "fed_event_prefix": "fed."},
            }
        ],
    }
