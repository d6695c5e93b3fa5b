"""Federated methods: each is a local trainer plus a server rule (see ``base``), registered by name.

Layout: ``base`` (the extension points, :class:`Method`, the registry and :func:`load_all`), ``common``
(building blocks several methods share), ``baselines`` (FedAvg and its partial-label variants), ``fedprox`` (the smallest method: one extra loss term), ``fedavgm`` (the smallest stateful server rule), and one
module or package per published method (a package with its ``maths`` (the equations as pure functions),
``trainer`` and ``rule``). Each defines ``register_all(register)``; :func:`load_all` finds them all.
"""

from ..options import OptionError
from .base import (
    Contribution,
    LocalTrainer,
    Method,
    PlainSums,
    RoundOutput,
    RuleOptions,
    ServerRule,
    SiteContext,
    TrainerOptions,
    TrainOptions,
    available_methods,
    comparison_jobs,
    get_method,
    load_all,
    register,
    registered,
    saved_form,
)

__all__ = [
    "Contribution",
    "LocalTrainer",
    "Method",
    "OptionError",
    "PlainSums",
    "RoundOutput",
    "RuleOptions",
    "ServerRule",
    "SiteContext",
    "TrainerOptions",
    "TrainOptions",
    "available_methods",
    "comparison_jobs",
    "get_method",
    "register",
    "registered",
    "saved_form",
    "load_all",
]
