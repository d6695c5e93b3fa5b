"""One place for seeds: a site's seed from a stable hash of its name and the job seed, and the global RNGs."""

from __future__ import annotations

import hashlib
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
