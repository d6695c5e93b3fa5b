"""The training device: ``device: cuda`` without CUDA fails with a clear message naming the site, ``auto`` says when
it falls back to the CPU, the site logs the device it uses and ``results.json`` records it; ``deterministic: true``
sets the reproducibility switches and two runs give the same weights (on the CPU here; ``benchmarks/gpu_check.sh``
runs the same on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants
from nvflare.fuel.utils import fobs

from conftest import REPO
from fedpartial.device import describe, device_record, resolve_device
from fedpartial.fl.executor import PartialLabelExecutor
from fedpartial.fl.results import ResultsRecorder


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cuda_without_a_gpu_is_a_clear_error_naming_the_site(no_cuda):
    for requested in ("cuda", "cuda:1", "CUDA"):
        with pytest.raises(
            RuntimeError,
            match=r"site 'h1': device '(cuda|cuda:1|CUDA)' was asked for but CUDA is "
            r"not available: .*(CPU-only build|sees no GPU).*'auto' / 'cpu'",
        ):
            resolve_device(requested, "site 'h1'")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")


def test_auto_falls_back_to_the_cpu_with_a_warning_and_the_site_logs_its_device(no_cuda):
    dev, note = resolve_device("auto")
    assert dev == torch.device("cpu") and "device 'auto': no CUDA" in note and "training on the CPU" in note
    assert resolve_device("cpu") == (torch.device("cpu"), None)
    ex = PartialLabelExecutor(dataset="ich_phantom", device="auto", train={"amp": True})
    ex._check_options("job 'j'")
    logged = []
    ex.log_warning = lambda ctx, msg: logged.append(("warning", msg))
    ex.log_info = lambda ctx, msg: logged.append(("info", msg))
    ex._select_device(FLContext(), "h1")
    assert ex.torch_device == torch.device("cpu")
    assert logged[0][0] == "warning" and "no CUDA" in logged[0][1]
    assert logged[1] == ("info", "site h1: training on cpu (cpu, torch " + torch.__version__ + ") with amp")
    assert ex.device_info == {
        "device": "cpu",
        "name": "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "amp": True,
        "deterministic": False,
    }
    ex.device = "cuda"
    with pytest.raises(RuntimeError, match="site 'h1': device 'cuda' was asked for"):
        ex._select_device(FLContext(), "h1")


def test_results_record_each_sites_device():
    recorder = ResultsRecorder()
    record = device_record(torch.device("cpu"), amp=False, deterministic=True)
    for site in ("h1", "h2"):
        peer = FLContext()
        peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=False)
        peer.set_prop(
            FLContextKey.SHAREABLE,
            DXO(DataKind.WEIGHTS, data={}, meta={"device": record, "train_loss": 1.0}).to_shareable(),
            private=False,
        )
        ctx = FLContext()
        ctx.set_peer_context(peer)
        ctx.set_prop(AppConstants.CURRENT_ROUND, 0, private=False)
        recorder._record_contribution(ctx)
    assert all(v is None or type(v) in (str, bool) for v in record.values())
    sent = fobs.loads(fobs.dumps(DXO(DataKind.WEIGHTS, data={}, meta={"device": record}).to_shareable()))
    assert from_shareable(sent).meta["device"] == record  # what a site sends NVFlare can serialise
    out = json.loads(json.dumps(recorder.summary(), default=float))
    assert out["rounds"][0]["site_devices"] == {"h1": record, "h2": record}
    assert "device" not in out["rounds"][0]["site_meta"]["h1"]  # not listed as the method's own metadata
    assert describe(record) == f"training on cpu (cpu, torch {torch.__version__}) with deterministic"


DETERMINISTIC_RUN = textwrap.dedent("""
    import json, sys
    import torch
    from fedpartial.models import PartialLabelNet
    from fedpartial.seeding import deterministic_settings, seed_everything, set_deterministic

    set_deterministic(sys.argv[1] == "1")
    torch.set_num_threads(2)
    seed_everything(3)
    net = PartialLabelNet("small_cnn", 4, 3, width=8, dropout=0.2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.rand(16, 3, 32, 32), (torch.rand(16, 4) < 0.5).float()
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
        opt.step()
    print(json.dumps({"settings": deterministic_settings(),
                      "weights": [float(p.double().sum()) for p in net.parameters()]}))
""")


def _run(deterministic: bool) -> dict:
    env = {"PYTHONPATH": str(REPO / "custom"), "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", DETERMINISTIC_RUN, "1" if deterministic else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deterministic_sets_the_switches_and_runs_repeat_exactly():
    a, b, plain = _run(True), _run(True), _run(False)
    assert a["settings"] == {
        "use_deterministic_algorithms": True,
        "cudnn_deterministic": True,
        "cudnn_benchmark": False,
        "cublas_workspace_config": ":4096:8",
        "tf32": False,
    }
    assert plain["settings"]["use_deterministic_algorithms"] is False and plain["settings"]["tf32"] is True
    assert plain["settings"]["cublas_workspace_config"] is None
    assert a["weights"] == b["weights"]  # bit for bit
    assert a["weights"] == pytest.approx(plain["weights"], rel=1e-4)  # the same training, CPU kernels
