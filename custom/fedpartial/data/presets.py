"""Dataset presets: classes, task, image pipeline defaults and the source used to prepare a simulated split, one
per dataset of :mod:`fedpartial.data.catalog` (where each dataset's constants live). A job names a preset and overrides what it needs::

    "dataset": {"preset": "ich_phantom", "image_size": 64, "prepare": {"protocol": "missing_k", "k": 4}}

Everything here is method-agnostic.
"""

from __future__ import annotations

import copy

from .catalog import PRESETS
from .settings import check_dataset

__all__ = ["PRESETS", "deep_merge", "resolve_dataset"]


def deep_merge(base: dict, over: dict) -> dict:
    """A copy of ``base`` with ``over`` merged in, nested dicts merged key by key."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def resolve_dataset(cfg: dict | str, where: str = "dataset") -> dict:
    """A job's dataset config -> full dataset config (preset merged with the job's overrides), checked
    (:func:`fedpartial.data.settings.check_dataset`: an unknown key, a wrong type or an impossible value is one
    :class:`~fedpartial.options.OptionError` line naming the key, ``where`` in front)."""
    cfg = {"preset": cfg} if isinstance(cfg, str) else dict(cfg)
    preset = cfg.pop("preset", None)
    if preset is None:
        base = {}
    elif preset in PRESETS:
        base = PRESETS[preset]
    else:
        raise ValueError(f"unknown dataset preset {preset!r}; available: {sorted(PRESETS)}")
    full = deep_merge(base, cfg)
    for key in ("name", "task", "classes", "channels", "image_size"):
        if key not in full:
            raise ValueError(f"dataset config lacks '{key}' (and no preset provides it)")
    return check_dataset(full, where)
