"""NVFlare 2.9 recipes: the bundle's jobs in Python, run with ``SimEnv`` / ``PocEnv`` / ``ProdEnv``.

:class:`PartialLabelRecipe` builds an NVFlare ``FedJob`` (the Job API) for any registered method out of the bundle's
own components: the data check (``BroadcastAndProcess`` + ``DataSummaryProcessor``), the bundle's
``ScatterAndGather`` (missing-site tolerance, early stopping, checkpoints), ``CrossSiteEval`` (NVFlare's ``CrossSiteModelEval`` without the sites the last round lost), the task
filters, the PyTorch persistor, the model selector, the results recorder, and TensorBoard tracking (NVFlare's
``add_experiment_tracking``; ``tracking=None`` leaves the choice to the caller). :class:`FedMLPRecipe`,
:class:`FedLSMRecipe`, :class:`FedIRMRecipe` and :class:`SurgicalRecipe` take the method's options as keyword
arguments, checked against the method's option classes (an unknown or mistyped option is an ``OptionError``)::

    from nvflare.recipe import SimEnv
    from fedpartial.recipes import FedMLPRecipe

    recipe = FedMLPRecipe(name="fedmlp_ich", dataset="ich_phantom", num_sites=5, num_rounds=20, warmup_rounds=5)
    recipe.execute(SimEnv(num_clients=5, workspace_root="workspaces"))

Every shipped job is such a recipe in ``jobs/<name>/job.py``; ``fedpartial-build-jobs`` exports each into its
folder (``meta.json``, ``app/config``, ``app/custom``) for ``nvflare job submit`` and ``nvflare simulator``.

The exported configuration is the bundle's layout (:func:`fedpartial.job_layout.server_config` /
``client_config``): every component's arguments are written as the recipe gave them, with the job-level values
(``num_rounds``, ``min_clients``, ``method``, ``max_missing_sites``) as top-level variables the components refer
to (``"{num_rounds}"``), so an exported folder can be re-run with another number of rounds by editing one value.
``meta.json``'s ``min_clients`` is the number of sites that must stay connected (sites - ``max_missing``); the
training workflow's ``min_clients`` stays the job's number of sites.

Data: a relative dataset root (``"root": "../shared/data/ham10000"``) resolves against ``$FEDPARTIAL_DATA_DIR``
(``data_dir=`` here, ``--data-dir`` of a ``job.py``), by default the checkout the package runs from
(:func:`fedpartial.data.site_config.data_anchor`). ``prepared=`` runs a ``fedpartial-prepare`` output folder as
it is: each simulated site ``site-<i>`` trains on its own manifest ``site-<i>.csv``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

from nvflare.job_config.api import FedJob
from nvflare.job_config.defs import FilterType
from nvflare.recipe.spec import ExecEnv, Recipe

from .data.prepare import DATASET_JSON, load_prepared
from .data.presets import deep_merge, resolve_dataset
from .data.site_config import DATA_DIR_ENV
from .fl.job_export import PACKAGE_DIR, BundleJob, ConfigWriter, copy_package, exporting  # noqa: F401
from .fl.simulator import RunFailed, Stopped, SupervisedSimEnv
from .job_layout import client_config, default_max_missing, server_config, set_run_name, training_entries
from .options import build

_VAR = re.compile(r"^\{(\w+)\}$")
TRACKING_DEFAULT = "tensorboard"
TRACKED_EVENTS = ["fed.analytix_log_stats"]  # the sites' metrics, sent as federated events (ConvertToFedEvent)


def _resolve(value: Any, variables: dict) -> Any:
    """A config value with ``"{name}"`` references to top-level variables replaced by their values."""
    if isinstance(value, str):
        m = _VAR.match(value)
        return variables[m.group(1)] if m and m.group(1) in variables else value
    if isinstance(value, dict):
        return {k: _resolve(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, variables) for v in value]
    return value


def instantiate(entry: dict, variables: dict) -> Any:
    """The object of one config entry (``{"path": "pkg.mod.Class", "args": {...}}``), its ``"{var}"`` arguments
    resolved against the config's top-level ``variables`` (as NVFlare's config loader does)."""
    module, _, cls = entry["path"].rpartition(".")
    return getattr(importlib.import_module(module), cls)(**_resolve(copy.deepcopy(entry.get("args", {})), variables))


def _server_params(cfg: dict) -> dict:
    return {
        k: v
        for k, v in cfg.items()
        if k not in ("components", "workflows", "task_data_filters", "task_result_filters", "format_version")
    }


def build_fed_job(name: str, server: dict, client: dict, min_sites: int) -> FedJob:
    """A ``FedJob`` holding the objects of a server and a client config in the bundle's layout (top-level
    variables, ``components``, ``workflows``, ``executors``, task filters); ``min_sites``: ``meta.json``'s
    ``min_clients``."""
    job = BundleJob(name, min_sites)
    writer: ConfigWriter = job.job
    sv, cv = _server_params(server), _server_params(client)
    job.to_server(sv)
    for entry in server.get("components", []):
        job.to_server(writer.record(instantiate(entry, sv), entry.get("args", {})), id=entry["id"])
    for entry in server.get("workflows", []):
        job.to_server(writer.record(instantiate(entry, sv), entry.get("args", {})), id=entry["id"])
    for key, ftype in (("task_data_filters", FilterType.TASK_DATA), ("task_result_filters", FilterType.TASK_RESULT)):
        for group in server.get(key, []):
            for f in group["filters"]:
                job.to_server(
                    writer.record(instantiate(f, sv), f.get("args", {})), filter_type=ftype, tasks=list(group["tasks"])
                )
    job.to_clients(cv)
    for e in client.get("executors", []):
        ex = e["executor"]
        job.to_clients(writer.record(instantiate(ex, cv), ex.get("args", {})), tasks=list(e["tasks"]))
    for entry in client.get("components", []):
        job.to_clients(writer.record(instantiate(entry, cv), entry.get("args", {})), id=entry["id"])
    for key, ftype in (("task_data_filters", FilterType.TASK_DATA), ("task_result_filters", FilterType.TASK_RESULT)):
        for group in client.get(key, []):
            for f in group["filters"]:
                job.to_clients(
                    writer.record(instantiate(f, cv), f.get("args", {})), filter_type=ftype, tasks=list(group["tasks"])
                )
    return job


def check_job_options(name: str, method: str, model: dict, train: dict, evaluation: dict, method_args: dict) -> None:
    """The checks a site and the server make before training, made when the job is built: the method, its
    options (keys and types, against the method's option classes), ``train``, ``evaluation`` and ``model``."""
    # imported where used: they load torch, which exporting or submitting a job does not need
    from .fl.executor import EvalOptions
    from .methods import TrainOptions, get_method
    from .models import build_model

    where = f"job '{name}'"
    spec = get_method(method)
    trainer_opts, rule_opts = spec.split_options(method_args, where)
    build(spec.trainer.Options, trainer_opts, f"{where}: method '{method}' method_args")
    build(spec.rule.Options, rule_opts, f"{where}: method '{method}' method_args")
    build(TrainOptions, train, f"{where} 'train'")
    build(EvalOptions, evaluation, f"{where} 'evaluation'")
    build_model(model, 2, where=f"{where} 'model'")


class PartialLabelRecipe(Recipe):
    """A federated partial-label job for any registered method (see the module docstring).

    Args:
        name: the job's name (its folder, checkpoint folder and ``meta.json`` name).
        method: a registered method (``fedpartial.methods.available_methods()``).
        dataset: a preset name or a dataset config (``{"preset": ..., "prepare": {...}, ...}``).
        num_sites: the job's number of sites (the training workflow's ``min_clients``).
        num_rounds: training rounds.
        model / train / evaluation: model, training and evaluation options (defaults: small CNN, Adam 1e-3,
            batch 32, one local epoch, test every 5 rounds).
        method_args: the method's options (both sides).
        seed: the sites' seed and the initial global model's ``init_seed`` (unless ``model`` sets one).
        max_missing: sites that may be missing from the data check and any round (default 1 with >= 3 sites).
        key_metric: the model selector's metric (``auc``, ``site_bce``, ...).
        tracking: ``"tensorboard"`` (default), ``"mlflow"``, ``"wandb"`` (NVFlare's ``add_experiment_tracking``)
            or None; ``tracking_config``: the receiver's arguments (e.g. MLflow's ``tracking_uri``).
        prepared: a ``fedpartial-prepare`` output folder: simulated site ``site-<i>`` trains on ``site-<i>.csv``.
        site_data: ``{"site-1": folder, ...}``: each simulated site's own ``fedpartial-prepare --sites 1`` folder
            (its manifest and its own val / test sets: the simulator run as a real federation of separately
            prepared hospitals); sites ``site-1`` .. ``site-N``, N the job's number of sites.
        data_dir: the folder relative dataset roots resolve against, passed to simulated sites as
            ``$FEDPARTIAL_DATA_DIR`` (default: that variable, else the checkout).
        resume: continue the job's own run in the same workspace from its last checkpoint (a run stopped with
            Ctrl-C, or one run again for more rounds); a checkpoint of another configuration is refused.
        checkpoint_dir: where the server and the sites keep their checkpoints (default: under each one's
            workspace, which the simulator empties when a job runs again; ``job.py`` sets
            ``WORKSPACE/<name>.checkpoints``).
    """

    def __init__(
        self,
        *,
        name: str,
        method: str,
        dataset: dict | str,
        num_sites: int,
        num_rounds: int = 20,
        model: dict | None = None,
        train: dict | None = None,
        evaluation: dict | None = None,
        method_args: dict | None = None,
        seed: int = 0,
        max_missing: int | None = None,
        key_metric: str = "auc",
        tracking: str | None = TRACKING_DEFAULT,
        tracking_config: dict | None = None,
        prepared: str | os.PathLike | None = None,
        data_dir: str | os.PathLike | None = None,
        resume: bool = False,
        checkpoint_dir: str | os.PathLike | None = None,
        site_data: dict | None = None,
    ):
        if not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"job '{name}': num_rounds must be an integer >= 1, got {num_rounds!r}")
        dataset = {"preset": dataset} if isinstance(dataset, str) else copy.deepcopy(dataset)
        if prepared is not None:
            dataset["prepared"] = str(Path(prepared).expanduser().resolve())
        if site_data:
            names = [f"site-{i}" for i in range(1, int(num_sites) + 1)]
            if sorted(site_data) != sorted(names):
                raise ValueError(
                    f"job '{name}': site_data names {sorted(site_data)}; the job's {num_sites} simulated "
                    f"sites are {names}"
                )
            dataset["site_data"] = {s: str(Path(f).expanduser().resolve()) for s, f in site_data.items()}
        ds = resolve_dataset(dataset, f"job '{name}' 'dataset'")
        model = copy.deepcopy(model) if model else {"arch": "small_cnn", "in_channels": int(ds["channels"])}
        from .models import start_normalisation  # imported where used: loads torch

        dataset = start_normalisation(dataset, model, int(ds["channels"]))  # explicit in the job's config
        model = {**model, "init_seed": model.get("init_seed", seed)}  # the server's initial global model
        train = (
            copy.deepcopy(train) if train else {"optimizer": "adam", "lr": 0.001, "batch_size": 32, "local_epochs": 1}
        )
        evaluation = copy.deepcopy(evaluation) if evaluation else {"test_every": 5}
        method_args = copy.deepcopy(method_args or {})
        check_job_options(name, method, model, train, evaluation, method_args)
        self.method, self.dataset, self.num_sites, self.num_rounds = method, dataset, int(num_sites), num_rounds
        self.model, self.train, self.evaluation, self.method_args = model, train, evaluation, method_args
        self.seed, self.key_metric = seed, key_metric
        self.max_missing = default_max_missing(self.num_sites) if max_missing is None else int(max_missing)
        self.data_dir = None if data_dir is None else str(Path(data_dir).expanduser().resolve())
        self.server_config = set_run_name(
            server_config(
                method, dataset, model, num_rounds, self.num_sites, method_args, key_metric, self.max_missing
            ),
            name,
        )
        self.client_config = set_run_name(
            client_config(method, dataset, model, train, evaluation, method_args, seed), name
        )
        self.server_config["components"] = [c for c in self.server_config["components"] if c["id"] != "tb_receiver"]
        self.resume = bool(resume)
        self.checkpoint_dir = None if checkpoint_dir is None else str(Path(checkpoint_dir).expanduser().resolve())
        for entry in training_entries(self.server_config) + training_entries(self.client_config):
            if self.resume:  # continue this job's own run (the simulator's simulate_job) from its last checkpoint
                entry.setdefault("args", {})["resume"] = True
            if self.checkpoint_dir:
                entry.setdefault("args", {})["checkpoint_dir"] = self.checkpoint_dir
        job = build_fed_job(name, self.server_config, self.client_config, self.num_sites - self.max_missing)
        super().__init__(job)
        if tracking:
            from nvflare.recipe.utils import add_experiment_tracking

            add_experiment_tracking(self, tracking, {"events": list(TRACKED_EVENTS), **(tracking_config or {})})

    def process_env(self, env: ExecEnv) -> None:
        """In the simulator, the sites resolve relative data roots against ``data_dir`` (``$FEDPARTIAL_DATA_DIR``,
        which the simulator's site processes inherit)."""
        from nvflare.recipe.sim_env import SimEnv

        if isinstance(env, SimEnv) and self.data_dir:
            os.environ[DATA_DIR_ENV] = self.data_dir

    def export(
        self,
        job_dir: str,
        server_exec_params: dict | None = None,
        client_exec_params: dict | None = None,
        env: ExecEnv | None = None,
    ):
        """Export into ``<job_dir>/<name>/`` as NVFlare does, replacing only ``meta.json`` and the app folders:
        the folder's own files (``job.py``, ``README.md``) stay."""
        import tempfile

        dest = Path(job_dir) / self.name
        with tempfile.TemporaryDirectory() as tmp:
            super().export(tmp, server_exec_params, client_exec_params, env)
            out = Path(tmp) / self.name
            dest.mkdir(parents=True, exist_ok=True)
            for old in [p for p in dest.glob("app*") if p.is_dir()]:
                shutil.rmtree(old)
            for item in out.iterdir():
                target = dest / item.name
                if item.is_dir():
                    shutil.copytree(item, target)
                else:
                    shutil.copy2(item, target)
        return dest


class _MethodRecipe(PartialLabelRecipe):
    """A recipe of one method whose options are keyword arguments (checked against the method's options)."""

    METHOD = ""
    COMMON = (
        "name",
        "dataset",
        "num_sites",
        "num_rounds",
        "model",
        "train",
        "evaluation",
        "seed",
        "max_missing",
        "key_metric",
        "tracking",
        "tracking_config",
        "prepared",
        "data_dir",
        "resume",
        "checkpoint_dir",
        "site_data",
    )

    def __init__(self, *, name: str, dataset: dict | str, num_sites: int, **kwargs):
        common = {k: kwargs.pop(k) for k in self.COMMON if k in kwargs}
        super().__init__(
            name=name, method=self.METHOD, dataset=dataset, num_sites=num_sites, method_args=kwargs, **common
        )


class FedMLPRecipe(_MethodRecipe):
    """FedMLP (Sun et al., MICCAI 2024); method options as keywords: ``warmup_rounds``, ``L``, ``R``, ``T0``,
    ``T1``, ``cr_warmup``, ``parity``, ... (``fedpartial.methods.fedmlp``)."""

    METHOD = "fedmlp"


class FedLSMRecipe(_MethodRecipe):
    """FedLSM (Deng, Luo, Chen: federated learning for label set mismatch); its options (``n_uncertain``,
    ``n_confident``, ``awpa``, ...) as keywords (``fedpartial.methods.fedlsm``)."""

    METHOD = "fedlsm"


class FedIRMRecipe(_MethodRecipe):
    """FedIRM (Liu, Yang, Dou, Heng: federated semi-supervised classification via inter-client relation
    matching); its options as keywords (``fedpartial.methods.fedirm``)."""

    METHOD = "fedirm"


class SurgicalRecipe(_MethodRecipe):
    """Surgical aggregation (Kulkarni, Kanhere, Yi, Parekh: federated class-heterogeneous learning); its options
    (``warmup_epochs``, ``norm``, ...) as keywords (``fedpartial.methods.surgical``)."""

    METHOD = "surgical"


# ------------------------------------------------------------------------------------------ job.py entry point


def _parser(name: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=f"python jobs/{name}/job.py",
        description=f"Run the job '{name}' in NVFlare's simulator (SimEnv). NVFlare's own flags: --export "
        f"[--export-dir DIR] writes the job folder DIR/{name} instead of running it.",
    )
    ap.add_argument("--rounds", type=int, default=None, help="training rounds (default: the job's)")
    ap.add_argument(
        "--sites",
        type=int,
        default=None,
        help="simulated sites (default: the job's); the simulated split is dealt over as many, so its "
        "protocol must allow it (e.g. missing_k: every class still annotated somewhere)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="sites training at once (default: all; with two or more GPU groups NVFlare runs one site "
        "at a time per group)",
    )
    ap.add_argument(
        "--gpu",
        default=None,
        metavar="GPUS",
        help="GPUs of the simulated sites (NVFlare's SimEnv gpu_config, the simulator's -gpu): '0,1' "
        "deals the sites over GPUs 0 and 1 in turn (site-1 on 0, site-2 on 1, site-3 on 0, ...), "
        "each GPU training its sites one after the other; '0,0' two such slots on GPU 0; "
        "'[0,1],[2]' groups. Default: every site on the default device",
    )
    ap.add_argument("--seed", type=int, default=None, help="seed of the sites and of the initial global model")
    ap.add_argument(
        "--data",
        default=None,
        metavar="PREPARED_DIR",
        help="a fedpartial-prepare output folder: site-<i> trains on its own site-<i>.csv",
    )
    ap.add_argument(
        "--site-data",
        action="append",
        default=[],
        metavar="[SITE=]FOLDER",
        help="a site's own fedpartial-prepare --sites 1 folder (repeat, one per site: site-1=D1 "
        "site-2=D2 ..., or the folders in site order); each site trains and scores its own sets, "
        "as separately prepared hospitals do",
    )
    ap.add_argument(
        "--data-dir",
        default=None,
        help=f"folder relative data roots resolve against (default: ${DATA_DIR_ENV}, else the checkout)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the job's settings (JSON value; dots reach into dataset / model / train / "
        "evaluation), e.g. --set dataset.image_size=32 --set model.arch=small_cnn; repeatable",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in WORKSPACE from its last round's checkpoint (after Ctrl-C, or for more "
        "--rounds); a checkpoint of another configuration is refused",
    )
    ap.add_argument(
        "--workspace", default="workspaces", help=f"results go to WORKSPACE/{name} (default: workspaces/{name})"
    )
    return ap


def recipe_overrides(args: argparse.Namespace) -> dict:
    """The recipe keyword arguments that a ``job.py``'s command line sets."""
    out: dict = {}
    if args.rounds is not None:
        out["num_rounds"] = args.rounds
    if args.seed is not None:
        out["seed"] = args.seed
    if args.data is not None:
        out["prepared"] = args.data
    if args.site_data:
        out["site_data"] = site_data_arg(args.site_data)
    if args.data_dir is not None:
        out["data_dir"] = args.data_dir
    if args.resume:
        out["resume"] = True
    return out


def site_data_arg(items: list[str]) -> dict[str, str]:
    """``--site-data`` values (``SITE=FOLDER`` or ``FOLDER``, the latter in site order) -> ``{site: folder}``."""
    out: dict[str, str] = {}
    for i, item in enumerate(items, 1):
        site, sep, folder = item.partition("=")
        site, folder = (site.strip(), folder) if sep and not Path(item).exists() else (f"site-{i}", item)
        if site in out:
            raise SystemExit(f"--site-data names {site} twice")
        out[site] = folder
    return out


def site_data_problem(site_data: dict[str, str]) -> str | None:
    """What is wrong with the first ``--site-data`` folder that cannot be a site's prepared folder (it does not
    exist, is no folder, or holds no ``dataset.json``), or None: said before the simulator starts (otherwise each
    site found it out in the data check, after the simulator's start-up)."""
    for site, folder in site_data.items():
        path = Path(folder).expanduser().resolve()
        given = f"--site-data {site}={folder}"
        if not path.exists():
            return f"{given}: the folder {path} does not exist"
        if not path.is_dir():
            return f"{given}: {path} is not a folder (give the fedpartial-prepare --sites 1 output folder)"
        if not (path / DATASET_JSON).is_file():
            return (
                f"{given}: {path} holds no {DATASET_JSON}: it is not a prepared folder (fedpartial-prepare "
                "--sites 1 --out FOLDER writes one)"
            )
    return None


def prepared_sites(folder: str | os.PathLike) -> int:
    """The number of sites of a ``fedpartial-prepare`` output folder."""
    return len(load_prepared(folder).sites)


def job_main(make_recipe: Callable[..., PartialLabelRecipe], argv: list[str] | None = None):
    """The command line of a ``jobs/<name>/job.py`` (``make_recipe(**overrides)`` builds its recipe): run it in
    ``SimEnv`` (or export it with NVFlare's ``--export [--export-dir DIR]``). Returns NVFlare's ``Run``."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--site-data", action="append", default=[])
    given, _ = early.parse_known_args(argv)
    problem = site_data_problem(site_data_arg(given.site_data)) if given.site_data else None
    if problem:  # before the job is built (the model's library loaded): one line, within a second
        early.exit(2, f"{early.prog}: error: {problem}\n")
    base = make_recipe()
    parser = _parser(base.name)
    args = parser.parse_args(argv)
    kwargs = recipe_overrides(args)
    problem = site_data_problem(kwargs.get("site_data") or {})
    if problem:  # before anything is started or removed: one line, at once
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    kwargs["checkpoint_dir"] = checkpoints = Path(args.workspace).resolve() / f"{base.name}.checkpoints"
    if not args.resume and checkpoints.is_dir():  # a fresh run: the simulator empties the run's workspace too
        shutil.rmtree(checkpoints)
    if args.data and args.site_data:
        parser.error("--data (one folder split over the sites) and --site-data (a folder per site) exclude each other")
    sites = (
        args.sites
        or (len(kwargs["site_data"]) if args.site_data else None)
        or (prepared_sites(args.data) if args.data else None)
    )
    if sites is not None and sites != base.num_sites:
        kwargs.update(num_sites=sites, dataset=with_sites(base.dataset, sites))
    for item in args.set:
        kwargs.update(setting_override(base, kwargs, item))
    export = exporting() or "--export" in (argv or [])
    model = pretrained_model(kwargs.get("model", base.model), export, parser.error)
    if model is not None:
        kwargs["model"] = model
    try:
        recipe = make_recipe(**kwargs) if kwargs else base
    except (ValueError, OSError) as e:  # a setting or file of the job that cannot be used: one line, exit 2
        parser.error(str(e))
    n = recipe.num_sites
    if args.gpu is not None:
        try:
            groups = gpu_sites(args.gpu, n)
        except ValueError as e:
            parser.error(str(e))
        for group, sites in groups.items():
            print(f"GPU {group}: {', '.join(sites)}")
    env = SupervisedSimEnv(
        num_clients=n,
        num_threads=args.threads or n,
        gpu_config=args.gpu,
        workspace_root=str(Path(args.workspace).resolve()),
    )
    try:
        run = recipe.execute(env)
    except Stopped as e:
        print(stopped_lines(recipe.name, Path(args.workspace), e, argv), file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    except RunFailed as e:
        print(f"\n{recipe.name} FAILED (simulator status {e.status}):", file=sys.stderr)
        for line in e.lines or [f"no error line in the logs; see {e.workspace}/server/simulate_job/log.txt"]:
            print(f"  {line}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"results: {Path(args.workspace) / recipe.name / 'server/simulate_job/results.md'}")
    return run


def pretrained_model(model: dict | None, exporting: bool, error: Callable[[str], None]) -> dict | None:
    """The job's ``model`` section with ``pretrained`` (a warm-start encoder, ImageNet weights) as the server reads
    it, or None when it names no local file: a relative path is read from where ``job.py`` runs and made absolute
    (the simulator's server runs in its workspace); a missing file is ``error``'s one line before anything starts.
    With ``--export`` an absolute path is the server's own (NVFlare's ``initial_ckpt`` convention) and is not
    checked here."""
    from .models import STARTS  # imported where used: loads torch

    source = (model or {}).get("pretrained") if isinstance(model, dict) else None
    if not source or "://" in str(source) or str(source) in STARTS:  # a URL, or a start shipped with the project
        return None
    path = Path(str(source)).expanduser()
    if path.is_absolute() and exporting:
        return None
    if not path.is_file():
        where = "" if path.is_absolute() else f" (a relative path is read from {Path.cwd()})"
        error(f"model.pretrained: {source} is not a file{where}")
    return {**model, "pretrained": str(path.resolve())}


def stopped_lines(name: str, workspace: Path, stop: Stopped, argv: list[str] | None) -> str:
    """What a ``job.py`` stopped by a signal says: that every process of the run is gone, what was kept (the last
    round's server checkpoint) and the command that resumes it."""
    from .fl.checkpoint import CHECKPOINT_FILE, read_file  # imported where used: loads torch (see above)

    argv = list(sys.argv[1:] if argv is None else argv)
    ckpts = sorted((workspace.resolve() / f"{name}.checkpoints").glob(f"*/*/server/{CHECKPOINT_FILE}"))
    out = [
        f"\n{name}: stopped ({signal_name(stop.signum)}); the simulator and its site processes are gone "
        f"({stop.stopped} stopped)."
    ]
    if ckpts:
        try:
            last = int(read_file(ckpts[-1]).get("round", -1))
            rounds = f" after round {last + 1} (the log's 'Round {last} finished': NVFlare counts from 0)"
        except ValueError:  # a checkpoint that cannot be read says so when resumed
            rounds = ""
        resume = " ".join(["python", f"jobs/{name}/job.py", *[a for a in argv if a != "--resume"], "--resume"])
        out += [f"kept: {ckpts[-1]}{rounds}", f"resume: {resume}"]
    else:
        out.append("kept: nothing to resume (no round had finished); run the command again to start over")
    return "\n".join(out)


def signal_name(signum: int) -> str:
    import signal

    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def gpu_sites(gpu_config: str, num_sites: int) -> dict[str, list[str]]:
    """The simulated sites each GPU group of NVFlare's ``gpu_config`` runs (as the 2.9 simulator deals them:
    ``site-<i>`` to group ``(i - 1) % groups``; a group runs its sites one after the other when there are two or
    more groups). ``"0,1"`` with 3 sites: ``{"0": ["site-1", "site-3"], "1": ["site-2"]}``; ``"0,0"``: two slots on
    GPU 0 (``{"0": [...], "0 (slot 2)": [...]}``). A malformed value or more groups than sites is a
    ``ValueError`` naming it."""
    from nvflare.private.fed.utils.fed_utils import split_gpus

    try:
        groups = split_gpus(gpu_config)
    except ValueError as e:
        raise ValueError(f"--gpu {gpu_config!r}: {e}") from None
    if not groups or not all(g.replace(",", "").isdigit() and "" not in g.split(",") for g in groups):
        raise ValueError(f"--gpu {gpu_config!r}: GPU ids are whole numbers, e.g. 0,1 or [0,1],[2]")
    if len(groups) > num_sites:
        raise ValueError(
            f"--gpu {gpu_config!r}: {len(groups)} GPU groups for {num_sites} sites (at most one group per site)"
        )
    out: dict[str, list[str]] = {}
    for slot, group in enumerate(groups):
        key = group if group not in out else f"{group} (slot {slot + 1})"
        out[key] = [f"site-{i + 1}" for i in range(num_sites) if i % len(groups) == slot]
    return out


def setting_override(base: PartialLabelRecipe, kwargs: dict, item: str) -> dict:
    """``KEY=VALUE`` of a ``job.py``'s ``--set`` -> the recipe keyword it changes (a nested key merged into the
    job's own dict of that name, or of what earlier options made of it)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    top, *rest = key.strip().split(".")
    if not rest:
        return {top: value}
    if top in ("dataset", "model", "train", "evaluation", "method_args"):
        current = kwargs.get(top, getattr(base, top, None))  # method_args.X: one option, the job's others kept
    else:
        current = kwargs.get(top, (base.method_args or {}).get(top))
    current = {"preset": current} if isinstance(current, str) else (current or {})
    for k in reversed(rest):
        value = {k: value}
    return {top: deep_merge(current, value)}


def with_sites(dataset: dict | str, num_sites: int) -> dict:
    """A dataset config whose simulated split has ``num_sites`` sites."""
    dataset = {"preset": dataset} if isinstance(dataset, str) else dataset
    return deep_merge(dataset, {"prepare": {"num_sites": int(num_sites)}})
