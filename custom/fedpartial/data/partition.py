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

import warnings
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


def by_centre(
    centres: Sequence[str], num_sites: int | None, order: Sequence[str] | None = None
) -> tuple[list[np.ndarray], list[str]]:
    """One site per centre (in ``order`` where given, else sorted); returns (rows per site, centre names)."""
    c = np.asarray([str(x) for x in centres])
    names = [n for n in (order or []) if n in set(c)] + sorted(set(c) - set(order or []))
    if num_sites is not None and num_sites != len(names):
        raise ValueError(
            f"partition 'centre' gives one site per centre: the data have {len(names)} centres "
            f"({names}), not {num_sites}; pass --sites {len(names)}"
        )
    return [np.flatnonzero(c == n) for n in names], names


def dirichlet_label_skew(
    patient_ids: Sequence[str], labels: np.ndarray, num_sites: int, alpha: float, seed: int
) -> list[np.ndarray]:
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


# ----------------------------------------------------------------------------------------- patient-level splits


def cut_index(cum: np.ndarray, target: float, lo: int, hi: int) -> int:
    """Number of leading groups whose cumulative size is closest to ``target``, clipped to ``lo..hi``."""
    i = int(np.argmin(np.abs(cum - target)))
    return min(max(i, lo), hi)


def split_patients(patient_ids: Sequence[str], val_frac: float, test_frac: float, seed: int) -> np.ndarray:
    """Patient-level train / val / test split (deterministic from ``seed``).

    Patients are shuffled (the permutation of the sorted unique ids depends only on the seed) and cut where the
    cumulative number of images is closest to ``test_frac`` and ``test_frac + val_frac`` of all images; every
    split gets at least one patient.

    Returns:
        ``(N,)`` array of 'train' / 'val' / 'test' per row.
    """
    if not (0 < val_frac < 1 and 0 < test_frac < 1 and val_frac + test_frac < 1):
        raise ValueError(f"need 0 < val_frac, test_frac and val_frac + test_frac < 1; got {val_frac}, {test_frac}")
    pids = np.asarray([str(p) for p in patient_ids])
    uniq, inverse, sizes = np.unique(pids, return_inverse=True, return_counts=True)
    if len(uniq) < 3:
        raise ValueError(f"need at least 3 patients for a train / val / test split, got {len(uniq)}")
    order = np.random.default_rng([1, seed]).permutation(len(uniq))
    cum = np.concatenate([[0], np.cumsum(sizes[order])])
    n = len(pids)
    n_test = cut_index(cum, test_frac * n, 1, len(uniq) - 2)
    n_eval = cut_index(cum, (test_frac + val_frac) * n, n_test + 1, len(uniq) - 1)
    group_split = np.full(len(uniq), "train", dtype=object)
    group_split[order[:n_test]] = "test"
    group_split[order[n_test:n_eval]] = "val"
    return group_split[inverse].astype(str)


def split_sites(
    patient_ids: Sequence[str], num_sites: int, seed: int, site_sizes: int | Sequence[int] | None = None
) -> list[np.ndarray]:
    """Deal patients IID over ``num_sites`` disjoint sites, balancing image counts.

    Patients are shuffled with the seed, then taken largest first (ties in shuffled order), each going to the
    site with the fewest images so far, so sites differ by at most a few images. With
    ``site_sizes`` (one int for all sites, or one per site) each site keeps at most that many images (whole
    patients first, in shuffled order).

    Returns:
        per site, the sorted row positions (into ``patient_ids``).
    """
    if num_sites < 1:
        raise ValueError(f"num_sites must be >= 1, got {num_sites}")
    caps: list[int | None]
    if site_sizes is None:
        caps = [None] * num_sites
    elif isinstance(site_sizes, (int, np.integer)):
        caps = [int(site_sizes)] * num_sites
    else:
        caps = [int(c) for c in site_sizes]
        if len(caps) != num_sites:
            raise ValueError(f"site_sizes has {len(caps)} entries for {num_sites} sites")
    if any(c is not None and c < 1 for c in caps):
        raise ValueError(f"site sizes must be >= 1, got {site_sizes}")
    pids = np.asarray([str(p) for p in patient_ids])
    uniq, inverse, sizes = np.unique(pids, return_inverse=True, return_counts=True)
    if len(uniq) < num_sites:
        raise ValueError(f"{len(uniq)} training patients cannot fill {num_sites} sites")
    shuffled = np.random.default_rng([2, seed]).permutation(len(uniq))
    rank = np.empty(len(uniq), np.int64)
    rank[shuffled] = np.arange(len(uniq))
    order = np.lexsort((rank, -sizes))  # largest patients first, shuffled among equal sizes
    load = np.zeros(num_sites, np.int64)
    owner = np.empty(len(uniq), np.int64)
    for g in order:
        s = int(np.argmin(load))
        owner[g] = s
        load[s] += sizes[g]
    out = []
    for s, cap in enumerate(caps):
        idx = np.flatnonzero(owner[inverse] == s)
        idx = idx[np.lexsort((idx, rank[inverse[idx]]))]
        if cap is not None:
            if len(idx) < cap:
                warnings.warn(f"site-{s + 1} has only {len(idx)} training images (< site size {cap})")
            idx = idx[:cap]
        out.append(np.sort(idx))
    return out
