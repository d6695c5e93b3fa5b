"""The method framework: site hooks (receive / export / participation), parameter groups by module type, norm
policies (FedAvg / FedBN / FedBN+), checked options, the job spec check, seeds, and a server rule that raises."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants
from test_fedmlp import _site  # a fake multi-label site (images with class signal)
from torch import nn

from fedpartial.fl.aggregator import PartialLabelAggregator
from fedpartial.fl.executor import PartialLabelExecutor
from fedpartial.fl.keys import META_GROUPS, META_N_TRAIN, META_RULE_ERROR, META_WEIGHT
from fedpartial.fl.spec import job_spec, spec_mismatch
from fedpartial.methods import Contribution, OptionError, ServerRule, SiteContext, get_method, register
from fedpartial.methods.baselines import SupervisedTrainer
from fedpartial.models import PartialLabelNet, parameter_groups
from fedpartial.seeding import site_seed

# ------------------------------------------------------------------------------------------ options


def test_misspelled_method_option_names_key_and_closest():
    m = get_method("fedmlp")
    with pytest.raises(OptionError) as e:
        m.split_options({"warmup_round": 5}, "job 'fedmlp_ich', site 'site-1', executor")
    msg = str(e.value)
    assert "job 'fedmlp_ich'" in msg and "executor" in msg and "'warmup_round'" in msg
    assert "did you mean 'warmup_rounds'" in msg
    assert m.split_options({"warmup_rounds": 5, "proto_weighting": "samples"}) == (
        {"warmup_rounds": 5},
        {"proto_weighting": "samples"},
    )


@pytest.mark.parametrize(
    "key,closest", [("local_epoch", "local_epochs"), ("optimiser", "optimizer"), ("batchsize", "batch_size")]
)
def test_misspelled_train_option_is_an_error(key, closest):
    with pytest.raises(OptionError, match=f"'{key}'.*did you mean '{closest}'"):
        SiteContext(
            site="s",
            task="multilabel",
            classes=["a"],
            annotated=np.ones(1, bool),
            model=None,
            data=None,
            device=torch.device("cpu"),
            state_dir=Path("."),
            train={key: 1},
        )
    with pytest.raises(OptionError, match="learning_rate"):  # no close name: the valid ones are listed
        SiteContext(
            site="s",
            task="multilabel",
            classes=["a"],
            annotated=np.ones(1, bool),
            model=None,
            data=None,
            device=torch.device("cpu"),
            state_dir=Path("."),
            train={"learning_rate": 0.1},
        )


def test_option_types_and_choices_are_checked():
    m = get_method("fedlsm")
    ctx = _site("s", [True, False, True])
    with pytest.raises(OptionError, match="'ue' must be bool"):
        m.make_trainer(ctx, {"ue": "false"})
    with pytest.raises(OptionError, match="'awpa' must be one of"):
        m.make_rule({"awpa": "adaptiv"})
    with pytest.raises(OptionError, match="must be one of 'adam', 'sgd'"):
        ctx.train = {"optimizer": "adamw"}


def test_executor_checks_its_options_before_anything_runs():
    ex = PartialLabelExecutor(dataset="ich_phantom", method="fedavg", train={"local_epoch": 2})
    with pytest.raises(OptionError, match="job 'j'.*'train'.*'local_epoch'.*did you mean 'local_epochs'"):
        ex._check_options("job 'j', site 'site-1', executor")
    ex = PartialLabelExecutor(dataset="ich_phantom", method="fedavg", evaluation={"test_evry": 2})
    with pytest.raises(OptionError, match="did you mean 'test_every'"):
        ex._check_options("job 'j'")


@pytest.mark.parametrize("amp", [False, True])
def test_train_amp_runs_the_local_round_under_bfloat16_autocast(amp):
    """``train.amp``: the executor runs the method's round under bfloat16 autocast (on this CPU as on a GPU), so a
    convolution inside the round computes in bfloat16; without it in float32. The weights stay float32."""
    ex = PartialLabelExecutor(dataset="ich_phantom", method="fedavg", train={"amp": amp})
    ex._check_options("job 'j'")
    ex.torch_device = torch.device("cpu")
    conv, seen = nn.Conv2d(3, 4, 3), {}

    class Recorder:
        def train_round(self, rnd, num_rounds, meta):
            seen["dtype"] = conv(torch.randn(1, 3, 8, 8)).dtype
            return "out"

    ex.trainer = Recorder()
    assert ex._train_round(0, 1, {}) == "out"
    assert seen["dtype"] == (torch.bfloat16 if amp else torch.float32) and conv.weight.dtype == torch.float32


def test_unknown_method_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'fedmlp'"):
        get_method("fedmpl")


# ------------------------------------------------------------------------------------------ job spec


def test_spec_mismatch_between_server_and_site():
    server = job_spec("fedavg", {}, {"arch": "small_cnn", "in_channels": 3})
    assert spec_mismatch(server, job_spec("fedavg", {}, {"arch": "small_cnn"})) is None  # defaults filled in
    assert "server runs method 'fedavg', this site 'fedmlp'" in spec_mismatch(server, job_spec("fedmlp", {}, {}))
    a, b = job_spec("fedmlp", {"warmup_rounds": 5}, {}), job_spec("fedmlp", {"warmup_rounds": 50}, {})
    assert "warmup_rounds = 5 at the server, 50 here" in spec_mismatch(a, b)
    assert "width = 16 at the server, 8 here" in spec_mismatch(server, job_spec("fedavg", {}, {"width": 8}))


# ------------------------------------------------------------------------------------------ seeds


def test_site_seeds_from_a_stable_hash_of_the_name():
    a, b = site_seed(0, "hospital-a"), site_seed(0, "hospital-b")
    assert a != b  # the old digit-based seed gave both 0
    expected = int.from_bytes(hashlib.sha256(b"0/hospital-a").digest()[:4], "big") & 0x7FFFFFFF
    assert a == expected and site_seed(1, "hospital-a") != a


# ------------------------------------------------------------------------------------------ parameter groups


class _OddNames(nn.Module):
    """Names that would fool a name-based split: a conv called 'bn', a norm called 'classifier_norm'."""

    def __init__(self):
        super().__init__()
        self.bn = nn.Conv2d(3, 4, 3)
        self.classifier_norm = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.hidden = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        self.classifier = nn.Linear(4, 2)


def test_parameter_groups_by_module_type():
    g = parameter_groups(_OddNames())
    assert g["encoder"] == ["bn.weight", "bn.bias"]
    assert set(g["norm"]) == {
        "classifier_norm.weight",
        "classifier_norm.bias",
        "inorm.weight",
        "inorm.bias",
        "inorm.running_mean",
        "inorm.running_var",
        "inorm.num_batches_tracked",
        "hidden.1.weight",
        "hidden.1.bias",
        "hidden.1.running_mean",
        "hidden.1.running_var",
        "hidden.1.num_batches_tracked",
    }
    assert g["head"] == ["hidden.0.weight", "hidden.0.bias"]
    assert g["classifier"] == ["classifier.weight", "classifier.bias"]


def test_inference_batch_defaults_to_the_training_batch_on_cpu_and_4x_on_gpu():
    from fedpartial.models import default_inference_batch_size

    assert default_inference_batch_size(32, "cpu") == 32 and default_inference_batch_size(32, "cuda") == 128
    assert default_inference_batch_size(8, torch.device("cuda", 0)) == 32


def test_surgical_head_is_a_model_option():
    net = PartialLabelNet("small_cnn", 3, 3, width=4, head_hidden=256, head_dropout=0.3)
    g = net.parameter_groups()
    assert g["head"] == ["hidden.0.weight", "hidden.0.bias"] and net.classifier.in_features == 256
    assert net(torch.zeros(2, 3, 16, 16)).shape == (2, 3)


# ------------------------------------------------------------------------------------------ site hooks


def _global_like(model: nn.Module, value: float) -> dict:
    return {k: np.full(tuple(v.shape), value, dtype=v.detach().numpy().dtype) for k, v in model.state_dict().items()}


def test_fedbn_receive_keeps_the_sites_norm_statistics_across_rounds():
    ctx = _site("site-1", [True, True, False], n=16)
    tr = SupervisedTrainer(ctx, norm="local")
    groups = ctx.model.parameter_groups()
    tr.receive(_global_like(ctx.model, 0.5))  # first round: everything loaded (no local state yet)
    assert all(np.allclose(v.numpy(), 0.5) for v in ctx.model.state_dict().values() if v.is_floating_point())
    tr.train_round(0, 2, {})
    tr.has_local_state = True  # as the executor marks it after a round
    local_norm = {k: ctx.model.state_dict()[k].clone() for k in groups["norm"]}
    assert any(
        not torch.allclose(v.float(), torch.full_like(v.float(), 0.5)) for k, v in local_norm.items() if "running" in k
    )
    tr.receive(_global_like(ctx.model, 2.0))  # round 2: a new encoder, the site's own norm layers
    state = ctx.model.state_dict()
    for k in groups["norm"]:
        assert torch.equal(state[k], local_norm[k]), k
    for k in groups["encoder"] + groups["classifier"]:
        assert np.allclose(state[k].numpy(), 2.0), k
    # FedAvg (norm: average) loads the received norm layers
    plain = SupervisedTrainer(_site("site-2", [True, True, False], n=16))
    plain.has_local_state = True
    plain.receive(_global_like(plain.ctx.model, 2.0))
    assert all(
        np.allclose(plain.ctx.model.state_dict()[k].numpy(), 2.0) for k in groups["norm"] if "num_batches" not in k
    )


def test_pfl_keeps_the_local_classifier():
    ctx = _site("site-1", [True, True, False], n=16)
    tr = SupervisedTrainer(ctx, keep_local=["classifier"])
    tr.has_local_state = True
    before = ctx.model.classifier.weight.detach().clone()
    tr.receive(_global_like(ctx.model, 1.0))
    assert torch.equal(ctx.model.classifier.weight, before)
    assert np.allclose(ctx.model.state_dict()["encoder.body.0.weight"].numpy(), 1.0)


def test_fedbn_plus_freezes_norm_layers_in_training_and_at_the_server():
    ctx = _site("site-1", [True, True, False], n=16)
    tr = SupervisedTrainer(ctx, norm="frozen")
    groups = ctx.model.parameter_groups()
    before = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    tr.train_round(0, 1, {})
    after = ctx.model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in groups["norm"])  # statistics and affine frozen
    assert not torch.equal(after["encoder.body.0.weight"], before["encoder.body.0.weight"])
    rule = get_method("fedavg").make_rule({"norm": "frozen"})
    prev = {k: v.numpy() for k, v in before.items()}
    moved = {k: v + 1 if np.issubdtype(v.dtype, np.floating) else v for k, v in prev.items()}
    out, _ = rule.aggregate(prev, [Contribution("a", moved, 10.0, {})], groups, 0)
    assert all(np.array_equal(out[k], prev[k]) for k in groups["norm"])
    assert np.allclose(out["encoder.body.0.weight"], prev["encoder.body.0.weight"] + 1)


def test_site_weighting_uniform_and_participation():
    rule = ServerRule(site_weighting="uniform")
    cons = [Contribution("a", {"w": np.array([0.0])}, 10.0, {}), Contribution("b", {"w": np.array([3.0])}, 30.0, {})]
    assert rule.aggregate(None, cons, {}, 0)[0]["w"][0] == pytest.approx(1.5)
    assert ServerRule().aggregate(None, cons, {}, 0)[0]["w"][0] == pytest.approx(2.25)
    cons[1].weight = 0.5  # half weight this round: a_b = 30 * 0.5
    assert ServerRule().aggregate(None, cons, {}, 0)[0]["w"][0] == pytest.approx(45 / 25)


# ------------------------------------------------------------------------------------------ the aggregator


class _Engine:
    def __init__(self, components=None):
        self.components = components or {}

    def get_component(self, cid):
        return self.components.get(cid)

    def fire_event(self, event_type, fl_ctx):
        pass


def _ctx(previous: dict, rnd: int) -> FLContext:
    fl_ctx = FLContext()
    fl_ctx.set_prop(ReservedKey.ENGINE, _Engine(), private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, {ModelLearnableKey.WEIGHTS: previous}, private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
    return fl_ctx


def _send(agg: PartialLabelAggregator, fl_ctx: FLContext, site: str, value: float, n: float, weight: float = 1.0):
    peer = FLContext()
    peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=True, sticky=False)
    fl_ctx.set_peer_context(peer)
    meta = {META_N_TRAIN: n, META_WEIGHT: weight, META_GROUPS: {"classifier": []}, "annotated": [True]}
    assert agg.accept(DXO(DataKind.WEIGHTS, {"w": np.array([value], np.float32)}, meta).to_shareable(), fl_ctx)


def test_participation_weight_zero_leaves_the_average_of_the_others():
    agg = PartialLabelAggregator("fedavg")
    prev = {"w": np.array([0.0], np.float32)}
    fl_ctx = _ctx(prev, 3)
    _send(agg, fl_ctx, "site-1", 1.0, 10)
    _send(agg, fl_ctx, "site-2", 4.0, 30)
    _send(agg, fl_ctx, "site-3", 100.0, 60, weight=0.0)  # sits the round out
    out = from_shareable(agg.aggregate(fl_ctx))
    assert out.data["w"][0] == pytest.approx((10 * 1 + 30 * 4) / 40)
    assert out.meta["fedpartial_sat_out"] == ["site-3"]


class _Exploding(ServerRule):
    calls = 0

    def aggregate(self, previous, contributions, groups, round_num, summary=None):
        type(self).calls += 1
        if type(self).calls == 1:
            return super().aggregate(previous, contributions, groups, round_num)[0], {"kept": [1, 2]}
        raise RuntimeError("boom")


def test_a_rule_that_raises_keeps_the_previous_model_and_meta_then_stops_cleanly():
    register("exploding_test_rule", SupervisedTrainer, _Exploding)
    agg = PartialLabelAggregator("exploding_test_rule", max_rule_failures=2)
    panics = []
    agg.system_panic = lambda reason, fl_ctx: panics.append(reason)
    prev = {"w": np.array([0.0], np.float32)}
    fl_ctx = _ctx(prev, 0)
    _send(agg, fl_ctx, "site-1", 2.0, 10)
    first = from_shareable(agg.aggregate(fl_ctx))
    assert first.data["w"][0] == pytest.approx(2.0) and first.meta["kept"] == [1, 2]
    for rnd in (1, 2):
        fl_ctx = _ctx(first.data, rnd)
        _send(agg, fl_ctx, "site-1", 7.0, 10)
        out = from_shareable(agg.aggregate(fl_ctx))
        assert out.data["w"][0] == pytest.approx(2.0)  # previous model kept
        assert out.meta["kept"] == [1, 2]  # previous method meta kept (sites keep e.g. their prototypes)
        assert f"round {rnd}: RuntimeError: boom" in out.meta[META_RULE_ERROR]
        assert len(panics) == (rnd - 1)  # the second consecutive failure stops the job
    assert "failed 2 rounds in a row" in panics[0]


def test_option_errors_reach_the_server_side_too():
    agg = PartialLabelAggregator("fedavg_masked", {"row_weight": "uniform"})
    panics = []
    agg.system_panic = lambda reason, fl_ctx: panics.append(reason)
    fl_ctx = _ctx({}, 0)
    fl_ctx.set_prop(ReservedKey.JOB_META, {"name": "fedavg_masked_ich"}, private=True, sticky=False)
    agg.handle_event("_start_run", fl_ctx)
    assert agg.rule is None and len(panics) == 1
    assert re.search(
        "job 'fedavg_masked_ich'.*server aggregator.*'row_weight'.*did you mean 'row_weighting'", panics[0]
    )


# ------------------------------------------------------------------------------------------ site roles


def _manifest(tmp_path: Path, header: str, rows: list[str]) -> Path:
    from PIL import Image

    for i in range(len(rows)):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{i}.png")
    path = tmp_path / "train.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("accepts", [False, True])
def test_unlabelled_site_only_where_the_trainer_accepts_it(tmp_path, accepts):
    class Semi(SupervisedTrainer):
        accepts_unlabelled = True

    ex = PartialLabelExecutor(dataset="ich_phantom")
    ex.method_spec = SimpleNamespace(trainer=Semi if accepts else SupervisedTrainer)
    ex.classes, ex.task_type = ["a", "b"], "multilabel"
    train = _manifest(tmp_path, "image", ["0.png", "1.png"])  # a plain list of images
    ex.site_data = SimpleNamespace(data_root=tmp_path, train=train, val=None, test=None, vocabulary={})
    if accepts:
        ex._read_manifests("site-9")
        assert len(ex.manifests["train"]) == 2 and not ex.manifests["train"].annotated.any()
    else:
        with pytest.raises(ValueError, match="no class is annotated"):
            ex._read_manifests("site-9")


def test_new_job_writes_one_checked_spec_to_both_sides(tmp_path):
    import json

    from fedpartial.tools.new_job import write_job

    with pytest.raises(OptionError, match="job 'bad'.*'warmup_round'.*did you mean 'warmup_rounds'"):
        write_job(tmp_path / "bad", "fedmlp", {"preset": "ich_phantom"}, 3, method_args={"warmup_round": 2})
    assert not (tmp_path / "bad").exists()  # nothing half-written
    job = write_job(tmp_path / "ok", "fedmlp", {"preset": "ich_phantom"}, 3, method_args={"warmup_rounds": 2})
    server = json.loads((job / "app/config/config_fed_server.json").read_text())
    client = json.loads((job / "app/config/config_fed_client.json").read_text())
    agg = next(c for c in server["components"] if c["id"] == "aggregator")["args"]
    ex = client["executors"][0]["executor"]["args"]
    assert server["method"] == client["method"] == "fedmlp" and agg["method_args"] == ex["method_args"]


# ------------------------------------------------------------------------------------------ FedProx


def test_fedprox_term_and_gradient_by_hand():
    from fedpartial.methods.fedprox import FedProxTrainer

    ctx = _site("site-1", [True, True, False], n=8)
    tr = FedProxTrainer(ctx, mu=0.5)
    tr.start_round(0, {})
    with torch.no_grad():
        ctx.model.classifier.bias += torch.tensor([1.0, -2.0, 0.0])  # the only change since receiving
    term = tr.extra_loss({}, None, None)
    assert float(term) == pytest.approx(0.5 / 2 * (1.0 + 4.0))  # mu/2 * ||w - w_global||^2
    term.backward()
    assert torch.allclose(ctx.model.classifier.bias.grad, 0.5 * torch.tensor([1.0, -2.0, 0.0]))  # mu (w - w_g)
    # without the term (mu = 0) a round trains exactly as fedavg_pl from the same start and seed
    start = {k: v.clone() for k, v in _site("a", [True, True, False], n=8).model.state_dict().items()}
    finals = []
    for trainer_cls, opts in ((FedProxTrainer, {"mu": 0.0}), (SupervisedTrainer, {})):
        c = _site("a", [True, True, False], n=8)
        c.model.load_state_dict(start)
        torch.manual_seed(0)
        trainer_cls(c, **opts).train_round(0, 1, {})
        finals.append(c.model.classifier.weight.detach().clone())
    assert torch.allclose(finals[0], finals[1])


def test_what_the_global_model_holds_is_stated():
    from fedpartial.fl.spec import global_model_note, local_parts

    assert local_parts("fedavg", {}) == [] and global_model_note([]) is None
    assert local_parts("fedavg_pl", {"norm": "local"}) == ["norm"]
    assert local_parts("fedavg_pl", {"keep_local": ["classifier"]}) == ["classifier"]
    assert "sites' average of the norm layers" in global_model_note(["norm"])


# ------------------------------------------------------------------------------------------ shared building blocks


def test_class_average_over_the_sites_holding_each_class_by_hand():
    from fedpartial.aggregation import class_average

    values = np.array(
        [
            [[1.0, 1.0], [2.0, 2.0], [9.0, 9.0]],  # site A: (C=3, D=2)
            [[3.0, 5.0], [0.0, 0.0], [7.0, 7.0]],
        ]
    )  # site B
    holds = np.array(
        [
            [1.0, 2.0, 0.0],  # A holds classes 0, 1 (weight 2 on class 1)
            [3.0, 0.0, 0.0],
        ]
    )  # B holds class 0 only; nobody holds class 2
    avg, held = class_average(values, holds)
    assert np.allclose(avg[0], [(1 * 1 + 3 * 3) / 4, (1 * 1 + 3 * 5) / 4]) and np.allclose(avg[1], [2.0, 2.0])
    assert np.allclose(avg[2], 0.0) and held.tolist() == [True, True, False]


def test_mc_dropout_predictive_entropy_by_hand():
    from fedpartial.methods.common import binary_entropy, mc_dropout_probs, predictive_entropy, softmax_entropy

    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    assert torch.allclose(softmax_entropy(p), torch.tensor([np.log(2.0), 0.0], dtype=torch.float32))
    assert torch.allclose(
        binary_entropy(torch.tensor([0.5, 0.0])), torch.tensor([np.log(2.0), 0.0], dtype=torch.float32)
    )
    assert torch.allclose(predictive_entropy(p, "multiclass"), softmax_entropy(p))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)
            self.drop = nn.Dropout(0.5)
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(self.drop(self.bn(x)))

    net = Net().train()
    x = torch.randn(6, 4)
    torch.manual_seed(0)
    probs = mc_dropout_probs(net, x, passes=8, task="multiclass")
    assert probs.shape == (8, 6, 3)
    assert not torch.allclose(probs[0], probs[1])  # dropout is active during the passes
    assert int(net.bn.num_batches_tracked) == 0  # BatchNorm ran in eval mode (no statistics updated)
    assert net.training and net.drop.training and net.bn.training  # modes restored
    net.eval()
    assert torch.allclose(mc_dropout_probs(net, x, 2, "multiclass")[0].sum(1), torch.ones(6))
    assert not net.drop.training  # restored to eval


def test_a_shared_evaluation_set_is_scored_by_one_site_and_a_local_one_by_its_own():
    from fedpartial.data.manifest import Manifest
    from fedpartial.fl.results import data_record
    from fedpartial.fl.scoring import scorer_of

    def manifest(paths, labels):
        labels = np.asarray(labels, np.float32)
        return Manifest(
            paths=paths,
            labels=labels,
            mask=np.ones_like(labels, bool),
            classes=["a", "b"],
            patient_ids=[""] * len(paths),
            splits=["val"] * len(paths),
            lines=list(range(2, 2 + len(paths))),
        )

    central = manifest(["/d/1.png", "/d/2.png"], [[1, 0], [0, 1]])
    same = manifest(["/d/1.png", "/d/2.png"], [[1, 0], [0, 1]])
    relabelled = manifest(["/d/1.png", "/d/2.png"], [[1, 0], [1, 1]])  # same images, other labels: another set
    own = manifest(["/h/9.png"], [[0, 1]])
    assert central.fingerprint() == same.fingerprint() != relabelled.fingerprint()
    sites = {
        "site-b": {"eval_sets": {"val": central.fingerprint()}},
        "site-a": {"eval_sets": {"val": same.fingerprint()}},
        "site-c": {"eval_sets": {"val": own.fingerprint()}},
        "site-d": {"eval_sets": {}},
    }
    assert scorer_of("val", central.fingerprint(), sites) == "site-a"  # first by name, whatever the order
    assert scorer_of("val", own.fingerprint(), sites) == "site-c"  # a site's own set is its own
    assert scorer_of("test", central.fingerprint(), sites) is None  # nobody reports it: score where it is
    rec = data_record({**{s: {**v, "n_train": 1, "annotated": [True, False]} for s, v in sites.items()}})
    assert rec["shared_eval_sets"]["val"] == [["site-a", "site-b"]] and rec["sites"]["site-a"]["annotated"] == [0]
    assert central.fingerprint() not in json.dumps(rec)  # fingerprints are not written to results.json


def test_mean_local_validation_loss_over_each_sites_own_classes_by_hand():
    from fedpartial.fl.selection import mean_site_loss

    classes = ["a", "b", "c"]
    shared = {"per_class": {"a": {"bce": 0.2}, "b": {"bce": 0.4}, "c": {"bce": 0.9}}}
    own = {"per_class": {"a": {"bce": 1.0}, "b": {"bce": None}, "c": {"bce": 3.0}}}
    sites = {
        "s1": {"annotated": [True, True, False], "eval_sets": {"val": "F"}},  # scored the shared set
        "s2": {"annotated": [False, False, True], "eval_sets": {"val": "F"}},  # same set, scored by s1
        "s3": {"annotated": [True, True, True], "eval_sets": {"val": "G"}},  # its own set; b undefined
        "s4": {"annotated": [True, False, False], "eval_sets": {}},
    }  # no validation data: left out
    # s1: (0.2 + 0.4) / 2 = 0.3; s2: 0.9 (class c on the shared set); s3: (1.0 + 3.0) / 2 = 2.0
    assert mean_site_loss({"s1": shared, "s3": own}, sites, classes) == pytest.approx((0.3 + 0.9 + 2.0) / 3)
    assert mean_site_loss({}, sites, classes) is None


def test_early_stopping_ends_training_after_patience_rounds_without_a_better_model(tmp_path, data_cache):
    """lr 0: the global model never changes, so after the first scored round (round 1) nothing is better; with
    patience 1 and selection by the mean local validation loss the job stops after round 2 of 5, and still runs
    the final evaluation."""
    from conftest import copy_job, results_of, run_simulator, server_log

    job = copy_job(
        "fedavg_pl_ich",
        tmp_path / "job",
        5,
        {
            "dataset": {
                "image_size": 32,
                "prepare": {"k": 0, "source_args": {"n_images": 120, "size": 32, "seed": 0}},
            },
            "train": {"batch_size": 16, "lr": 0.0},
        },
        sites=1,  # every site is a process: the selection and the stop are the server's
    )
    server = job / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(server.read_text())
    for comp in cfg["components"]:
        if comp["id"] == "model_selector":
            comp["args"] = {"key_metric": "site_bce", "patience": 1}
    server.write_text(json.dumps(cfg))
    ws = tmp_path / "ws"
    proc = run_simulator(job, ws, n=1, env={"FEDPARTIAL_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stderr[-3000:] + server_log(ws)[-3000:]
    res = results_of(ws)
    assert res["num_rounds"] == 3  # rounds 0, 1, 2 of 5
    assert res["best"]["trained_rounds"] == 1 and res["best"]["metric"] == "site_bce"
    assert res["early_stopping"] == {"patience": 1, "best_round": 1, "stopped": True, "last_round": 2}
    assert "early stopping after round 2" in server_log(ws)
    assert res["final"]["FL_global_model.pt"]["test"] is not None


def test_fedrs_restricted_softmax_by_hand():
    import math

    from fedpartial.methods.fedrs import logit_scales, restricted_softmax_ce

    logits = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.0, 3.0]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 2: its class is not annotated here
    mask = torch.tensor([[True, False, True], [True, False, True]])
    counts = torch.tensor([6.0, 0.0, 2.0])  # the site's labelled images per class
    scales = logit_scales(counts, 0.5)
    assert torch.equal(scales, torch.tensor([1.0, 0.5, 1.0]))  # the paper: by presence
    # the released code: alpha + (1 - alpha) * cnt / max cnt = 0.5 + 0.5 * [1, 0, 1/3]
    assert torch.allclose(logit_scales(counts, 0.5, "counts"), torch.tensor([1.0, 0.5, 0.5 + 0.5 / 3]))
    loss = restricted_softmax_ce(logits, labels, mask, scales)
    # row 1 only; the not-owned class's logit 1.0 -> 0.5: -log(e^2 / (e^2 + e^0.5 + e^0))
    assert float(loss) == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + math.exp(0.5) + 1.0)))
    loss.backward()
    p = torch.softmax(torch.tensor([2.0, 0.5, 0.0]), 0)
    # d/dz_c: (p_c - y_c) * scale_c; the not-owned class's gradient is halved
    assert torch.allclose(logits.grad[0], (p - torch.tensor([1.0, 0, 0])) * torch.tensor([1.0, 0.5, 1.0]), atol=1e-6)
    assert torch.equal(logits.grad[1], torch.zeros(3))
    plain = restricted_softmax_ce(logits, labels, mask, logit_scales(counts, 1.0))  # alpha 1: plain cross-entropy
    assert float(plain) == pytest.approx(float(torch.nn.functional.cross_entropy(logits[:1], torch.tensor([0]))))
    with pytest.raises(OptionError, match="alpah"):
        get_method("fedrs").split_options({"alpah": 0.5})


def test_moon_contrastive_term_by_hand_and_previous_model_kept_as_site_state(tmp_path):
    import math

    from fedpartial.methods.moon import model_contrastive_loss

    z = torch.tensor([[1.0, 0.0]])
    z_glob = torch.tensor([[1.0, 1.0]])  # cos 45 deg = 1/sqrt(2)
    z_prev = torch.tensor([[0.0, 1.0]])  # cos 90 deg = 0
    pos, neg = (1 / math.sqrt(2)) / 0.5, 0.0
    expected = -math.log(math.exp(pos) / (math.exp(pos) + math.exp(neg)))
    assert float(model_contrastive_loss(z, z_glob, z_prev, tau=0.5)) == pytest.approx(expected)
    # closer to the global representation at the same similarity to the previous one -> lower loss
    g, prev = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0]])
    assert model_contrastive_loss(g, g, prev, 0.5) < model_contrastive_loss(
        torch.tensor([[1.0, 0.0, 0.0]]), g, prev, 0.5
    )

    from test_fedmlp import _site

    ctx = _site("s", [True, True, False], tmp=tmp_path)
    tr = get_method("moon").make_trainer(ctx, {"mu": 1.0})
    tr.train_round(0, 3, {})  # first round: no previous local model, no term
    assert tr.previous is not None
    after0 = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    fresh = get_method("moon").make_trainer(ctx, {})
    fresh.load_state_dict(tr.state_dict())  # a new process restores the previous local model
    assert all(torch.equal(fresh.previous[k], after0[k]) for k in after0)
    seen = []
    orig = fresh.extra_loss
    fresh.extra_loss = lambda b, lg, f: seen.append(orig(b, lg, f)) or seen[-1]
    fresh.train_round(1, 3, {})
    assert seen and all(t is not None and torch.isfinite(t) for t in seen)  # the term is active from round 1


def test_a_step_count_meant_for_a_large_site_is_named_on_a_small_one_and_capped_when_asked():
    from fedpartial.methods.base import TrainOptions, local_work

    fedlsm = TrainOptions(batch_size=64, local_steps=30)  # FedLSM's steps on a 70-image site: 27.4 epochs a round
    same, note = local_work(fedlsm, 70)
    assert same.local_steps == 30 and "27.4 passes over its 70 training images" in note
    assert "train.max_local_epochs" in note
    assert local_work(fedlsm, 2000) == (fedlsm, None)  # 0.96 epochs: nothing to say
    capped, note = local_work(TrainOptions(batch_size=64, local_steps=30, max_local_epochs=5), 70)
    assert capped.local_steps == 5 and "capped at train.max_local_epochs 5: 5 steps" in note  # floor(5 * 70 / 64)
    assert local_work(TrainOptions(batch_size=64, local_steps=30, max_local_epochs=5), 10)[0].local_steps == 1
    assert local_work(TrainOptions(local_epochs=3), 5)[1] is None  # epochs are already the site's own


def test_jobs_readme_lists_every_training_option():
    import dataclasses

    from conftest import REPO
    from fedpartial.methods.base import TrainOptions

    text = (REPO / "jobs" / "README.md").read_text()
    missing = [f.name for f in dataclasses.fields(TrainOptions) if f"| `{f.name}` |" not in text]
    assert not missing, f"jobs/README.md's training options table lacks {missing}"
    stale = [
        f.name
        for f in dataclasses.fields(TrainOptions)
        if f"| {f.metadata['doc'].replace('|', chr(92) + '|')} |" not in text
    ]
    assert not stale, f"jobs/README.md describes {stale} otherwise than their options' docs"


def test_a_method_module_that_fails_to_import_is_named_every_time(monkeypatch):
    """The registry is never taken as loaded with a method missing: a module whose import fails is an ImportError
    naming it, on the first call and on the next; once it imports, every method is there."""
    import importlib

    from fedpartial.methods import base

    real = importlib.import_module

    def broken(name, *args):
        if name == "fedpartial.methods.fedlsm":
            raise SyntaxError("invalid syntax (trainer.py, line 3)")
        return real(name, *args)

    monkeypatch.setattr(base, "_load_state", "unloaded")
    monkeypatch.setattr(importlib, "import_module", broken)
    for _ in range(2):
        with pytest.raises(ImportError, match=r"method module fedpartial\.methods\.fedlsm cannot be imported: Syn"):
            base.available_methods()
    monkeypatch.setattr(importlib, "import_module", real)
    assert "fedlsm" in base.available_methods() and base._load_state == "loaded"
