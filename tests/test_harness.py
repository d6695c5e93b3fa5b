"""The test harness itself: a simulator start that NVFlare leaves hanging is retried once, then fails at once."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from conftest import START_FAILURES, run_watched


def test_a_failed_start_is_retried_once_then_fails_with_the_line_not_the_timeout(tmp_path):
    log = tmp_path / "server_log.txt"
    hang = (
        f"import time; open({str(log)!r}, 'a').write('x - ERROR - {START_FAILURES[0]} in X, timeout: 60.0\\n');"
        " time.sleep(300)"
    )
    retried = []
    t0 = time.time()
    proc = run_watched(
        [sys.executable, "-c", hang], env={}, timeout=300, logs=[log], before_retry=lambda: retried.append(1)
    )
    assert time.time() - t0 < 30  # two attempts of about a second each, not the 300 s timeout
    assert proc.returncode == -9 and retried == [1]
    assert f"START FAILED: x - ERROR - {START_FAILURES[0]}" in proc.stderr


def test_a_start_that_recovers_on_the_retry_returns_the_second_run(tmp_path):
    marker, log = tmp_path / "tried", tmp_path / "log.txt"
    code = (
        f"import os, time, pathlib; m = pathlib.Path({str(marker)!r})\n"
        f"if not m.exists():\n    m.touch(); open({str(log)!r}, 'a').write('{START_FAILURES[1]}: boom\\n'); time.sleep(300)\n"
        "print('finished')"
    )
    proc = run_watched([sys.executable, "-c", code], env={}, timeout=300, logs=[log])
    assert proc.returncode == 0 and proc.stdout.strip() == "finished"


def test_a_normal_run_keeps_its_output_and_return_code(tmp_path):
    proc = run_watched(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        env={},
        timeout=60,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out\n", "err\n")


class _Item:
    """What :func:`conftest.deal` reads of a collected test: its module and its markers."""

    def __init__(self, name: str, module: str, *marks: str):
        self.name, self.module, self.marks = name, SimpleNamespace(__name__=module), marks

    def get_closest_marker(self, mark):
        return mark if mark in self.marks else None

    def __repr__(self):
        return self.name


def test_worksteal_deal_starts_each_deployment_module_whole_and_apart_and_spreads_the_simulator_runs():
    from conftest import _chunk_sizes, deal

    items = [_Item(f"u{i}", "unit") for i in range(20)]
    items[3:3] = [_Item(f"poc{i}", "poc", "integration", "deployment") for i in range(4)]
    items[10:10] = [_Item(f"faults{i}", "faults", "integration", "deployment") for i in range(2)]
    items += [_Item("privacy", "privacy", "integration", "deployment")]
    items[1:1] = [_Item(f"sim{i}", f"sim{i}", "integration") for i in range(6)]
    order = deal(items, 3)
    assert sorted(map(repr, order)) == sorted(map(repr, items))  # the same tests, each once
    sizes = _chunk_sizes(len(items), 3)
    assert sizes == [11, 11, 11]
    chunks = [order[:11], order[11:22], order[22:]]
    names = [[repr(t) for t in c] for c in chunks]
    # the largest deployment module starts chunk 0, the others share chunk 1, chunk 2 starts on simulator runs
    assert names[0][:4] == ["poc0", "poc1", "poc2", "poc3"]
    assert names[1][:3] == ["faults0", "faults1", "privacy"]
    assert names[2][0].startswith("sim") and not any(n.startswith(("poc", "faults", "privacy")) for n in names[2])
    assert [sum(n.startswith("sim") for n in c) for c in names] == [0, 0, 6]  # to the least loaded chunk
    units = [n for c in names for n in c if n.startswith("u")]
    assert units == sorted(units, key=lambda n: int(n[1:]))  # the rest keep their order
    many = [_Item(f"poc{i}", "poc", "integration", "deployment") for i in range(12)] + items[:21]
    assert deal(many, 3) == many  # a module longer than a chunk: the order as collected


def test_make_test_deals_the_collected_tests(request):
    """Under ``make test`` (``pytest -n 3 --dist worksteal``) the workers' collection is dealt: a deployment test
    heads the first worker's chunk."""
    from conftest import dealing

    items = request.session.items
    if not dealing(request.config) or not any(i.get_closest_marker("deployment") for i in items):
        pytest.skip("runs under pytest -n N --dist worksteal with the deployment tests collected (make test)")
    assert items[0].get_closest_marker("deployment") is not None, items[:3]
