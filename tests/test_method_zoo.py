"""Every registered method, on every task type it declares, runs two federated rounds in process through the job's
data pipeline (real PNG files, manifests, SiteDatasets with batched random views): three sites annotating
different classes (the third annotates nothing where the trainer accepts unlabelled sites), each site's
receive -> train_round -> export, then the method's server rule over the contributions with the model's real
parameter groups. What travels between them (site metadata, the rule's metadata) goes through NVFlare's FOBS
serialisation as a deployed job sends it; each site's state is saved and reloaded with ``weights_only=True`` into
a fresh trainer. The global model must change and stay finite. The same updates also go through the job's
own server component (``_Glue``: the site's MinCountFilter, the wire, ``PartialLabelAggregator``), which must
accept every site and give the rule's result: what a two-round simulator run of each method checked.

The server side's contract (docs/adding-a-method.md) is checked on every rule: ``aggregate`` gets the model the
sites received as ``previous`` and the groups the first contribution sent, and returns every key of ``previous``
with its shape and dtype (:func:`check_update`, the aggregator's own check); and its state survives a checkpoint:
the two rounds run straight through and the same two rounds split by a checkpoint file (``write_private`` /
``read_file``, the server checkpoint's own functions, ``weights_only`` reload; the rule's ``state_dict`` and the
metadata it sent, which the checkpoint stores once with the model) and a fresh rule give the same global model
and metadata. A rule that carries state across rounds without returning it from ``state_dict``
fails here.

The simulator tests (test_jobs_simulator.py and the method test files) run the NVFlare glue, which is the same
for every method; this test is where a method's own round trip is checked for all methods at once, in seconds.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from fake_sites import manifest_site
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.app_common.decomposers import numpy_decomposers
from nvflare.fuel.utils import fobs
from PIL import Image

from conftest import one_round_first_stage
from fedpartial.aggregation import check_update
from fedpartial.data.presets import resolve_dataset
from fedpartial.device import mixed_precision
from fedpartial.fl.aggregator import to_builtin
from fedpartial.fl.checkpoint import from_safe, read_file, write_private
from fedpartial.fl.keys import META_ANNOTATED, META_GROUPS, META_N_TRAIN, META_SUMMARY
from fedpartial.methods import Contribution, SiteContext, available_methods, get_method, load_all
from fedpartial.models import PartialLabelNet
from fedpartial.stat_checks import JobSize, check_statistics

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
    model = PartialLabelNet("small_cnn", len(ds["classes"]), 3, width=4, dropout=0.2)
    train = {"lr": 1e-2, "batch_size": 4, "local_steps": 2, "inference_batch_size": 8}
    return manifest_site(images, k, N, task, annotated, ds, model, train, state_dir, n_val=4)


def _summary(ctxs: list[SiteContext]) -> dict:
    sites = {}
    for ctx in ctxs:
        m = ctx.data.manifests["train"] if hasattr(ctx.data, "manifests") else None
        sites[ctx.site] = {
            "n_train": len(m),
            "annotated": m.annotated.tolist(),
            "positives": m.positives().tolist(),
            "negatives": m.negatives().tolist(),
            "n_val": 4,
            "n_test": 0,
            "eval_sets": {},
        }
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
    glue = _Glue(name, options, summary, init)  # the job's own server component, fed the same updates
    meta_out: dict = {META_SUMMARY: summary}
    steps = 0
    rounds: list[tuple] = []  # each round's rule inputs and outputs, for the checkpoint comparison
    for rnd in range(2):
        contributions = []
        for k, (ctx, tr) in enumerate(zip(ctxs, trainers)):
            tr.receive(global_w)
            out = tr.train_round(rnd, 2, dict(meta_out))
            steps += out.steps
            tr.has_local_state = True
            sent = _wire(
                DXO(
                    DataKind.WEIGHTS,
                    data=tr.export(),
                    meta={**out.meta, META_N_TRAIN: 12, META_ANNOTATED: ctx.annotated.tolist(), META_GROUPS: groups},
                )
            )
            why = check_statistics(
                sent.meta, method.statistic_specs(rule, options), JobSize(C, init.feature_dim, 3, 12)
            )
            assert why is None, f"{name}: {ctx.site}'s honest statistics break the method's declarations: {why}"
            glue.send(ctx.site, sent, float(out.weight), rnd, global_w)
            contributions.append(
                Contribution(
                    site=ctx.site,
                    weights={k2: np.asarray(v) for k2, v in sent.data.items()},
                    n=12,
                    meta=dict(sent.meta),
                    weight=float(out.weight),
                )
            )
            fresh = method.make_trainer(ctx, dict(options), f"zoo {name}")  # a new process of this site
            fresh.load_state_dict(_reload(tr.state_dict()))
        used = [c for c in contributions if c.weight > 0]
        assert used, f"{name}: every site sat round {rnd} out"
        inputs = copy.deepcopy((global_w, used, used[0].meta[META_GROUPS], rnd, summary))
        weights, meta = rule.aggregate(global_w, used, used[0].meta[META_GROUPS], rnd, summary)
        _check_output_contract(name, global_w, weights, meta)
        glue.check_round(rnd, global_w, weights, [c.site for c in used])
        rounds.append((inputs, (copy.deepcopy(weights), to_builtin(meta))))
        back = _wire(DXO(DataKind.WEIGHTS, data=weights, meta=to_builtin(meta)))
        global_w, meta_out = {k: np.asarray(v) for k, v in back.data.items()}, {**back.meta, META_SUMMARY: summary}
    assert steps > 0
    _check_rule_state_survives_a_checkpoint(method, options, rounds, tmp_path / "server")
    changed = [
        k for k, v in init.state_dict().items() if v.is_floating_point() and not np.allclose(global_w[k], v.numpy())
    ]
    assert changed, f"{name}: the global model did not change in two rounds"


class _Glue:
    """What each comparison method's two-round simulator run checked beyond this test, in process: every site's
    update goes through the site's result filter (``MinCountFilter``, minimum count 1 as those tiny jobs had) and
    NVFlare's wire format into the server's ``PartialLabelAggregator`` (the job's own component: sample counts,
    parameter groups, change bounds, the method's statistics declarations, then its rule). Every round every
    site must be accepted, none missing, no rule error, and the aggregate must equal the rule's own on the same
    updates."""

    def __init__(self, name: str, options: dict, summary: dict, model):
        from fedpartial.fl.aggregator import PartialLabelAggregator
        from fedpartial.fl.data_check import MinCountFilter

        self.name = name
        self.agg = PartialLabelAggregator(method=name, method_args=dict(options))
        assert self.agg.config_error is None, self.agg.config_error
        from test_stat_checks import _Engine

        comps = {"data_summary": type("Summary", (), {"summary": summary})(), "aggregator": self.agg, "model": model}
        self.engine = _Engine(comps, sorted(summary["sites"]))
        self.filter = MinCountFilter(min_count=1)

    def _ctx(self, rnd: int, prev: dict, site: str | None = None):
        from test_stat_checks import _ctx

        return _ctx(self.engine, rnd, prev, site)

    def send(self, site: str, sent: DXO, weight: float, rnd: int, prev: dict) -> None:
        from fedpartial.fl.keys import META_WEIGHT

        dxo = DXO(DataKind.WEIGHTS, data=dict(sent.data), meta={**sent.meta, META_WEIGHT: weight})
        ctx = self._ctx(rnd, prev, site)
        dxo = self.filter.process_dxo(dxo, dxo.to_shareable(), ctx)
        assert self.agg.accept(_wire(dxo).to_shareable(), ctx), f"{self.name}: {site} refused: {self.agg.rejected}"

    def check_round(self, rnd: int, prev: dict, expected: dict, used: list[str]) -> None:
        from fedpartial.fl.keys import META_MISSING, META_REJECTED, META_RULE_ERROR

        out = from_shareable(self.agg.aggregate(self._ctx(rnd, prev)))
        assert out.meta.get(META_RULE_ERROR) is None, f"{self.name}: {out.meta[META_RULE_ERROR]}"
        assert out.meta[META_REJECTED] == {} and out.meta[META_MISSING] == [], (self.name, out.meta[META_REJECTED])
        for k, v in expected.items():
            np.testing.assert_allclose(
                np.asarray(out.data[k], np.float64),
                np.asarray(v, np.float64),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{self.name}: the job's aggregator differs from the rule on {k} in round {rnd} (sites {used})",
            )


def _check_output_contract(name: str, previous: dict, weights: dict, meta: dict) -> None:
    """``aggregate``'s output: every key of ``previous`` with its shape and dtype, finite values (the aggregator's
    own check), and metadata that NVFlare can send."""
    why = check_update({k: np.asarray(v) for k, v in weights.items()}, previous)
    assert why is None, f"{name}: aggregate broke the output contract: {why}"
    assert isinstance(meta, dict), f"{name}: aggregate's meta is a {type(meta).__name__}"


def _same(a, b, where: str) -> None:
    """Recursive equality of rule outputs (arrays and floats to 1e-6 relative)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            f"{where}: keys {sorted(a)} vs {sorted(b) if isinstance(b, dict) else b}"
        )
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and any(isinstance(v, (str, dict, type(None))) for v in a):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, (list, tuple, np.ndarray, float, int)) and not isinstance(a, bool):
        x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        assert x.shape == y.shape and np.allclose(x, y, rtol=1e-6, atol=1e-7, equal_nan=True), f"{where} differs"
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _check_rule_state_survives_a_checkpoint(method, options: dict, rounds: list[tuple], folder: Path) -> None:
    """Round 0 with one rule, its ``state_dict`` through a checkpoint file into a FRESH rule, round 1 with that one:
    the round-1 output must equal the straight run's (same inputs)."""
    (inputs0, _), (inputs1, straight1) = rounds
    first = method.make_rule(dict(options), f"zoo {method.name}")
    first.check_federation(inputs0[4])
    _, sent = first.aggregate(*copy.deepcopy(inputs0))
    # as the server checkpoint: the rule's state, and the metadata it sent stored once, with the model
    write_private({"rule": first.state_dict(), "meta": to_builtin(sent)}, folder / "checkpoint.pt")
    ckpt = read_file(folder / "checkpoint.pt")
    restored = method.make_rule(dict(options), f"zoo {method.name}")
    restored.load_state_dict(ckpt["rule"])
    restored.load_sent_meta(from_safe(ckpt["meta"]))
    weights, meta = restored.aggregate(*copy.deepcopy(inputs1))
    _same(straight1[0], copy.deepcopy(weights), f"{method.name}: round-1 weights after a checkpoint")
    _same(straight1[1], to_builtin(meta), f"{method.name}: round-1 meta after a checkpoint (a rule state lost?)")


def test_one_state_format_through_a_checkpoint(tmp_path):
    """A rule's state with numpy arrays AND tensors survives a ``weights_only`` checkpoint, and ``load_state_dict``
    receives the same types in process and from the file (numpy arrays as tensors, tuples as lists)."""
    from fedpartial.methods import ServerRule, saved_form

    class Stateful(ServerRule):
        def __init__(self, **options):
            super().__init__(**options)
            self.state = {
                "np": np.arange(3, dtype=np.float32),
                "t": torch.ones(2, dtype=torch.int64),
                "x": np.float64(0.5),
                "pair": (1, "a"),
            }
            self.received: list[dict] = []

        def state_dict(self) -> dict:
            return self.state

        def load_state_dict(self, state: dict) -> None:
            self.received.append(state)

    rule = Stateful()
    write_private({"rule": rule.state_dict()}, tmp_path / "checkpoint.pt")
    rule.load_state_dict(read_file(tmp_path / "checkpoint.pt")["rule"])
    rule.load_state_dict(rule.state)  # in process, unconverted
    from_file, in_process = rule.received
    for got in (from_file, in_process):
        assert torch.is_tensor(got["np"]) and got["np"].dtype == torch.float32 and got["np"].tolist() == [0, 1, 2]
        assert torch.is_tensor(got["t"]) and got["t"].dtype == torch.int64
        assert got["x"] == 0.5 and type(got["x"]) is float and got["pair"] == [1, "a"]
    assert saved_form({"a": np.zeros(2)})["a"].dtype == torch.float64


def test_old_names_are_refused_with_a_pointer():
    """A renamed option is refused naming the new one; the old trainer hook name is refused when declared."""
    from dataclasses import dataclass

    from fedpartial.methods import OptionError, TrainerOptions
    from fedpartial.methods.baselines import SupervisedTrainer
    from fedpartial.options import build, opt

    @dataclass
    class Renamed(TrainerOptions):
        RENAMED: ClassVar[dict[str, str]] = {"old_name": "new_name"}
        new_name: float = opt(1.0, "the new name")

    with pytest.raises(OptionError, match="'old_name' was renamed 'new_name'"):
        build(Renamed, {"old_name": 2.0}, "test")
    assert build(Renamed, {"new_name": 2.0}, "test").new_name == 2.0
    with pytest.raises(TypeError, match="'supervised' is now called 'label_loss"):
        type("OldHook", (SupervisedTrainer,), {"supervised": lambda self, logits, batch: logits.sum()})


def test_readme_methods_table_lists_exactly_the_registered_methods():
    """The README's methods table is checked against the registry: a new method must add its row, a removed one
    must go."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    listed = {
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])
    }
    assert listed == set(available_methods()), (
        sorted(set(available_methods()) - listed),
        sorted(listed - set(available_methods())),
    )


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
    options = {
        **one_round_first_stage(method),
        **{k: v for k, v in STRONG_VIEW_OPTIONS.items() if k in method.option_names()},
    }
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
            with mixed_precision("cpu", ctx.train.amp):
                out = tr.train_round(rnd, 2, dict(meta_out))
            assert np.isfinite(out.loss), f"{name} {ctx.site} round {rnd}: loss {out.loss}"
            tr.has_local_state = True
            sent = _wire(
                DXO(
                    DataKind.WEIGHTS,
                    data=tr.export(),
                    meta={**out.meta, META_N_TRAIN: 12, META_ANNOTATED: ctx.annotated.tolist(), META_GROUPS: groups},
                )
            )
            contributions.append(
                Contribution(
                    site=ctx.site,
                    weights={k: np.asarray(v) for k, v in sent.data.items()},
                    n=12,
                    meta=dict(sent.meta),
                    weight=float(out.weight),
                )
            )
        weights, meta = rule.aggregate(global_w, [c for c in contributions if c.weight > 0], groups, rnd, summary)
        back = _wire(DXO(DataKind.WEIGHTS, data=weights, meta=to_builtin(meta)))
        assert all(np.all(np.isfinite(np.asarray(v, dtype=np.float64))) for v in back.data.values()), name
        global_w, meta_out = {k: np.asarray(v) for k, v in back.data.items()}, {**back.meta, META_SUMMARY: summary}
    changed = [
        k for k, v in init.state_dict().items() if v.is_floating_point() and not np.allclose(global_w[k], v.numpy())
    ]
    assert changed, f"{name}: the global model did not change in two rounds under amp"
