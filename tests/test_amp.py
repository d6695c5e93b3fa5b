"""``train.amp`` (bfloat16 autocast, here the CPU's, as a GPU's): the convolutions compute in bfloat16, everything a
method reads or decides on is float32: the random views, the model's features and logits, probabilities, entropies,
prototypes, relation matrices and FedLSR's loss. Each test compares a result under autocast with the float32
computation of the same inputs (``tests/test_method_zoo.py`` runs every method for two rounds under autocast)."""

from __future__ import annotations

import torch

from fedpartial.data.batch_views import BatchAugment
from fedpartial.methods.common import binary_entropy, mc_dropout_probs, whole_set_pass
from fedpartial.methods.fedirm.maths import relation_matrix
from fedpartial.methods.fedlsr import fedlsr_loss
from fedpartial.methods.fedmlp.maths import class_prototypes
from fedpartial.models import PartialLabelNet


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_strong_views_under_autocast_are_the_float32_views():
    x = torch.rand(16, 3, 24, 24, generator=torch.Generator().manual_seed(0))
    aug = BatchAugment([0.5] * 3, [0.25] * 3)
    for kind in ("flip", "weak", "strong"):
        ref = aug(x, kind, torch.Generator().manual_seed(1))
        with bf16():
            got = aug(x, kind, torch.Generator().manual_seed(1))
        assert got.dtype == torch.float32 and torch.equal(got, ref), kind


def _confident_net(num_classes: int = 4) -> PartialLabelNet:
    torch.manual_seed(0)
    net = PartialLabelNet("small_cnn", num_classes, 3, width=4, dropout=0.2).eval()
    with torch.no_grad():  # logits spread over about [-12, 12]: probabilities within bfloat16's spacing of 0 and 1
        net.classifier.weight.mul_(40.0)
        net.classifier.bias.copy_(torch.tensor([9.0, -9.0, 6.0, 0.0])[:num_classes])
    return net


def test_model_runs_convolutions_in_bfloat16_and_returns_float32():
    net = _confident_net()
    x = torch.rand(32, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with bf16():
        f, z = net.features(x), net(x)
        conv = net.encoder.body[0](x)
    assert conv.dtype == torch.bfloat16  # amp is on: the encoder's convolutions are bfloat16
    assert f.dtype == torch.float32 and z.dtype == torch.float32
    with torch.autocast("cpu", enabled=False):
        assert torch.equal(z, net.head(f))  # the head is float32 whatever the context
    assert not torch.equal(f, net.features(x))  # and the features did come from the bfloat16 encoder


def test_whole_set_pass_and_mc_dropout_give_float32_probabilities_under_autocast():
    """A bfloat16 sigmoid rounds every p >= 0.998 to 1.0 and ties the entropies; the passes must not."""
    net = _confident_net()
    x = torch.rand(64, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    loader = [{"image": x[:32], "index": torch.arange(32)}, {"image": x[32:], "index": torch.arange(32, 64)}]
    with bf16():
        feats, probs = whole_set_pass(net, loader, 64, "multilabel", features=True)
        logits = net(x)
        mc = mc_dropout_probs(net, x, 3, "multilabel")
    assert probs.dtype == torch.float32 and mc.dtype == torch.float32
    assert torch.allclose(probs, torch.sigmoid(logits), rtol=0, atol=1e-6)
    assert ((probs > 0) & (probs < 1)).all()  # no saturation at 0 or 1 (logits are within +-17)
    for c in (2, 3):  # logits about 6 and 0: 64 distinct logits, >= 60 distinct entropies (a bfloat16 sigmoid: 2, 27)
        assert logits[:, c].unique().numel() == 64 and binary_entropy(probs[:, c]).unique().numel() >= 60
    assert ((mc > 0) & (mc < 1)).all()


def test_fedlsr_loss_is_finite_and_float32_under_autocast():
    """Confident bfloat16 logits: the clamp at 1 - 1e-6 is 1.0 in bfloat16 and (1 - q) log(1 - m) was 0 * -inf."""
    z1 = torch.tensor([[9.0, -9.0, 12.0], [5.0, 0.5, -12.0]])
    z2 = z1 + torch.tensor([[0.5, -0.25, 1.0], [0.0, 0.25, -1.0]])
    labels = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    for task in ("multilabel", "multiclass"):
        y = labels if task == "multilabel" else torch.eye(3)[[2, 0]]
        ref, _ = fedlsr_loss(z1, z2, y, mask, 0.3, 0.4, task)
        with bf16():
            got, parts = fedlsr_loss(z1.bfloat16(), z2.bfloat16(), y, mask, 0.3, 0.4, task)
        assert torch.isfinite(got) and got.dtype == torch.float32, task
        assert torch.allclose(got, ref, rtol=1e-6), task  # these logits are exact in bfloat16


def test_relation_matrix_and_prototypes_are_float32_under_autocast():
    g = torch.Generator().manual_seed(0)
    outputs, feats = torch.randn(32, 5, generator=g) * 3, torch.randn(32, 7, generator=g)
    targets = torch.nn.functional.one_hot(torch.randint(0, 5, (32,), generator=g), 5).float()
    ref_m, ref_c = relation_matrix(outputs, targets, 2.0)
    ref_p = class_prototypes(feats, targets, torch.ones_like(targets, dtype=torch.bool))
    with bf16():
        m, c = relation_matrix(outputs, targets, 2.0)
        p = class_prototypes(feats, targets, torch.ones_like(targets, dtype=torch.bool))
    assert m.dtype == torch.float32 and torch.equal(m, ref_m) and torch.equal(c, ref_c)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(p, ref_p))


def test_device_sums_equal_python_float_sums_and_integer_counts():
    """The per-round totals kept on the device (read once) are exactly the former per-step ``float(loss)`` sums."""
    from fedpartial.methods.common import DeviceSums

    g = torch.Generator().manual_seed(0)
    losses = [torch.rand((), generator=g) * 10 ** float(torch.randint(-3, 3, (1,), generator=g)) for _ in range(500)]
    flags = [torch.rand(7, generator=g) < 0.3 for _ in range(500)]
    sums = DeviceSums()
    total, count = 0.0, 0
    for loss, f in zip(losses, flags):
        sums.add(loss=loss.requires_grad_(), pseudo=f)
        total += float(loss.detach())
        count += int(f.sum())
    read = sums.read()
    assert read["loss"] == total and read["pseudo"] == count and isinstance(read["pseudo"], int)
    assert "other" not in read


def test_mc_dropout_on_cached_features_equals_whole_network_passes():
    """Dropout only after the pooled feature: the encoder once and the head T times gives the numbers of T passes of
    the whole network for the same seed; dropout inside the encoder keeps the whole-network passes."""
    from fedpartial.methods import common

    net = PartialLabelNet("small_cnn", 5, 3, width=4, dropout=0.3, head_hidden=16, head_dropout=0.2)
    x = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    assert common.dropout_only_in_head(net)
    torch.manual_seed(7)
    cached = mc_dropout_probs(net, x, 6, "multilabel")
    net.eval()
    for m in net.modules():
        if isinstance(m, torch.nn.Dropout):
            m.train()
    torch.manual_seed(7)
    with torch.no_grad():
        full = torch.stack([torch.sigmoid(net(x)) for _ in range(6)])
    assert torch.equal(cached, full) and not torch.equal(cached[0], cached[1])
    net.encoder.body.insert(1, torch.nn.Dropout(0.1))
    assert not common.dropout_only_in_head(net)


def test_a_round_under_amp_runs_every_step_on_the_current_weights():
    """The executor runs a whole local round inside one ``train.amp`` block. Each step's forward pass must use the
    weights the previous step left (autocast's weight cache would keep the round's first bfloat16 copy: every
    forward pass of the round on the starting weights). Reference: the same steps, each in its own block."""
    from types import SimpleNamespace

    from fedpartial.fl.executor import PartialLabelExecutor

    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))

    def steps(per_step_block: bool) -> list[float]:
        lin = torch.nn.Linear(8, 1)
        with torch.no_grad():
            lin.weight.fill_(0.1)
            lin.bias.zero_()
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        losses = []
        for _ in range(3):
            if per_step_block:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = lin(x).float().pow(2).mean()
            else:
                loss = lin(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    executor = PartialLabelExecutor.__new__(PartialLabelExecutor)
    executor.torch_device = torch.device("cpu")
    executor.train_opts = SimpleNamespace(amp=True)
    executor.trainer = SimpleNamespace(train_round=lambda *a: steps(per_step_block=False))
    in_round = executor._train_round(0, 1, {})
    reference = steps(per_step_block=True)
    assert in_round == reference
    assert len(set(reference)) == 3  # the steps changed the loss: the forward passes saw the updates
