"""Invariants of the label protocols (fedpartial.data.protocols)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedpartial.data import protocols as P

HAM = ["MEL", "NV", "BCC", "AKIEC", "BKL", "DF", "VASC"]


def _coverage(sites: list[list[int]], num_classes: int) -> np.ndarray:
    """How many sites annotate each class."""
    cover = np.zeros(num_classes, int)
    for s in sites:
        cover[s] += 1
    return cover


# ------------------------------------------------------------------------------------------------- missing_k


@pytest.mark.parametrize(
    "num_classes,num_sites,k",
    [
        (5, 5, 1),
        (5, 5, 2),
        (5, 5, 3),
        (5, 5, 4),
        (8, 8, 1),
        (8, 8, 3),
        (8, 8, 5),
        (8, 8, 7),
        (14, 8, 11),
        (5, 10, 4),
        (7, 3, 4),
        (8, 4, 4),
        (5, 2, 2),
    ],
)
def test_missing_k_exact_and_covering(num_classes, num_sites, k):
    for seed in range(5):
        sites = P.missing_k(num_classes, num_sites, k, seed)
        assert len(sites) == num_sites
        for s in sites:
            assert len(s) == num_classes - k == len(set(s))
            assert s == sorted(s) and all(0 <= c < num_classes for c in s)
        cover = _coverage(sites, num_classes)
        assert cover.min() >= 1
        assert cover.max() - cover.min() <= 1  # balanced


def test_missing_k_c_minus_1_gives_site_i_class_i():
    for seed in (0, 1, 1037):
        assert P.missing_k(5, 5, 4, seed) == [[0], [1], [2], [3], [4]]
        assert P.missing_k(8, 8, 7, seed) == [[i] for i in range(8)]


def test_missing_k_deterministic_and_seed_dependent():
    assert P.missing_k(8, 8, 3, 0) == P.missing_k(8, 8, 3, 0)
    assert P.missing_k(8, 8, 3, 0) != P.missing_k(8, 8, 3, 1)
    assert len({json.dumps(P.missing_k(5, 5, 2, s)) for s in range(10)}) > 1


def test_missing_k_zero_is_full():
    assert P.missing_k(4, 3, 0, 7) == P.full(4, 3)


@pytest.mark.parametrize("num_classes,num_sites,k", [(5, 5, 5), (5, 5, 6), (5, 5, -1), (5, 4, 4), (8, 2, 5)])
def test_missing_k_impossible(num_classes, num_sites, k):
    with pytest.raises(ValueError):
        P.missing_k(num_classes, num_sites, k, 0)


# -------------------------------------------------------------------------------------------------- random_s


@pytest.mark.parametrize("num_classes,num_sites,s", [(14, 8, 3), (7, 5, 3), (5, 5, 1), (5, 2, 3), (3, 4, 3)])
def test_random_s_distinct_and_covering(num_classes, num_sites, s):
    for seed in range(10):
        sites = P.random_s(num_classes, num_sites, s, seed)
        assert len(sites) == num_sites
        for site in sites:
            assert len(site) == s == len(set(site))  # distinct classes: no upstream repeat
            assert site == sorted(site)
        assert _coverage(sites, num_classes).min() >= 1


def test_random_s_deterministic_and_seed_dependent():
    assert P.random_s(14, 8, 3, 524) == P.random_s(14, 8, 3, 524)
    assert len({json.dumps(P.random_s(14, 8, 3, s)) for s in range(5)}) > 1


@pytest.mark.parametrize("num_classes,num_sites,s", [(14, 4, 3), (5, 5, 0), (5, 5, 6)])
def test_random_s_impossible(num_classes, num_sites, s):
    with pytest.raises(ValueError):
        P.random_s(num_classes, num_sites, s, 0)


# ----------------------------------------------------------------------------------------------------- table


def test_fedlsm_isic_table():
    sites = P.table(HAM, P.FEDLSM_ISIC_TABLE)
    assert sites == [[1, 4, 6], [1, 2, 5], [0, 2, 5], [2, 3, 5], [2, 3, 4]]
    assert P.table(HAM, "fedlsm_isic") == sites
    assert _coverage(sites, 7).min() >= 1


def test_table_list_and_natural_dict_order():
    assert P.table(["a", "b", "c"], [["c", "a"], ["b"]]) == [[0, 2], [1]]
    per = {f"site-{i}": ["a"] if i != 10 else ["c"] for i in range(1, 11)}
    assert P.table(["a", "b", "c"], per)[-1] == [2]


def test_table_json_file(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps([["a"], ["b", "c"]]))
    assert P.table(["a", "b", "c"], str(f)) == [[0], [1, 2]]


@pytest.mark.parametrize("per_site", [[["a", "zz"]], [["a", "a"]], [], "no_such_table", ["ab"]])
def test_table_errors(per_site):
    with pytest.raises(ValueError):
        P.table(["a", "b"], per_site)


# ------------------------------------------------------------------------------------ labeled_unlabeled, full


def test_labeled_unlabeled():
    assert P.labeled_unlabeled(5, 10, 2) == [list(range(5))] * 2 + [[]] * 8
    for m in (0, 11):
        with pytest.raises(ValueError):
            P.labeled_unlabeled(5, 10, m)


def test_full():
    assert P.full(3, 2) == [[0, 1, 2], [0, 1, 2]]
    with pytest.raises(ValueError):
        P.full(3, 0)


# ---------------------------------------------------------------------------------------------------- assign


def test_assign_dispatch():
    assert P.assign("missing_k", HAM, 7, 3, k=6) == [[i] for i in range(7)]
    assert P.assign("random_s", 14, 8, 524, s=3) == P.random_s(14, 8, 3, 524)
    assert P.assign("table", HAM, 5, 0, table="fedlsm_isic") == P.table(HAM, P.FEDLSM_ISIC_TABLE)
    assert P.assign("labeled_unlabeled", HAM, 4, 0, m=1) == P.labeled_unlabeled(7, 4, 1)
    assert P.assign("full", HAM, 2) == P.full(7, 2)


@pytest.mark.parametrize(
    "call",
    [
        lambda: P.assign("nope", HAM, 5, 0),
        lambda: P.assign("missing_k", HAM, 5, 0),  # missing k
        lambda: P.assign("full", HAM, 5, 0, k=1),  # unexpected parameter
        lambda: P.assign("table", HAM, 4, 0, table="fedlsm_isic"),  # 5-site table, 4 sites
        lambda: P.assign("table", 7, 5, 0, table="fedlsm_isic"),  # names needed
    ],
)
def test_assign_errors(call):
    with pytest.raises(ValueError):
        call()


def test_every_protocol_declares_its_parameters_once():
    """The dataset section's checks and assign() read one table of the protocols' parameters."""
    from fedpartial.data.protocols import PROTOCOLS, assign
    from fedpartial.data.settings import PROTOCOL_ARGS, PROTOCOL_PARAMS

    assert set(PROTOCOLS) == set(PROTOCOL_ARGS)
    assert set(PROTOCOL_PARAMS) == {p for params in PROTOCOL_ARGS.values() for p in params}
    with pytest.raises(ValueError, match=r"takes parameter\(s\) \['k'\]; missing \['k'\]"):
        assign("missing_k", 5, 3)
