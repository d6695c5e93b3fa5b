"""The self-supervised warm start (``fedpartial.methods.selfsup``, jobs ``selfsup_*``): BYOL's loss and stop-gradient,
the target network's moving average, FedEMA's divergence-aware update, the kNN validation vote (each by hand on tiny
tensors), the encoder file loading into every backbone, and a two-round simulator run whose encoder starts a
supervised job."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_fedmlp import _site

from conftest import copy_job, run_simulator, server_log
from fedpartial.methods import get_method
from fedpartial.methods.selfsup import (
    byol_loss,
    fedema_decay,
    fedema_scale,
    knn_probabilities,
    state_distance,
    symmetric_byol_loss,
)
from fedpartial.models import ARCHS, ENCODER_FILE, PartialLabelNet, save_encoder

# ------------------------------------------------------------------------------------------------ the objective


def test_byol_loss_by_hand():
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z = torch.tensor([[3.0, 0.0], [1.0, 1.0]])  # cos 1 and cos 45 deg
    expected = ((2 - 2 * 1.0) + (2 - 2 / math.sqrt(2))) / 2
    assert float(byol_loss(p, z)) == pytest.approx(expected)
    # symmetrised: each view's prediction against the OTHER view's target projection
    p1, p2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    z1, z2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    want = (2 - 2 / math.sqrt(2)) + (2 - 2 * 0.0)  # l(p1, z2) + l(p2, z1)
    assert float(symmetric_byol_loss(p1, p2, z1, z2)) == pytest.approx(want)
    assert float(symmetric_byol_loss(p1, p2, z2, z1)) != pytest.approx(want)  # the pairing matters


def test_no_gradient_reaches_the_target():
    p = torch.tensor([[1.0, 0.5]], requires_grad=True)
    z = torch.tensor([[0.2, 1.0]], requires_grad=True)
    byol_loss(p, z).backward()
    assert p.grad is not None and p.grad.abs().sum() > 0
    assert z.grad is None  # stop-gradient: the target's projection is a constant of the loss


def _ctx(tmp_path, **train):
    ctx = _site("s", [True, False, True], n=16, tmp=tmp_path)
    ctx.train = {"lr": 1e-2, "batch_size": 8, "local_steps": 1, **train}
    return ctx


def test_a_round_trains_the_encoder_and_the_target_follows_by_its_moving_average(tmp_path):
    ctx = _ctx(tmp_path)
    tr = get_method("byol").make_trainer(ctx, {"target_decay": 0.9, "hidden_dim": 16, "projection_dim": 8})
    head = {k: v.clone() for k, v in ctx.model.state_dict().items() if k.startswith(("classifier", "hidden"))}
    before = {k: v.clone() for k, v in ctx.model.encoder.state_dict().items()}
    out = tr.train_round(0, 2, {})
    assert out.steps == 1 and math.isfinite(out.loss) and 0 <= out.loss <= 8  # two terms of 2 - 2 cos each
    after = ctx.model.encoder.state_dict()
    target = tr.target_encoder.state_dict()
    params = {k for k, _ in ctx.model.encoder.named_parameters()}  # (the target's norm statistics are its own)
    changed = [k for k in params if not torch.equal(before[k], after[k])]
    assert changed, "the encoder was not trained"
    for k in changed:  # target <- 0.9 * target (a copy of the encoder before the step) + 0.1 * encoder after it
        assert torch.allclose(target[k], 0.9 * before[k] + 0.1 * after[k], atol=1e-6), k
    assert all(p.grad is None for p in tr.target_encoder.parameters())
    for k, v in head.items():  # the classifier is never trained: the site sends back what it received
        assert torch.equal(ctx.model.state_dict()[k], v), k
    exported = tr.export()
    assert set(exported) == set(ctx.model.state_dict())
    # the projector, predictor and target network are site state: a fresh trainer continues from them
    fresh = get_method("byol").make_trainer(ctx, {"target_decay": 0.9, "hidden_dim": 16, "projection_dim": 8})
    fresh.load_state_dict(tr.state_dict())
    assert all(torch.equal(fresh.projector.state_dict()[k], v) for k, v in tr.projector.state_dict().items())
    assert all(torch.equal(fresh._targets()[0].state_dict()[k], v) for k, v in target.items())


def test_fedema_moves_the_sites_encoder_towards_the_received_one_by_its_divergence(tmp_path):
    a = {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(2)}
    b = {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(7)}
    assert state_distance(a, b, ["w", "n"]) == pytest.approx(5.0)  # integer buffers do not count
    assert fedema_scale(0.7, 5.0) == pytest.approx(0.14)
    assert fedema_decay(5.0, 0.14) == pytest.approx(0.7)
    assert fedema_decay(10.0, 0.14) == 1.0  # capped at 1: a site far away keeps its own encoder
    assert fedema_decay(2.5, 0.14) == pytest.approx(0.35)

    ctx = _ctx(tmp_path)
    tr = get_method("byol").make_trainer(ctx, {"fedema": True, "fedema_tau": 0.7, "hidden_dim": 16})
    tr.train_round(0, 2, {})
    local = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    received = {k: (v + 0.5 if torch.is_floating_point(v) else v + 3) for k, v in local.items()}
    tr.receive({k: v.numpy() for k, v in received.items()})
    assert tr.last_decay == pytest.approx(0.7)  # first update: mu = tau (the autoscaler)
    mixed = ctx.model.state_dict()
    for k in tr.encoder_keys:
        if torch.is_floating_point(local[k]):
            assert torch.allclose(mixed[k], 0.7 * local[k] + 0.3 * received[k], atol=1e-6), k
        else:
            assert torch.equal(mixed[k], received[k]), k
    for k in ("classifier.weight", "classifier.bias"):  # the head is taken as received
        assert torch.equal(mixed[k], received[k])
    lam = tr.fedema_lambda
    tr.train_round(1, 2, {})
    local2 = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    received2 = {k: (v - 0.1 if torch.is_floating_point(v) else v) for k, v in local2.items()}
    tr.receive({k: v.numpy() for k, v in received2.items()})
    d = state_distance(received2, local2, tr.encoder_keys)
    assert tr.fedema_lambda == lam and tr.last_decay == pytest.approx(min(lam * d, 1.0))  # lambda kept

    plain = get_method("byol").make_trainer(_ctx(tmp_path), {})
    plain.train_round(0, 2, {})
    got = {k: v.clone() for k, v in plain.ctx.model.state_dict().items()}
    plain.receive({k: (v + 0.5 if torch.is_floating_point(v) else v).numpy() for k, v in got.items()})
    assert plain.last_decay is None  # without fedema the received encoder is taken as it is
    k = plain.encoder_keys[0]
    assert torch.allclose(plain.ctx.model.state_dict()[k], got[k] + 0.5)


# ------------------------------------------------------------------------------------------------ kNN validation


def test_knn_vote_by_hand():
    feats = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    labels = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    T = 0.5
    probs = knn_probabilities(feats, labels, mask, "multilabel", k=2, temperature=T)
    z = torch.nn.functional.normalize(feats, dim=1)
    sim = z @ z.T
    # row 0: neighbours 1 (cos s01) and 3 (cos s03); class 0: both annotated (y 1 and 0); class 1: only row 3 (y 0)
    s01, s03 = float(sim[0, 1]), float(sim[0, 3])
    w1, w3 = math.exp(s01 / T), math.exp(s03 / T)
    assert float(probs[0, 0]) == pytest.approx(w1 / (w1 + w3), rel=1e-5)
    assert float(probs[0, 1]) == pytest.approx(0.0, abs=1e-6)
    # row 2: neighbours 3 and 1; class 1 annotated at row 3 only (y 0) -> 0; class 0: y 0 (row 3), y 1 (row 1)
    s23, s21 = float(sim[2, 3]), float(sim[2, 1])
    v3, v1 = math.exp(s23 / T), math.exp(s21 / T)
    assert float(probs[2, 0]) == pytest.approx(v1 / (v1 + v3), rel=1e-5)
    assert float(probs[2, 1]) == pytest.approx(0.0, abs=1e-6)
    one = knn_probabilities(feats, labels, mask, "multilabel", k=1, temperature=T)
    assert float(one[0, 0]) == pytest.approx(1.0)  # its one neighbour (row 1) is positive; itself is never counted
    single = knn_probabilities(feats, torch.eye(2)[[0, 0, 1, 1]], torch.ones(4, 2, dtype=torch.bool), "multiclass", k=1)
    assert torch.allclose(single, torch.eye(2)[[0, 0, 1, 1]])  # single-label rows sum to 1


# ------------------------------------------------------------------------------------------------ the encoder file


@pytest.mark.parametrize("arch", ARCHS)
def test_the_encoder_file_loads_into_its_backbone(arch, tmp_path):
    channels = 1 if arch == "densenet121" else 3
    trained = PartialLabelNet(arch, 4, channels, init_seed=1)
    torch.save({"model": trained.state_dict()}, tmp_path / "FL_global_model.pt")  # the persistor's layout
    path = save_encoder(tmp_path / "FL_global_model.pt", tmp_path / ENCODER_FILE)
    warm = PartialLabelNet(arch, 7, channels, init_seed=2, pretrained=str(path))  # another head: encoder only
    scratch = PartialLabelNet(arch, 7, channels, init_seed=2)
    for k, v in trained.encoder.state_dict().items():
        assert torch.equal(warm.encoder.state_dict()[k], v), k
    x = torch.rand(2, channels, 32, 32)
    trained.eval(), warm.eval(), scratch.eval()
    with torch.no_grad():
        assert torch.allclose(warm.features(x), trained.features(x), atol=1e-5)
        assert not torch.allclose(warm.features(x), scratch.features(x), atol=1e-3)


# ------------------------------------------------------------------------------------------------ the stage


def test_two_rounds_in_the_simulator_write_an_encoder_that_starts_a_supervised_job(tmp_path, data_cache):
    from test_jobs_simulator import TINY

    from fedpartial.data.presets import deep_merge

    n = 3  # of the job's 5 sites: every site is a process
    args = deep_merge(TINY["ich"], {"dataset": {"prepare": {"num_sites": n, "k": 3}}})
    job_dir = copy_job("selfsup_ich", tmp_path / "job", num_rounds=2, executor_args=args, min_clients=n)
    ws = tmp_path / "ws"
    proc = run_simulator(job_dir, ws, n=n, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = json.loads(next(ws.rglob("results.json")).read_text())
    assert [r["round"] for r in res["rounds"]] == [0, 1]
    for r in res["rounds"]:  # the label-free measure of every site, every round
        assert sorted(r["train_loss"]) == r["sites"] and all(map(math.isfinite, r["train_loss"].values())), r
    assert np.isfinite(res["rounds"][-1]["val"]["macro"]["auc"])  # the kNN vote on the validation set
    assert "kNN vote" in res["scores_note"]
    encoder = res["encoder"]
    assert encoder.endswith(ENCODER_FILE) and "encoder" in (ws / "server/simulate_job/results.md").read_text()
    log = server_log(ws)
    assert "round 1: loss" in (ws / "site-1" / "log.txt").read_text() and "encoder written to" in log

    # the encoder of the global model that was best on validation (the kNN vote), named in results.json
    src = "best_FL_global_model.pt" if res.get("best") else "FL_global_model.pt"
    assert res["encoder_from"] == (
        f"the best on validation (after {res['best']['trained_rounds']} rounds)"
        if res.get("best")
        else "the last round's"
    )
    glob = torch.load(ws / "server/simulate_job/app_server" / src, weights_only=True)["model"]
    enc = torch.load(encoder, weights_only=True)
    assert set(enc) == {k[len("encoder.") :] for k in glob if k.startswith("encoder.")}
    assert all(torch.equal(v, glob[f"encoder.{k}"]) for k, v in enc.items())
    # beside it, the normalisation the stage's sites trained with (its job folder's dataset, resolved)
    from fedpartial.data.presets import resolve_dataset

    site_cfg = json.loads((job_dir / "app/config/config_fed_client.json").read_text())
    ds = resolve_dataset(site_cfg["executors"][0]["executor"]["args"]["dataset"])
    assert json.loads(Path(encoder + ".json").read_text()) == {"mean": ds.get("mean"), "std": ds.get("std")}

    # a supervised job of the bundle started from it: its server's model component with model.pretrained set
    cfg = json.loads((copy_job("fedavg_pl_ich", tmp_path / "sup") / "app/config/config_fed_server.json").read_text())
    args = next(c["args"] for c in cfg["components"] if c.get("id") == "model")
    warm, scratch = PartialLabelNet(**args, pretrained=encoder), PartialLabelNet(**args)
    x = torch.rand(4, int(args["in_channels"]), 32, 32)
    warm.eval(), scratch.eval()
    with torch.no_grad():
        assert not torch.allclose(warm.features(x), scratch.features(x), atol=1e-4)
    for k, v in enc.items():
        assert torch.equal(warm.encoder.state_dict()[k], v), k


def test_labelled_sites_only_leaves_an_unlabelled_site_out_and_set_changes_one_method_option(tmp_path):
    from types import SimpleNamespace

    from fedpartial.recipes import setting_override

    ctx = _site("u", [False, False, False], n=16, tmp=tmp_path)
    ctx.train = {"batch_size": 8, "local_steps": 1}
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    out = get_method("byol").make_trainer(ctx, {"sites": "labelled"}).train_round(0, 2, {})
    assert out.weight == 0 and out.steps == 0
    assert all(torch.equal(ctx.model.state_dict()[k], v) for k, v in before.items())
    assert get_method("byol").make_trainer(ctx, {}).train_round(0, 2, {}).steps == 1  # default: every site trains

    # job.py --set method_args.sites=labelled (what the benchmark's ablation passes) keeps the job's other options
    base = SimpleNamespace(method_args={"target_decay": 0.95, "fedema": True}, model=None)
    got = setting_override(base, {}, "method_args.sites=labelled")
    assert got == {"method_args": {"target_decay": 0.95, "fedema": True, "sites": "labelled"}}


def test_a_site_builds_its_model_without_reading_the_pretrained_file(tmp_path):
    """The server's initial global model holds the warm-start encoder and every site receives it before training:
    a hospital need not hold the file (a path of the coordinator's machine)."""
    from nvflare.apis.fl_context import FLContext

    from fedpartial.fl.executor import PartialLabelExecutor

    missing = str(tmp_path / "not_here" / ENCODER_FILE)
    ex = PartialLabelExecutor(dataset="ich_phantom", model={"arch": "small_cnn", "pretrained": missing})
    ex._check_options("job 'j'")
    ex.log_warning = ex.log_info = lambda ctx, msg: None
    ex._select_device(FLContext(), "h1")
    ex.classes, ex.seed = ["a", "b"], 0
    ex._build_model()
    assert ex.net.pretrained == missing  # what methods read (surgical keeps pretrained norm statistics)
    with pytest.raises(FileNotFoundError, match="pretrained weights not found"):  # where it is read: the server
        PartialLabelNet("small_cnn", 2, 3, pretrained=missing)


def test_job_py_reads_a_relative_pretrained_path_from_where_it_runs(tmp_path, monkeypatch):
    from fedpartial.recipes import pretrained_model

    (tmp_path / "enc.pt").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    errors = []
    got = pretrained_model({"arch": "small_cnn", "pretrained": "enc.pt"}, False, errors.append)
    assert got == {"arch": "small_cnn", "pretrained": str(tmp_path / "enc.pt")} and not errors
    pretrained_model({"pretrained": "gone.pt"}, False, errors.append)
    assert errors == [f"model.pretrained: gone.pt is not a file (a relative path is read from {tmp_path})"]
    assert pretrained_model({"pretrained": "/on/the/server/enc.pt"}, True, errors.append) is None  # --export
    assert pretrained_model({"pretrained": "https://example.org/w.pth"}, False, errors.append) is None
    assert pretrained_model({"arch": "small_cnn"}, False, errors.append) is None and len(errors) == 1


def test_job_py_refuses_an_unreadable_pretrained_file_in_one_line(tmp_path, capsys):
    from functools import partial

    from fedpartial.recipes import PartialLabelRecipe, job_main
    from fedpartial.table_settings import ich_phantom

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a model")
    recipe = partial(PartialLabelRecipe, **ich_phantom.SETTINGS, name="t", method="fedavg")
    with pytest.raises(SystemExit) as e:
        job_main(recipe, ["--set", f"model.pretrained={bad}", "--workspace", str(tmp_path / "ws")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"error: pretrained weights {bad} is not a PyTorch file (it starts with b'not ')"), err
    assert not (tmp_path / "ws").exists()  # nothing started
