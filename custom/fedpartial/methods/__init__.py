"""Federated methods: each is a local trainer plus a server rule (see ``base``)."""

from .base import Contribution, LocalTrainer, RoundOutput, ServerRule, SiteContext, available_methods, get_method, register

_loaded = False


def load_all() -> None:
    """Register the built-in methods (idempotent)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from . import baselines

    baselines.register_all(register)
    from . import fedmlp

    fedmlp.register_all(register)
    from . import fedlsm

    fedlsm.register_all(register)


__all__ = ["Contribution", "LocalTrainer", "RoundOutput", "ServerRule", "SiteContext", "available_methods",
           "get_method", "register", "load_all"]
