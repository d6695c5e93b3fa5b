"""How a source's training patients are dealt over sites (the label protocol then decides what each annotates).

- ``iid``: balanced, random (:func:`fedpartial.data.prepare.split_sites`);
- ``centre``: natural partition, one site per acquiring centre (FLamby's Fed-ISIC2019: the ``centre`` column);
- ``dirichlet``: label-distribution skew: for every class, the share of its patients going to each site is drawn
  from ``Dirichlet(alpha)`` (small alpha = strong skew; Hsu et al. 2019, "Measuring the effects of non-identical
  data distribution"); a patient's class is the label of its first image (multi-label: its first positive class,
  ``none`` when it has none);
- ``quantity``: quantity skew: site shares drawn from ``Dirichlet(alpha)`` over sites, patients dealt at random
  in those proportions.

All work on whole patients (no patient straddles two sites) and are deterministic given the seed; every site
gets at least one patient.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PARTITIONS = ("iid", "centre", "dirichlet", "quantity")


def _patients(patient_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    uniq, inverse = np.unique(np.asarray([str(p) for p in patient_ids]), return_inverse=True)
    return uniq, inverse


def _ensure_nonempty(owner: np.ndarray, num_sites: int, rng: np.random.Generator) -> np.ndarray:
    """Move one patient from the largest site to every empty site."""
    for s in range(num_sites):
        if not (owner == s).any():
            counts = np.bincount(owner, minlength=num_sites)
            donor = int(np.argmax(counts))
            cand = np.flatnonzero(owner == donor)
            owner[cand[rng.integers(len(cand))]] = s
    return owner


def _rows(owner: np.ndarray, inverse: np.ndarray, num_sites: int) -> list[np.ndarray]:
    return [np.flatnonzero(owner[inverse] == s) for s in range(num_sites)]


def by_centre(centres: Sequence[str], num_sites: int | None, order: Sequence[str] | None = None
              ) -> tuple[list[np.ndarray], list[str]]:
    """One site per centre (in ``order`` where given, else sorted); returns (rows per site, centre names)."""
    c = np.asarray([str(x) for x in centres])
    names = [n for n in (order or []) if n in set(c)] + sorted(set(c) - set(order or []))
    if num_sites is not None and num_sites != len(names):
        raise ValueError(f"partition 'centre' gives one site per centre: the data have {len(names)} centres "
                         f"({names}), not {num_sites}; pass --sites {len(names)}")
    return [np.flatnonzero(c == n) for n in names], names


def dirichlet_label_skew(patient_ids: Sequence[str], labels: np.ndarray, num_sites: int, alpha: float,
                         seed: int) -> list[np.ndarray]:
    """Rows per site under label-distribution skew. ``labels``: ``(N, C)`` 0/1 (-1 = not annotated)."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    uniq, inverse = _patients(patient_ids)
    first = np.full(len(uniq), -1)
    seen = np.zeros(len(uniq), bool)
    for i, g in enumerate(inverse):
        if not seen[g]:
            seen[g] = True
            pos = np.flatnonzero(labels[i] == 1)
            first[g] = int(pos[0]) if len(pos) else -1
    if len(uniq) < num_sites:
        raise ValueError(f"{len(uniq)} training patients cannot fill {num_sites} sites")
    rng = np.random.default_rng([3, seed])
    owner = np.empty(len(uniq), np.int64)
    for k in np.unique(first):
        members = rng.permutation(np.flatnonzero(first == k))
        share = rng.dirichlet(np.full(num_sites, float(alpha)))
        cuts = np.round(np.cumsum(share) * len(members)).astype(int)[:-1]
        for s, part in enumerate(np.split(members, cuts)):
            owner[part] = s
    return _rows(_ensure_nonempty(owner, num_sites, rng), inverse, num_sites)


def quantity_skew(patient_ids: Sequence[str], num_sites: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Rows per site under quantity skew (site shares ~ Dirichlet(alpha))."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    uniq, inverse = _patients(patient_ids)
    if len(uniq) < num_sites:
        raise ValueError(f"{len(uniq)} training patients cannot fill {num_sites} sites")
    rng = np.random.default_rng([4, seed])
    share = rng.dirichlet(np.full(num_sites, float(alpha)))
    members = rng.permutation(len(uniq))
    cuts = np.round(np.cumsum(share) * len(members)).astype(int)[:-1]
    owner = np.empty(len(uniq), np.int64)
    for s, part in enumerate(np.split(members, cuts)):
        owner[part] = s
    return _rows(_ensure_nonempty(owner, num_sites, rng), inverse, num_sites)
