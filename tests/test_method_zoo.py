"""Every registered method, on every task type it declares, runs two federated rounds in process through the job's
data pipeline (real PNG files, manifests, SiteDatasets with batched random views): three sites annotating
different classes (the third annotates nothing where the trainer accepts unlabelled sites), each site's
receive -> train_round -> export, then the method's server rule over the contributions with the model's real
parameter groups. What travels between them (site metadata, the rule's metadata) goes through NVFlare's FOBS
serialisation as a deployed job sends it; each site's state is saved and reloaded with ``weights_only=True`` into
a fresh trainer, and so is the rule's state. The global model must change and stay finite.

The simulator tests (test_jobs_simulator.py and the method test files) run the NVFlare glue, which is the same
for every method; this test is where a method's own round trip is checked for all methods at once, in seconds.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.app_common.decomposers import numpy_decomposers
from nvflare.fuel.utils import fobs
from PIL import Image

from conftest import one_round_first_stage

from fedpartial.data.manifest import read_manifest, write_manifest
from fedpartial.data.presets import resolve_dataset
from fedpartial.data.sitedata import SiteDatasets
from fedpartial.fl.aggregator import to_builtin
from fedpartial.fl.keys import META_ANNOTATED, META_GROUPS, META_N_TRAIN, META_SUMMARY
from fedpartial.methods import Contribution, SiteContext, available_methods, get_method, load_all
from fedpartial.models import PartialLabelNet

load_all()
numpy_decomposers.register()  # as NVFlare's runtime does for jobs that send numpy arrays
PRESET = {"multilabel": "ich_phantom", "multiclass": "ham10000"}
N, SIZE = 16, 16
# FedIRM's setting: every site labels everything or nothing (data protocol labeled_unlabeled)
LABELLED_OR_NOT = {"fedirm", "fed_consistency", "fed_selftraining", "fedavg_labelled"}


def _cases():
    cases = []
    for name in available_methods():
        for task in get_method(name).trainer.tasks:
            cases.append(pytest.param(name, task, id=f"{name}-{task}"))
    return cases


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    rng = np.random.default_rng(0)
    for i in range(3 * N):
        Image.fromarray(rng.integers(0, 255, (SIZE, SIZE, 3), dtype=np.uint8)).save(root / f"{i}.png")
    return root


def _annotations(name: str, task: str, C: int, accepts_unlabelled: bool) -> list[np.ndarray]:
    if name in LABELLED_OR_NOT:
        return [np.ones(C, bool), np.zeros(C, bool), np.zeros(C, bool)]
    if task == "multilabel":
        sets = [[0, 1], [1, 2, 3], [] if accepts_unlabelled else [3, 4]]
    else:
        sets = [[0, 1, 2], [2, 3, 4], [] if accepts_unlabelled else [4, 5, 6]]
    return [np.isin(np.arange(C), s) for s in sets]


def _site(images: Path, k: int, task: str, annotated: np.ndarray, ds: dict, state_dir: Path) -> SiteContext:
    C = len(ds["classes"])
    rng = np.random.default_rng(k)
    if task == "multilabel":
        labels = (rng.random((N, C)) < 0.4).astype(float)
    else:  # single-label: rows whose class the site does not annotate are unlabelled rows
        labels = np.eye(C)[rng.integers(0, C, N)]
    mask = np.repeat(annotated[None], N, 0)
    rel = [f"{k * N + i}.png" for i in range(N)]
    write_manifest(images / f"site{k}_{task}.csv", rel, labels * mask, mask, ds["classes"],
                   splits=["train"] * 12 + ["val"] * 4)
    full = read_manifest(images / f"site{k}_{task}.csv", ds["classes"], data_root=images, task=task,
                         require_annotated=False)
    data = SiteDatasets({"train": full.subset("train"), "val": full.subset("val")}, ds)
    model = PartialLabelNet("small_cnn", C, 3, width=4, dropout=0.2)
    state_dir.mkdir(parents=True, exist_ok=True)
    return SiteContext(site=f"site-{k + 1}", task=task, classes=list(ds["classes"]), annotated=annotated, model=model,
                       data=data, device=torch.device("cpu"), state_dir=state_dir, seed=k,
                       train={"lr": 1e-2, "batch_size": 4, "local_steps": 2, "inference_batch_size": 8})


def _summary(ctxs: list[SiteContext]) -> dict:
    sites = {}
    for ctx in ctxs:
        m = ctx.data.manifests["train"] if hasattr(ctx.data, "manifests") else None
        sites[ctx.site] = {"n_train": len(m), "annotated": m.annotated.tolist(), "positives": m.positives().tolist(),
                           "negatives": m.negatives().tolist(), "n_val": 4, "n_test": 0, "eval_sets": {}}
    return {"classes": ctxs[0].classes, "sites": sites}


def _wire(obj):
    """What NVFlare sends: a DXO serialised with FOBS and read back."""
    return from_shareable(fobs.loads(fobs.dumps(obj.to_shareable())))


def _reload(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("name, task", _cases())
def test_every_method_runs_two_federated_rounds(name, task, images, tmp_path):
    method = get_method(name)
    ds = resolve_dataset({"preset": PRESET[task], "image_size": SIZE})
    C = len(ds["classes"])
    options = one_round_first_stage(method)  # round 1 is stage 2
    annotated = _annotations(name, task, C, method.trainer.accepts_unlabelled)
    ctxs = [_site(images, k, task, a, ds, tmp_path / f"s{k}") for k, a in enumerate(annotated)]
    summary = _summary(ctxs)
    torch.manual_seed(0)
    init = PartialLabelNet("small_cnn", C, 3, width=4, dropout=0.2)
    global_w = {k: v.numpy().copy() for k, v in init.state_dict().items()}
    groups = init.parameter_groups()
    trainers = []
    for ctx in ctxs:
        ctx.summary = summary
        trainers.append(method.make_trainer(ctx, dict(options), f"zoo {name}"))
    rule = method.make_rule(dict(options), f"zoo {name}")
    rule.check_federation(summary)
    meta_out: dict = {META_SUMMARY: summary}
    steps = 0
    for rnd in range(2):
        contributions = []
        for k, (ctx, tr) in enumerate(zip(ctxs, trainers)):
            tr.receive(global_w)
            out = tr.train_round(rnd, 2, dict(meta_out))
            steps += out.steps
            tr.has_local_state = True
            sent = _wire(DXO(DataKind.WEIGHTS, data=tr.export(), meta={
                **out.meta, META_N_TRAIN: 12, META_ANNOTATED: ctx.annotated.tolist(), META_GROUPS: groups}))
            contributions.append(Contribution(site=ctx.site, weights={k2: np.asarray(v) for k2, v in sent.data.items()},
                                              n=12, meta=dict(sent.meta), weight=float(out.weight)))
            fresh = method.make_trainer(ctx, dict(options), f"zoo {name}")  # a new process of this site
            fresh.load_state_dict(_reload(tr.state_dict()))
        used = [c for c in contributions if c.weight > 0]
        assert used, f"{name}: every site sat round {rnd} out"
        weights, meta = rule.aggregate(global_w, used, groups, rnd, summary)
        back = _wire(DXO(DataKind.WEIGHTS, data=weights, meta=to_builtin(meta)))
        assert set(back.data) == set(global_w)
        assert all(np.all(np.isfinite(np.asarray(v, dtype=np.float64))) for v in back.data.values()), name
        rule.load_state_dict(_reload(rule.state_dict()))
        global_w, meta_out = {k: np.asarray(v) for k, v in back.data.items()}, {**back.meta, META_SUMMARY: summary}
    assert steps > 0
    changed = [k for k, v in init.state_dict().items() if v.is_floating_point() and not np.allclose(global_w[k], v.numpy())]
    assert changed, f"{name}: the global model did not change in two rounds"


# ------------------------------------------------------------------------------------------ mixed precision

STRONG_VIEW_OPTIONS = {"view": "strong", "feature_view": "strong"}  # every augmented view strong where optional


@pytest.mark.parametrize("name, task", _cases())
def test_every_method_trains_two_rounds_under_bfloat16_autocast(name, task, images, tmp_path):
    """``train.amp``: the same two federated rounds with every site's round under bfloat16 autocast, as the executor
    runs it (``torch.autocast`` of the training device, here the CPU), with strong views wherever the method lets
    the view be chosen. Every round's loss and the global model stay finite, and the model changes."""
    method = get_method(name)
    ds = resolve_dataset({"preset": PRESET[task], "image_size": SIZE})
    C = len(ds["classes"])
    options = {**one_round_first_stage(method),
               **{k: v for k, v in STRONG_VIEW_OPTIONS.items() if k in method.option_names()}}
    annotated = _annotations(name, task, C, method.trainer.accepts_unlabelled)
    ctxs = [_site(images, k, task, a, ds, tmp_path / f"s{k}") for k, a in enumerate(annotated)]
    summary = _summary(ctxs)
    torch.manual_seed(0)
    init = PartialLabelNet("small_cnn", C, 3, width=4, dropout=0.2)
    with torch.no_grad():  # confident outputs (|logit| 9): probabilities within bfloat16's spacing of 0 and 1
        init.classifier.bias.copy_(9.0 * (1 - 2 * (torch.arange(C) % 2)))
    global_w = {k: v.numpy().copy() for k, v in init.state_dict().items()}
    groups = init.parameter_groups()
    trainers = []
    for ctx in ctxs:
        ctx.summary, ctx.train = summary, {**vars(ctx.train), "amp": True}
        trainers.append(method.make_trainer(ctx, dict(options), f"amp {name}"))
    rule = method.make_rule(dict(options), f"amp {name}")
    meta_out: dict = {META_SUMMARY: summary}
    for rnd in range(2):
        contributions = []
        for ctx, tr in zip(ctxs, trainers):
            tr.receive(global_w)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ctx.train.amp):
                out = tr.train_round(rnd, 2, dict(meta_out))
            assert np.isfinite(out.loss), f"{name} {ctx.site} round {rnd}: loss {out.loss}"
            tr.has_local_state = True
            sent = _wire(DXO(DataKind.WEIGHTS, data=tr.export(), meta={
                **out.meta, META_N_TRAIN: 12, META_ANNOTATED: ctx.annotated.tolist(), META_GROUPS: groups}))
            contributions.append(Contribution(site=ctx.site, weights={k: np.asarray(v) for k, v in sent.data.items()},
                                              n=12, meta=dict(sent.meta), weight=float(out.weight)))
        weights, meta = rule.aggregate(global_w, [c for c in contributions if c.weight > 0], groups, rnd, summary)
        back = _wire(DXO(DataKind.WEIGHTS, data=weights, meta=to_builtin(meta)))
        assert all(np.all(np.isfinite(np.asarray(v, dtype=np.float64))) for v in back.data.values()), name
        global_w, meta_out = {k: np.asarray(v) for k, v in back.data.items()}, {**back.meta, META_SUMMARY: summary}
    changed = [k for k, v in init.state_dict().items() if v.is_floating_point() and not np.allclose(global_w[k], v.numpy())]
    assert changed, f"{name}: the global model did not change in two rounds under amp"
