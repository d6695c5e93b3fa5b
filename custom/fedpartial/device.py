"""The training device of a site: chosen from the job's ``device`` (``auto`` / ``cpu`` / ``cuda`` / ``cuda:N``),
described for the logs and ``results.json``, and refused clearly when the job asks for a GPU the site lacks."""

from __future__ import annotations

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def cuda_unavailable_reason() -> str:
    """Why ``torch.cuda.is_available()`` is False here, in words (a CPU-only torch build, or no GPU visible)."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU (driver, CUDA_VISIBLE_DEVICES?)"


def resolve_device(requested: str, where: str = "") -> tuple[torch.device, str | None]:
    """``(device, note)`` for the job's ``device`` option; ``note`` says why ``auto`` fell back to the CPU (None
    otherwise). ``cuda`` / ``cuda:N`` without a usable GPU is a ``RuntimeError`` naming ``where`` and the reason."""
    req = str(requested or "auto").strip().lower()
    prefix = f"{where}: " if where else ""
    if req == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), None
        return torch.device("cpu"), f"device 'auto': no CUDA ({cuda_unavailable_reason()}); training on the CPU"
    try:
        dev = torch.device(req)
    except RuntimeError:
        raise ValueError(f"{prefix}unknown device {requested!r}; use one of {DEVICE_CHOICES}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{prefix}device {requested!r} was asked for but CUDA is not available: "
                f"{cuda_unavailable_reason()}. Install a CUDA build of torch, or set device 'auto' / "
                "'cpu' to train on the CPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"{prefix}device {requested!r}: only {torch.cuda.device_count()} GPU(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"{prefix}unsupported device {requested!r}; use one of {DEVICE_CHOICES}")
    return dev, None


def device_record(device: torch.device, amp: bool = False, deterministic: bool = False) -> dict:
    """What ``results.json`` records of a site's device: ``{"device", "name", "torch", "cuda", "amp",
    "deterministic"}`` (plain strings and booleans)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        dev = torch.device("cuda", index)
    else:
        name = "cpu"
    cuda = torch.version.cuda
    # plain str: torch.__version__ is a TorchVersion, which NVFlare's FOBS cannot serialise in a site's meta
    return {
        "device": str(dev),
        "name": str(name),
        "torch": str(torch.__version__),
        "cuda": None if cuda is None else str(cuda),
        "amp": bool(amp),
        "deterministic": bool(deterministic),
    }


def describe(record: dict) -> str:
    """One log line of :func:`device_record`."""
    extra = [k for k in ("amp", "deterministic") if record.get(k)]
    return (
        f"training on {record['device']} ({record['name']}, torch {record['torch']}"
        + (f", CUDA {record['cuda']}" if record.get("cuda") else "")
        + ")"
        + (f" with {' + '.join(extra)}" if extra else "")
    )


def mixed_precision(device_type: str, enabled: bool = True):
    """``train.amp``'s context for a whole local round: bfloat16 autocast on ``device_type`` ('cuda' / 'cpu') with
    autocast's weight cache off.

    The cache keeps the first bfloat16 copy of each weight until the outermost autocast block ends; a block around
    a round of optimiser steps would then run every forward pass of the round on the weights the round started
    with (the steps update the float32 weights, the forward passes never see them). Without the cache each
    forward pass casts the current weights (as a block per step does)."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=bool(enabled), cache_enabled=False)
