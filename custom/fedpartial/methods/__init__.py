"""Federated methods: each is a local trainer plus a server rule (see ``base``), registered by name.

Layout: ``base`` (the extension points, :class:`Method` and the registry), ``options`` (typed, checked options),
``common`` (building blocks several methods share), ``baselines`` (FedAvg and its partial-label variants),
``fedprox`` (the smallest method: one extra loss term), ``fedavgm`` (the smallest stateful server rule), and one
module or package per published method (a package with its ``maths`` (the equations as pure functions),
``trainer`` and ``rule``). Each defines ``register_all(register)``; :func:`load_all` finds them all.
"""

import importlib
import pkgutil

from .base import (Contribution, LocalTrainer, Method, RoundOutput, RuleOptions, ServerRule, SiteContext,
                   TrainerOptions, TrainOptions, available_methods, comparison_jobs, get_method, register, registered,
                   saved_form)
from .options import OptionError

_loaded = False


def load_all() -> None:
    """Register the built-in methods (idempotent): every module or package of ``fedpartial.methods`` that defines
    ``register_all(register)`` is imported and registers its methods, so a new method is one new module."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in ("base", "options", "common"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "register_all"):
            module.register_all(register)


__all__ = ["Contribution", "LocalTrainer", "Method", "OptionError", "RoundOutput", "RuleOptions", "ServerRule",
           "SiteContext", "TrainerOptions", "TrainOptions", "available_methods", "comparison_jobs", "get_method",
           "register", "registered", "saved_form", "load_all"]
