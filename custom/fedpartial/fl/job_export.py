"""The one place the bundle leans on NVFlare's job exporter beyond its public API.

NVFlare 2.9's ``FedJob`` exports each component with the attribute values it finds on the object (dropping the
``"{var}"`` references and defaults the bundle's configs keep), unsorted filter task lists, and no way to ship a
whole package in an app's ``custom/``. :class:`ConfigWriter` overrides the exporter's methods named in
:data:`OVERRIDDEN` (NVFlare has no public hook for them); :func:`check_nvflare` fails loudly when an NVFlare release
renames one or changes its parameters (``tests/test_recipes.py``), instead of a job layout going wrong silently.
"""

from __future__ import annotations

import copy
import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from nvflare.job_config.api import FedJob
from nvflare.job_config.fed_job_config import FedJobConfig

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The ``fedpartial`` package every app ships in its ``custom/`` folder."""

OVERRIDDEN = {
    "_get_args": ["self", "component", "custom_dir"],
    "_process_filters": ["self", "taskset_filters", "custom_dir"],
    "_get_server_app": ["self", "config_dir", "custom_dir", "fed_app"],
    "_get_client_app": ["self", "config_dir", "custom_dir", "fed_app"],
}
"""``FedJobConfig``'s private methods :class:`ConfigWriter` overrides, with the parameters it expects."""


def check_nvflare() -> None:
    """Every overridden NVFlare method exists with the expected parameters, and the flag :func:`exporting` reads;
    else a ``RuntimeError`` naming it."""
    from nvflare.recipe import spec

    if not hasattr(spec, "_RECIPE_EXPORT"):
        raise RuntimeError(
            "NVFlare's nvflare.recipe.spec._RECIPE_EXPORT is gone: fedpartial.fl.job_export needs updating"
        )
    for name, params in OVERRIDDEN.items():
        method = getattr(FedJobConfig, name, None)
        if method is None:
            raise RuntimeError(f"NVFlare's FedJobConfig.{name} is gone: fedpartial.fl.job_export needs updating")
        got = list(inspect.signature(method).parameters)
        if got != params:
            raise RuntimeError(
                f"NVFlare's FedJobConfig.{name} takes {got}, not {params}: fedpartial.fl.job_export needs updating"
            )


def exporting() -> bool:
    """Whether ``job.py`` was given NVFlare's ``--export`` (which ``nvflare.recipe.spec`` takes out of ``sys.argv``
    when it is imported, before any parser of ``job.py`` sees it; read back from there)."""
    from nvflare.recipe import spec

    return bool(getattr(spec, "_RECIPE_EXPORT", False)) or "--export" in sys.argv


def copy_package(custom_dir: str | os.PathLike) -> Path:
    """Copy the running ``fedpartial`` package into an app's ``custom/`` folder (NVFlare loads a job's own code
    only from there; no ``__pycache__``)."""
    dst = Path(custom_dir) / PACKAGE_DIR.name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(PACKAGE_DIR, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo"))
    return dst


class ConfigWriter(FedJobConfig):
    """NVFlare's job exporter, writing the bundle's components with the arguments they were configured with
    (``"{var}"`` references included; NVFlare's exporter would write the attribute values and drop defaults),
    filter task lists sorted (stable exports) and the whole package in every app's ``custom/``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given_args: dict[int, dict] = {}  # id(component) -> its arguments as configured
        self._keep: list = []  # the configured objects (their ids stay valid)

    def record(self, obj: Any, args: dict) -> Any:
        self.given_args[id(obj)] = copy.deepcopy(args)
        self._keep.append(obj)
        return obj

    def _get_args(self, component, custom_dir):
        given = self.given_args.get(id(component))
        return copy.deepcopy(given) if given is not None else super()._get_args(component, custom_dir)

    def _process_filters(self, taskset_filters: list, custom_dir):
        out = super()._process_filters(taskset_filters, custom_dir)
        for entry in out:
            entry["tasks"] = sorted(entry["tasks"])
        return out

    def _get_server_app(self, config_dir, custom_dir, fed_app):
        super()._get_server_app(config_dir, custom_dir, fed_app)
        copy_package(custom_dir)

    def _get_client_app(self, config_dir, custom_dir, fed_app):
        super()._get_client_app(config_dir, custom_dir, fed_app)
        if not (Path(custom_dir) / PACKAGE_DIR.name).is_dir():  # an app for both sides has it already
            copy_package(custom_dir)


class BundleJob(FedJob):
    """A ``FedJob`` whose exporter is :class:`ConfigWriter` (the package ships as a whole in ``custom/``)."""

    def __init__(self, name: str, min_clients: int):
        super().__init__(name=name, min_clients=min_clients)
        self.job = ConfigWriter(job_name=name, min_clients=min_clients)
        self.job.set_app_packages([PACKAGE_DIR.name])
