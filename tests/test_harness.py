"""The test harness itself: a simulator start that NVFlare leaves hanging is retried once, then fails at once."""

from __future__ import annotations

import sys
import time

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
