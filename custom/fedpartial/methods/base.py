"""The two extension points every method plugs into.

- :class:`LocalTrainer` runs one round of local training at a site on the received global model and returns
  the metadata it wants to send with its weights (counts, prototypes, relation matrices, ...).
- :class:`ServerRule` turns the sites' contributions into the next global model plus the metadata that
  travels back to the sites with it.

Both are NVFlare-free; ``fedpartial.fl`` wires them into an Executor and an Aggregator. A method registers a
(trainer, rule) pair with :func:`register`; the job config names it (``"method": "fedavg_masked"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..aggregation import State, aggregate_states


@dataclass
class SiteContext:
    """Everything a local trainer may use at one site.

    Attributes:
        site: site name.
        task: 'multilabel' or 'multiclass'.
        classes: global class list (C).
        annotated: ``(C,)`` bool, classes this site annotates (from its manifest).
        model: the network (``features`` / ``classifier`` split), already holding the received global weights.
        data: builds datasets / loaders over the site's training manifest (``fedpartial.data.dataset``).
        device: torch device.
        state_dir: folder for state that must survive rounds (``-t < -n`` restarts processes).
        train: training options (lr, batch_size, local_epochs, optimizer, weight_decay, ...).
        seed: the site's seed.
        summary: the global data summary broadcast by the server (per-site counts), or None.
    """

    site: str
    task: str
    classes: list[str]
    annotated: np.ndarray
    model: torch.nn.Module
    data: Any
    device: torch.device
    state_dir: Path
    train: dict
    seed: int = 0
    summary: dict | None = None
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("fedpartial"))

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def summary_counts(summary: dict, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Annotated positives and negatives per class summed over every site of the server's data summary
    (``{"sites": {site: {"positives": (C,), "negatives": (C,)}}}``): ``(pos (C,), neg (C,))`` float64."""
    pos = torch.zeros(num_classes, dtype=torch.float64)
    neg = torch.zeros(num_classes, dtype=torch.float64)
    for info in summary["sites"].values():
        pos += torch.as_tensor(info["positives"], dtype=torch.float64)
        neg += torch.as_tensor(info["negatives"], dtype=torch.float64)
    return pos, neg


@dataclass
class RoundOutput:
    """What a trainer returns after a round: the number of optimisation steps, the mean loss, extra meta."""

    steps: int
    loss: float
    meta: dict = field(default_factory=dict)


class LocalTrainer:
    """Base local trainer: optimiser, loaders and state persistence; subclasses implement :meth:`train_round`.

    Per-site state (:meth:`state_dict` / :meth:`load_state_dict`) is saved by the executor under the site's
    run folder after every round and restored when a new process takes over the site.
    """

    tasks: tuple[str, ...] = ("multilabel", "multiclass")

    def __init__(self, ctx: SiteContext, **options):
        if ctx.task not in self.tasks:
            raise ValueError(f"{type(self).__name__} does not support task {ctx.task!r}")
        self.ctx = ctx
        self.options = options
        self.optimizer: torch.optim.Optimizer | None = None
        self._optimizer_state: dict | None = None

    # -- the method -------------------------------------------------------------------------------------
    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------------------------
    def make_optimizer(self, params=None) -> torch.optim.Optimizer:
        """A fresh optimiser each round (as the papers), or the previous round's state restored when
        ``train.keep_optimizer_state`` is true (as FedLSM's released code)."""
        t = self.ctx.train
        params = list(self.ctx.model.parameters()) if params is None else params
        name = t.get("optimizer", "adam").lower()
        lr, wd = float(t.get("lr", 1e-3)), float(t.get("weight_decay", 0.0))
        if name == "adam":
            opt = torch.optim.Adam(params, lr=lr, betas=tuple(t.get("betas", (0.9, 0.999))), weight_decay=wd)
        elif name == "sgd":
            opt = torch.optim.SGD(params, lr=lr, momentum=float(t.get("momentum", 0.9)), weight_decay=wd)
        else:
            raise ValueError(f"unknown optimizer {name!r} (adam or sgd)")
        if t.get("keep_optimizer_state"):
            # the previous round's optimiser in this process, else the state restored from the site's file
            prev = self.optimizer.state_dict() if self.optimizer is not None else self._optimizer_state
            if prev is not None:
                opt.load_state_dict(prev)
        self.optimizer = opt
        return opt

    def step(self, loss: torch.Tensor) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def loader(self, views: dict[str, str], shuffle: bool = True, round_num: int = 0, batch_size: int | None = None):
        """A loader over the site's training images with the given views (key -> 'eval'/'weak'/'strong');
        the shuffling order depends on the site seed and the round. A shuffled (training) loader drops a
        trailing batch of a single image: BatchNorm cannot train on it (e.g. 33 images in batches of 32)."""
        bs = int(batch_size or self.ctx.train.get("batch_size", 32))
        n = len(self.ctx.data.dataset("train", views))
        return self.ctx.data.train_loader(views, batch_size=bs, shuffle=shuffle, seed=self.ctx.seed * 100003 + round_num,
                                          drop_last=shuffle and n > 1 and n % bs == 1)

    def batches(self, views: dict[str, str], round_num: int):
        """Yield device batches for ``train.local_epochs`` epochs (or ``train.local_steps`` steps if set)."""
        epochs = int(self.ctx.train.get("local_epochs", 1))
        max_steps = self.ctx.train.get("local_steps")
        done = 0
        for epoch in range(max(epochs, 1) if max_steps is None else 10**9):
            for batch in self.loader(views, round_num=round_num * 1000 + epoch):
                yield {k: v.to(self.ctx.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                done += 1
                if max_steps is not None and done >= int(max_steps):
                    return

    # -- persistence --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state: dict = {}
        if self.ctx.train.get("keep_optimizer_state") and self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self._optimizer_state = state.get("optimizer")


@dataclass
class Contribution:
    """One site's update as the server sees it."""

    site: str
    weights: dict[str, np.ndarray]
    n: float
    meta: dict

    @property
    def annotated(self) -> np.ndarray:
        return np.asarray(self.meta.get("annotated"), dtype=bool)


class ServerRule:
    """Base server rule: FedAvg weighted by the sites' training-set sizes (McMahan et al.)."""

    def __init__(self, **options):
        self.options = options

    def aggregate(self, previous: State, contributions: list[Contribution], classifier_keys: list[str],
                  round_num: int, summary: dict | None = None) -> tuple[dict[str, np.ndarray], dict]:
        """Return (new global weights, meta sent to the sites with them)."""
        weights = aggregate_states([c.weights for c in contributions], [c.n for c in contributions])
        return weights, {}


_REGISTRY: dict[str, tuple[type[LocalTrainer], type[ServerRule], dict]] = {}


def register(name: str, trainer: type[LocalTrainer], rule: type[ServerRule], **defaults) -> None:
    """Register a method: its local trainer, its server rule and default trainer options."""
    _REGISTRY[name] = (trainer, rule, defaults)


def get_method(name: str) -> tuple[type[LocalTrainer], type[ServerRule], dict]:
    from . import load_all

    load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {sorted(_REGISTRY)}") from None


def available_methods() -> list[str]:
    from . import load_all

    load_all()
    return sorted(_REGISTRY)


TrainerFactory = Callable[[SiteContext], LocalTrainer]
