"""One place for seeds: a site's seed from a stable hash of its name and the job seed, the global RNGs, and the
deterministic-kernel settings of a reproducible CUDA run (:func:`set_deterministic`)."""

from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import torch


def site_seed(job_seed: int, site: str) -> int:
    """A 31-bit seed for ``site`` in a job seeded with ``job_seed``: the first bytes of SHA-256 of both, so any two
    names (``hospital-a`` / ``hospital-b``) differ and the value is the same in every process and Python run."""
    digest = hashlib.sha256(f"{int(job_seed)}/{site}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def round_seed(seed: int, round_num: int) -> int:
    """The seed of one round at a site (shuffling, augmentation, dropout): the same whichever process runs it."""
    return int(seed) * 100003 + int(round_num)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (dropout, MixUp draws, ... in the trainers)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # what cuBLAS needs for deterministic results (CUDA's reproducibility notes)


def set_deterministic(enabled: bool = True) -> dict:
    """Make CUDA training reproducible run to run (``deterministic: true`` of a job's executor); a no-op when
    ``enabled`` is False (the defaults stay: cuDNN autotuning allowed, TF32 convolutions).

    Sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (before the first cuBLAS call of the process; an existing value is
    kept), cuDNN deterministic with benchmarking off, TF32 off (float32 products and convolutions in full
    float32) and ``torch.use_deterministic_algorithms(True)``: an operation without a deterministic CUDA kernel
    then raises instead of silently varying. On a CPU the same calls apply (CPU kernels are deterministic for a
    fixed thread count). Returns the settings as a dict (for the logs)."""
    if not enabled:
        return {"deterministic": False}
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False  # the legacy flags: torch >= 2.9 maps them onto fp32_precision,
    torch.backends.cudnn.allow_tf32 = False  # and mixing them with the new API is an error there
    torch.use_deterministic_algorithms(True)
    return {
        "deterministic": True,
        "cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"],
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "tf32": False,
    }


def deterministic_settings() -> dict:
    """The current state of the settings :func:`set_deterministic` changes."""
    return {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
    }
