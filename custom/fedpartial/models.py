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
as torchvision / the papers) and ``densenet121`` (MONAI). ImageNet weights are optional and only ever read from
the file or URL given in the config (``pretrained``); nothing is downloaded unless a URL is configured.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from .options import check_known

logger = logging.getLogger(__name__)

ARCHS = ("small_cnn", "resnet18", "densenet121")
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
        arch: one of ``small_cnn``, ``resnet18``, ``densenet121``.
        num_classes: number of global classes C.
        in_channels: image channels (3 for RGB / the three CT windows, 1 for gray X-ray).
        dropout: dropout on the pooled feature before the classifier (FedIRM uses 0.2).
        width: channel width of ``small_cnn``.
        head_hidden: width of a hidden head layer (0 = none; surgical aggregation's head uses 256).
        head_dropout: dropout after the hidden head layer (surgical aggregation: 0.3).
        pretrained: optional path or URL of ImageNet weights (torchvision layout) for the encoder;
            3-channel weights are averaged over channels for a 1-channel input.
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

    def _build(self, arch: str, in_channels: int, num_classes: int, dropout: float, width: int) -> None:
        if arch == "small_cnn":
            self.encoder, dim = SmallCNN(in_channels, width), width * 8
        elif arch == "resnet18":
            self.encoder, dim = _monai_resnet18(in_channels)
        elif arch == "densenet121":
            self.encoder, dim = _monai_densenet121(in_channels)
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
        if str(source).startswith(("http://", "https://")):
            state = torch.hub.load_state_dict_from_url(str(source), map_location="cpu", weights_only=True)
        else:
            path = Path(source).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"pretrained weights not found: {path}")
            state = read_state(path, "pretrained weights")
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        state = _to_encoder_keys(state, self.arch)
        own = self.encoder.state_dict()
        first = next(iter(own))
        if first in state and state[first].shape != own[first].shape and state[first].dim() == 4:
            # RGB stem onto a gray input: average the colour filters
            state[first] = state[first].mean(dim=1, keepdim=True).expand_as(own[first]).clone()
        usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
        if not usable:
            raise ValueError(f"no tensor of {source} matches the {self.arch} encoder")
        missing = [k for k in own if k not in usable]
        self.encoder.load_state_dict(usable, strict=False)
        logger.info("loaded %d encoder tensors from %s (%d left at init)", len(usable), source, len(missing))


ENCODER_FILE = "encoder.pt"
"""The encoder a self-supervised stage writes beside its results (``results.json``: ``encoder``)."""


def encoder_state(model_state: dict) -> dict:
    """The encoder's tensors of a :class:`PartialLabelNet` state dict, under the encoder's own keys (``encoder.``
    dropped): the layout :meth:`PartialLabelNet.load_pretrained` reads (``model.pretrained``)."""
    return {k[len("encoder.") :]: v for k, v in model_state.items() if k.startswith("encoder.")}


def save_encoder(model_file: str | Path, dest: str | Path) -> Path:
    """Write the encoder of a saved global model (NVFlare's persistor file: ``{"model": state}``, or a bare state
    dict) to ``dest`` (written to a temporary file, then renamed). Returns ``dest``."""
    import os

    state = read_state(model_file, "global model")
    state = state.get("model", state)
    enc = encoder_state(state)
    if not enc:
        raise ValueError(f"global model {model_file} holds no encoder tensors")
    dest = Path(dest)
    tmp = dest.with_suffix(dest.suffix + ".tmp")
    torch.save({k: torch.as_tensor(v) for k, v in enc.items()}, tmp)
    os.replace(tmp, dest)
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


MODEL_OPTIONS = ("arch", "in_channels", "dropout", "width", "pretrained", "init_seed", "head_hidden", "head_dropout")
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
