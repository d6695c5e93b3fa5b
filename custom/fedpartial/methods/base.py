"""The two extension points every method plugs into, and the registry that names them.

- :class:`LocalTrainer` runs one round of local training at a site. Besides :meth:`LocalTrainer.train_round` it
  owns the site-side hooks used by BOTH the train and the validate tasks: :meth:`~LocalTrainer.receive` (how
  the received global weights enter the local model: everything by default, FedBN keeps the site's norm layers,
  PFL its head) and :meth:`~LocalTrainer.export` (what the site sends). Its :class:`RoundOutput` carries a
  participation weight: 0 means the site sits this round out (not an error).
- :class:`ServerRule` turns the sites' contributions into the next global model plus the metadata that travels
  back with it. It gets the model's parameter groups (``encoder`` / ``norm`` / ``head`` / ``classifier``, see
  :func:`fedpartial.models.parameter_groups`) and may check the federation's data summary before training
  (:meth:`ServerRule.check_federation`).
- Options are typed dataclasses (``Options`` of each class, :mod:`.options`); a :class:`Method` checks a job's
  ``method_args`` against the union of its trainer's and rule's options and gives each side its own.

Both classes are NVFlare-free; ``fedpartial.fl`` wires them into an Executor and an Aggregator. The contract a
new method follows (hooks, state, the output of ``aggregate``) is written out in ``docs/adding-a-method.md`` and
checked for every registered method by ``tests/test_method_zoo.py``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from ..aggregation import State, aggregate_states, clip_change_norms, robust_states, trim_count
from ..models import NORM_TYPES, default_inference_batch_size, numpy_state
from ..options import build, check_known, opt, option_names, renamed_options
from ..privacy import ClassStat
from ..stat_checks import StatSpec, statistic_specs

Norm = Literal["average", "local", "frozen"]


@dataclass
class TrainOptions:
    """The ``train`` section of a job (every method)."""

    optimizer: Literal["adam", "sgd"] = opt("adam", "optimiser, fresh each round unless keep_optimizer_state")
    lr: float = opt(1e-3, "learning rate")
    weight_decay: float = opt(0.0, "L2 weight decay")
    betas: tuple[float, float] = opt((0.9, 0.999), "Adam betas")
    momentum: float = opt(0.9, "SGD momentum")
    batch_size: int = opt(32, "training batch size")
    local_epochs: int = opt(1, "passes over the local training set per round (unless local_steps)")
    local_steps: int | None = opt(None, "optimisation steps per round (overrides local_epochs)")
    max_local_epochs: float | None = opt(
        None,
        "cap local_steps at this many passes over the site's training set "
        "(a small site given a step count meant for a large one)",
    )
    inference_batch_size: int | None = opt(
        None, "batch size of whole-set passes (default: batch_size on a CPU, 4 x batch_size on a GPU)"
    )
    num_threads: int = opt(1, "torch intra-op threads at the site")
    num_workers: int = opt(0, "DataLoader workers")
    keep_optimizer_state: bool | None = opt(
        None, "carry the optimiser state across rounds (None: the method's default)"
    )
    views: Literal["batched", "per_sample"] = opt(
        "batched",
        "random views drawn per batch on the training device "
        "(vectorised), or per sample by the MONAI pipelines in the loader",
    )
    amp: bool = opt(False, "bfloat16 autocast during local training (for GPUs)")
    pin_memory: bool = opt(False, "pin batches in host memory before copying them to a GPU")
    data_on_device: Literal["auto", "on", "off"] = opt(
        "auto",
        "batched views: keep the site's decoded training images on the training device and gather each "
        "batch there (same batches, same order; no per-batch host work or copy). auto: on a GPU when they "
        "take under a quarter of its free memory and a tenth of all of it (cache 'memory', no loader "
        "workers)",
    )
    channels_last: bool = opt(
        True,
        "keep the model's 4-D weights and activations in channels-last memory layout "
        "(faster inference and training steps of the small CNN on a CPU: benchmarks/local_round_speed.py "
        "against --no-channels-last; "
        "the same mathematics, other float summation order)",
    )


MANY_EPOCHS = 10
"""Local steps per round above this many passes over a site's training set get a warning naming the keys."""


def local_work(train: TrainOptions, n_train: int) -> tuple[TrainOptions, str | None]:
    """The training options a site of ``n_train`` images runs, and a warning or None: ``local_steps`` capped at
    ``max_local_epochs`` passes over the site's images (at least one step); a step count that is more than
    ``MANY_EPOCHS`` passes (e.g. FedLSM's 30 steps x 64 images on a 70-image site: 27 epochs a round) is named."""
    import dataclasses
    import math

    if train.local_steps is None or n_train <= 0:
        return train, None
    epochs = train.local_steps * train.batch_size / n_train
    if train.max_local_epochs is not None and epochs > train.max_local_epochs:
        steps = max(1, math.floor(train.max_local_epochs * n_train / train.batch_size))
        return dataclasses.replace(train, local_steps=steps), (
            f"train.local_steps {train.local_steps} x batch_size {train.batch_size} would be {epochs:.1f} passes over "
            f"its {n_train} training images a round; capped at train.max_local_epochs {train.max_local_epochs:g}: "
            f"{steps} steps"
        )
    if epochs > MANY_EPOCHS:
        return train, (
            f"train.local_steps {train.local_steps} x batch_size {train.batch_size} is {epochs:.1f} passes "
            f"over its {n_train} training images a round (a small site overfits its data); "
            "train.max_local_epochs caps it, or give train.local_epochs instead"
        )
    return train, None


@dataclass
class SiteContext:
    """Everything a local trainer may use at one site.

    Attributes:
        site: site name.
        task: 'multilabel' or 'multiclass'.
        classes: global class list (C).
        annotated: ``(C,)`` bool, classes this site annotates (from its manifest; all False at an unlabelled site).
        model: the network (``features`` / ``head`` split), holding the received global weights.
        data: builds datasets / loaders over the site's manifests (``fedpartial.data.sitedata.SiteDatasets``).
        device: torch device.
        state_dir: folder for state that must survive rounds (``-t < -n`` restarts processes).
        train: :class:`TrainOptions` (a dict is checked and converted).
        seed: the site's seed (:func:`fedpartial.seeding.site_seed`).
        summary: the data summary the server sends this site (federation totals per class), or None.
        privacy: the site's privacy properties (its NVFlare privacy scope, :mod:`fedpartial.fl.privacy`), e.g.
            ``feature_clip``: the L2 norm a method clips per-image vectors to before a per-class mean it sends.
    """

    site: str
    task: str
    classes: list[str]
    annotated: np.ndarray
    model: torch.nn.Module
    data: Any
    device: torch.device
    state_dir: Path
    train: TrainOptions | dict = field(default_factory=TrainOptions)
    seed: int = 0
    summary: dict | None = None
    privacy: dict = field(default_factory=dict)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("fedpartial"))

    def __setattr__(self, name, value):
        if name == "train" and isinstance(value, dict):  # a dict is checked and converted, also when reassigned
            value = build(TrainOptions, value, f"site '{self.site}': train options")
        super().__setattr__(name, value)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def labelled(self) -> bool:
        """Whether the site annotates any class."""
        return bool(np.asarray(self.annotated, dtype=bool).any())


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
    """What a trainer returns after a round.

    Attributes:
        steps: optimisation steps taken; loss: their mean loss; meta: metadata sent to the server.
        weight: participation weight of this round's update (multiplies the site's aggregation weight);
            0 = the site sits this round out, its update is not averaged (not an error).
    """

    steps: int
    loss: float
    meta: dict = field(default_factory=dict)
    weight: float = 1.0


@dataclass
class TrainerOptions:
    """Options every local trainer takes (in the job's ``method_args``)."""

    norm: Norm = opt("average", "norm layers: averaged (FedAvg), kept local at each site (FedBN), or frozen (FedBN+)")
    keep_local: list[Literal["head", "classifier"]] = opt([], "groups each site keeps local (PFL: ['classifier'])")


class LocalTrainer:
    """Base local trainer: optimiser, loaders, the receive / export hooks and state persistence; subclasses
    implement :meth:`train_round` and declare their ``Options`` (a dataclass extending :class:`TrainerOptions`).

    Class attributes:
        tasks: the task types the method supports.
        accepts_unlabelled: whether a site that annotates no class at all may run this trainer (then its train,
            val and test manifests may be unlabelled).
        keeps_all_local: the site keeps its whole model (nothing received is loaded once it has trained).
        keep_optimizer_state: the default of ``train.keep_optimizer_state``.
        per_class_metadata: the per-class statistics the trainer sends in its round metadata
            (:class:`fedpartial.privacy.ClassStat`: key, ``count`` / ``mean``, the counts behind each row, whether
            it is clipped per image); the site's minimum count, noise and privacy ledger work from it.
        statistics: what the metadata the server reads may be (:class:`fedpartial.stat_checks.StatSpec`: shape
            in C / D / K, dtype, range such as ``[0, n_train]``, row norm, required); the server refuses an update
            whose metadata breaks it. A per-class statistic not declared here is checked by its default
            (:func:`fedpartial.stat_checks.spec_of_class_stat`: counts in ``[0, n_train]``, finite means).

    Per-site state (:meth:`state_dict` / :meth:`load_state_dict`) is saved by the executor under the site's run
    folder after every round and restored when a new process takes over the site.
    """

    Options: type = TrainerOptions
    tasks: tuple[str, ...] = ("multilabel", "multiclass")
    accepts_unlabelled: bool = False
    keep_optimizer_state: bool = False
    keeps_all_local: bool = False  # every tensor stays at the site (individually trained models)
    per_class_metadata: tuple[ClassStat, ...] = ()
    statistics: tuple[StatSpec, ...] = ()

    def __init__(self, ctx: SiteContext, **options):
        if ctx.task not in self.tasks:
            raise ValueError(f"{type(self).__name__} does not support task {ctx.task!r}")
        self.ctx = ctx
        self.opts = build(self.Options, options, f"{type(self).__name__} options")
        self.optimizer: torch.optim.Optimizer | None = None
        self._optimizer_state: dict | None = None
        groups = ctx.model.parameter_groups()
        local = (["norm"] if self.opts.norm == "local" else []) + list(self.opts.keep_local)
        self.local_keys: set[str] = {k for g in local for k in groups[g]}
        if self.keeps_all_local:
            self.local_keys = set(ctx.model.state_dict())
        self.has_local_state = False  # set once the model holds this site's own local parts

    def __init_subclass__(cls, **kwargs):
        """As for rules: a subclass's state is given and taken in its :func:`saved_form` (numpy arrays as tensors),
        so that the executor's ``torch.load(weights_only=True)`` of the site state file gives back the same types."""
        super().__init_subclass__(**kwargs)
        _state_in_saved_form(cls)

    # -- the method -------------------------------------------------------------------------------------
    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        raise NotImplementedError

    #: ``score_probabilities(features (N, D), labels (N, C), mask (N, C)) -> (N, C)``: a trainer that defines it
    #: is scored on its validation / test sets from the model's features (e.g. a kNN vote) instead of its
    #: classifier (a self-supervised stage, whose classifier is never trained); None: the classifier.
    score_probabilities = None

    @classmethod
    def declared_statistics(cls, opts) -> tuple[StatSpec, ...]:
        """:attr:`statistics` as they are under the trainer's options ``opts`` (its ``Options`` instance); a
        trainer whose bounds depend on an option overrides this."""
        return tuple(cls.statistics)

    # -- site hooks ---------------------------------------------------------------------------------------
    def receive(self, weights: dict[str, np.ndarray]) -> None:
        """Load the received global weights into the model; the site's local parts (``norm: local``,
        ``keep_local``) keep their own values once the site has trained them."""
        model = self.ctx.model
        own = model.state_dict()
        missing = [k for k in own if k not in weights]
        if missing:
            raise ValueError(f"received model lacks {len(missing)} tensors, e.g. {missing[:3]}")
        keep = self.local_keys if self.has_local_state else set()
        model.load_state_dict(
            {k: own[k] if k in keep else torch.as_tensor(np.asarray(weights[k])).to(own[k].dtype) for k in own}
        )

    def export(self) -> dict[str, np.ndarray]:
        """The weights the site sends: its whole model."""
        return numpy_state(self.ctx.model.state_dict())

    def train_mode(self) -> torch.nn.Module:
        """Put the model in training mode; with ``norm: frozen`` (FedBN+) the norm layers stay in eval mode and
        their affine parameters are not trained. Returns the model."""
        model = self.ctx.model.train()
        if self.opts.norm == "frozen":
            for m in model.modules():
                if isinstance(m, NORM_TYPES):
                    m.eval()
                    for p in m.parameters(recurse=False):
                        p.requires_grad_(False)
        return model

    # -- helpers ----------------------------------------------------------------------------------------
    @property
    def keeps_optimizer_state(self) -> bool:
        t = self.ctx.train.keep_optimizer_state
        return self.keep_optimizer_state if t is None else bool(t)

    def make_optimizer(self, params=None) -> torch.optim.Optimizer:
        """A fresh optimiser each round (as the papers), or the previous round's state restored when
        ``train.keep_optimizer_state`` is true (as FedLSM's released code)."""
        t = self.ctx.train
        params = [p for p in self.ctx.model.parameters() if p.requires_grad] if params is None else params
        if t.optimizer == "adam":
            opt_ = torch.optim.Adam(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
        else:
            opt_ = torch.optim.SGD(params, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay)
        if self.keeps_optimizer_state:
            # the previous round's optimiser in this process, else the state restored from the site's file
            prev = self.optimizer.state_dict() if self.optimizer is not None else self._optimizer_state
            if prev is not None:
                opt_.load_state_dict(prev)
        self.optimizer = opt_
        return opt_

    def step(self, loss: torch.Tensor, read: Callable[[torch.optim.Optimizer], Any] | None = None) -> Any:
        """One optimiser step on ``loss``. ``read``, where given, is called with the optimiser between the backward
        pass and the step (the gradients in place: to read or clip them); its value is returned."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        got = read(self.optimizer) if read is not None else None
        self.optimizer.step()
        return got

    @property
    def inference_batch_size(self) -> int:
        return int(
            self.ctx.train.inference_batch_size
            or default_inference_batch_size(self.ctx.train.batch_size, self.ctx.device)
        )

    def loader(self, views: dict[str, str], shuffle: bool = True, round_num: int = 0, batch_size: int | None = None):
        """A loader over the site's training images with the given views (key -> 'eval'/'weak'/'strong');
        the shuffling order depends on the site seed and the round. A shuffled (training) loader drops a
        trailing batch of a single image: BatchNorm cannot train on it (e.g. 33 images in batches of 32)."""
        bs = int(batch_size or self.ctx.train.batch_size)
        n = len(self.ctx.data.dataset("train", {"image": "eval"}))
        t = self.ctx.train
        return self.ctx.data.train_loader(
            views,
            batch_size=bs,
            shuffle=shuffle,
            seed=self.ctx.seed * 100003 + round_num,
            drop_last=shuffle and n > 1 and n % bs == 1,
            batched=t.views == "batched",
            device=self.ctx.device,
            pin_memory=t.pin_memory,
            on_device=t.data_on_device,
        )

    def fetcher(self, views: dict[str, str], seed: int):
        """``fetch(indices, keys=None) -> device batch`` of chosen training rows with the given views (see
        ``train.views``); ``keys``: only these of the views (None: all), the others drawn all the same (the later
        batches' views stay the same) and, with batched views, without their image work."""
        t = self.ctx.train
        fetch = self.ctx.data.fetcher(views, seed, t.views == "batched", self.ctx.device, t.data_on_device)
        if _takes_keyword(fetch, "keys"):
            return fetch

        def every_view_made(idx, keys=None):  # a data layer whose fetcher makes every view: the others left out
            batch = fetch(idx)
            return batch if keys is None else {k: v for k, v in batch.items() if k not in views or k in keys}

        return every_view_made

    def batches(self, views: dict[str, str], round_num: int):
        """Yield device batches for ``train.local_epochs`` epochs (or ``train.local_steps`` steps if set)."""
        epochs, max_steps = self.ctx.train.local_epochs, self.ctx.train.local_steps
        done = 0
        for epoch in range(max(epochs, 1) if max_steps is None else 10**9):
            for batch in self.loader(views, round_num=round_num * 1000 + epoch):
                yield {k: v.to(self.ctx.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                done += 1
                if max_steps is not None and done >= int(max_steps):
                    return

    # -- persistence --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Per-site state to persist after every round: tensors, numpy arrays, numbers, strings, lists and dicts
        (given back by :meth:`load_state_dict` in :func:`saved_form`: numpy arrays as tensors)."""
        state: dict = {}
        if self.keeps_optimizer_state and self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self._optimizer_state = state.get("optimizer")


def _takes_keyword(fn, name: str) -> bool:
    """Whether the callable ``fn`` accepts the keyword argument ``name``."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class PlainSums(NamedTuple):
    """The weighted mean of every float tensor of a round's updates, summed by the server on its one reading of
    them (:func:`fedpartial.aggregation.change_measures`): ``states``, the updates in order (the very objects),
    ``weights``, the ``(K,)`` site weights used, ``sums``, ``{key: array}``."""

    states: tuple
    weights: np.ndarray
    sums: dict


@dataclass
class Contribution:
    """One site's update as the server sees it.

    Attributes:
        site: the sender; weights: its exported state; n: its training-set size; meta: its metadata;
        weight: its participation weight this round (0 = sat the round out).
    """

    site: str
    weights: dict[str, np.ndarray]
    n: float
    meta: dict
    weight: float = 1.0

    @property
    def annotated(self) -> np.ndarray:
        return np.asarray(self.meta.get("annotated"), dtype=bool)


@dataclass
class RuleOptions:
    """Options every server rule takes (in the job's ``method_args``)."""

    site_weighting: Literal["samples", "uniform"] = opt(
        "samples", "site weight a_k: n_k (FedAvg) or 1 (surgical aggregation)"
    )
    norm: Norm = opt(
        "average", "norm layers: averaged, kept local at the sites (FedBN) or frozen (FedBN+; kept as they were)"
    )
    robust: Literal["none", "median", "trimmed_mean"] = opt(
        "none",
        "robust averaging of every tensor (classifier rows over the sites holding the class): the weighted "
        "mean, the coordinate-wise median or the trimmed mean (unweighted)",
    )
    trim: float = opt(
        0.2,
        "trimmed_mean: fraction of the sites dropped at EACH end per coordinate (ceil(trim * K), "
        "at least one site left)",
    )
    clip_norm: float = opt(
        0.0,
        "norm clipping: each site's whole change is scaled down to at most clip_norm x the "
        "round's median change norm before averaging (0: off)",
    )


def saved_form(value: Any) -> Any:
    """The one format of saved method state: ``value`` with numpy arrays as tensors, numpy scalars as python numbers
    and tuples as lists (tensors, numbers, strings, None, lists and dicts stay). It is what a checkpoint written by
    ``fedpartial.fl.checkpoint.write_private`` gives back under ``torch.load(weights_only=True)``, so a rule's
    :meth:`ServerRule.load_state_dict` receives the same types in process and after a restart."""
    if isinstance(value, dict):
        return {k: saved_form(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [saved_form(v) for v in value]
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    return value


def _state_in_saved_form(cls: type) -> None:
    """Wrap ``cls``'s ``state_dict`` / ``load_state_dict`` (its own or a mixin's) so that both give and take
    :func:`saved_form`."""
    for name in ("state_dict", "load_state_dict"):
        fn = getattr(cls, name, None)
        if fn is None or getattr(fn, "_saved_form", False):
            continue
        if name == "state_dict":

            def wrapped(self, _fn=fn) -> dict:
                return saved_form(_fn(self))
        else:

            def wrapped(self, state: dict, _fn=fn) -> None:
                _fn(self, saved_form(dict(state or {})))

        wrapped = functools.wraps(fn)(wrapped)
        wrapped._saved_form = True  # type: ignore[attr-defined]
        setattr(cls, name, wrapped)


class ServerRule:
    """Base server rule: every tensor averaged with the site weights ``a_k`` (``site_weighting``: FedAvg's
    ``n_k`` by default, McMahan et al.) times each site's participation weight.

    Robust options (every rule that averages through :meth:`average`): ``clip_norm`` scales each site's change
    down to a multiple of the round's median change norm, ``robust: median / trimmed_mean`` replaces the weighted
    mean by the coordinate-wise median / trimmed mean (:mod:`fedpartial.aggregation`).

    Under ``norm: local`` (FedBN) the global model's norm layers hold the sites' average (what ``predict`` uses
    on data of no site) while each site evaluates and trains with its own; under ``norm: frozen`` (FedBN+)
    they keep their previous global values.
    """

    Options: type = RuleOptions
    required_metadata: tuple[str, ...] = ()  # metadata keys the rule reads from every contribution (e.g. 'annotated')
    presummed: PlainSums | None = None  # set by the server around aggregate (:meth:`plain_weights`)

    def __init_subclass__(cls, **kwargs):
        """A subclass's :meth:`state_dict` returns, and its :meth:`load_state_dict` receives, the :func:`saved_form`
        of its state (numpy arrays as tensors): the same types in process and after a checkpoint."""
        super().__init_subclass__(**kwargs)
        _state_in_saved_form(cls)

    def __init__(self, **options):
        self.opts = build(self.Options, options, f"{type(self).__name__} options")
        trim_count(3, float(self.opts.trim))  # a bad trim fraction is an option error, not a failed round
        if not float(self.opts.clip_norm) >= 0:
            raise ValueError(f"{type(self).__name__} options: clip_norm must be >= 0, got {self.opts.clip_norm}")

    def check_federation(self, summary: dict) -> None:
        """Raise ``ValueError`` naming the offending sites when the federation's data summary (``{"classes",
        "sites": {site: {"annotated", "n_train", ...}}}``) does not suit the method; called before training."""

    def site_weights(self, contributions: list[Contribution]) -> np.ndarray:
        """``(K,)`` aggregation weights: ``n_k`` or 1 per ``site_weighting``, times the participation weight."""
        base = [c.n if self.opts.site_weighting == "samples" else 1.0 for c in contributions]
        return np.asarray(base, dtype=np.float64) * np.asarray([c.weight for c in contributions], dtype=np.float64)

    def plain_weights(self, contributions: list[Contribution]) -> np.ndarray | None:
        """The ``(K,)`` site weights :meth:`average` will give every tensor outside the classifier rows, asked
        before :meth:`aggregate` so the server can sum that weighted mean on the same reading of the updates as
        its checks (:class:`PlainSums`, used by :meth:`average` only for the very same updates and weights);
        None where the mean is not plain (``clip_norm``, ``robust``). A rule that never calls :meth:`average`
        returns None."""
        if self.opts.clip_norm > 0 or self.opts.robust != "none":
            return None
        return self.site_weights(contributions)

    def _presummed_for(self, contributions: list[Contribution], weights: np.ndarray) -> dict | None:
        """:attr:`presummed`'s sums when they were made of exactly these updates with these weights, else None."""
        p = self.presummed
        if p is None or len(p.states) != len(contributions):
            return None
        if not all(c.weights is s for c, s in zip(contributions, p.states)):
            return None
        return p.sums if np.array_equal(np.asarray(weights, np.float64), p.weights) else None

    def average(
        self,
        previous: State | None,
        contributions: list[Contribution],
        groups: dict[str, list[str]],
        class_weights: np.ndarray | None = None,
        zero_rows: str = "previous",
    ) -> dict[str, np.ndarray]:
        """Average the contributions with :meth:`site_weights` (classifier rows with ``class_weights`` if given,
        see :func:`fedpartial.aggregation.aggregate_states`), then apply the ``norm`` policy."""
        states = [c.weights for c in contributions]
        if self.opts.clip_norm > 0 and previous is not None:
            states = clip_change_norms(states, previous, self.opts.clip_norm)
        if self.opts.robust != "none":
            out = robust_states(
                states,
                self.site_weights(contributions),
                self.opts.robust,
                self.opts.trim,
                groups.get("classifier", ()),
                class_weights,
                previous,
                zero_rows,
            )
        else:
            weights = self.site_weights(contributions)
            out = aggregate_states(
                states,
                weights,
                groups.get("classifier", ()),
                class_weights,
                previous,
                zero_rows,
                presummed=self._presummed_for(contributions, weights) if self.opts.clip_norm <= 0 else None,
            )
        if self.opts.norm == "frozen" and previous is not None:
            out.update({k: np.asarray(previous[k]) for k in groups.get("norm", ()) if k in previous})
        return out

    def aggregate(
        self,
        previous: State | None,
        contributions: list[Contribution],
        groups: dict[str, list[str]],
        round_num: int,
        summary: dict | None = None,
    ) -> tuple[dict[str, np.ndarray], dict]:
        """One round of the server: ``(new global weights, meta sent to the sites with them)``.

        Args:
            previous: the global model the sites received this round (``{name: np.ndarray}``, the model's
                ``state_dict`` order and dtypes); None only when the workflow holds no global model.
            contributions: the round's accepted updates, only those with a positive participation weight (at
                least one; each one's ``weights`` has exactly ``previous``'s keys, shapes and dtypes).
            groups: the model's parameter groups (``encoder`` / ``norm`` / ``head`` / ``classifier`` -> tensor
                names, :func:`fedpartial.models.parameter_groups`), as the first contribution's site sent them.
            round_num: 0-based round; summary: the federation's data summary (per-site counts) or None.

        Output contract (checked by the aggregator, :func:`fedpartial.aggregation.check_update`; a rule that breaks
        it fails the round and the previous model is kept): the weights hold every key of ``previous`` with its
        shape and dtype (integer buffers such as ``num_batches_tracked`` included) and finite values. The meta holds
        numpy arrays, numbers, strings and lists; it reaches every site with the next round's model (it is stored
        once in the server checkpoint, so a rule's state need not repeat it)."""
        return self.average(previous, contributions, groups), {}

    # -- state that must survive a restart of the rule ------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything :meth:`aggregate` carries from one round to the next (FedAvgM's momentum, FedIRM's relation
        matrix, ...): a dict of tensors, numpy arrays, numbers, strings, lists and dicts. The server checkpoint
        writes it after every round; a resumed job builds a fresh rule and calls :meth:`load_state_dict` with it.
        A rule with state across rounds MUST return it here: the method-zoo test runs two rounds straight through
        and the same two split by a checkpoint, and fails when they differ."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output, received in its :func:`saved_form` (numpy arrays as tensors)."""

    def load_sent_meta(self, meta: dict) -> None:
        """On resume, after :meth:`load_state_dict`: the metadata this rule returned last (what the sites received
        with the checkpointed model, numbers and nested lists). It is stored once in the server checkpoint, with the
        global model, so a rule whose state IS what it sends (FedMLP's global prototypes and degrees) rebuilds its
        state from here and returns nothing from :meth:`state_dict`."""


@dataclass(frozen=True)
class Method:
    """A registered method: its local trainer, its server rule and default options.

    Attributes:
        job: the job (folder under ``jobs/``) that runs it; a method without a job of its own names a job of a
            sibling method (``fedprox_masked`` runs ``fedavg_masked_ham10000`` with its method swapped).
        comparison: a comparison method: tested by running ``job`` for two rounds in the simulator
            (:func:`comparison_jobs`) and listed in the README's comparison table.
    """

    name: str
    trainer: type[LocalTrainer]
    rule: type[ServerRule]
    defaults: dict = field(default_factory=dict)
    doc: str = ""
    job: str = ""
    comparison: bool = False

    def option_names(self) -> set[str]:
        return option_names(self.trainer.Options, self.rule.Options)

    def split_options(self, args: dict | None, where: str = "") -> tuple[dict, dict]:
        """``(trainer options, rule options)`` from a job's ``method_args`` merged over the defaults; an unknown
        key is an :class:`~.options.OptionError` naming ``where``, the method, the key and the closest name."""
        args = {**self.defaults, **(args or {})}
        check_known(
            args,
            self.option_names(),
            f"{where + ': ' if where else ''}method '{self.name}' method_args",
            renamed_options(self.trainer.Options, self.rule.Options),
        )
        t, r = option_names(self.trainer.Options), option_names(self.rule.Options)
        return {k: v for k, v in args.items() if k in t}, {k: v for k, v in args.items() if k in r}

    def statistic_specs(self, rule: ServerRule | None = None, args: dict | None = None) -> dict[str, StatSpec]:
        """What every contribution's metadata may be (:func:`fedpartial.stat_checks.statistic_specs`): the
        trainer's declarations under the job's ``method_args`` ``args``, with the keys ``rule`` (default: the rule
        class) reads from every contribution required."""
        required = (rule if rule is not None else self.rule).required_metadata
        opts = build(self.trainer.Options, self.split_options(args)[0], f"method '{self.name}' trainer options")
        return statistic_specs(self.trainer.per_class_metadata, self.trainer.declared_statistics(opts), required)

    def make_rule(self, args: dict | None, where: str = "") -> ServerRule:
        return self.rule(**self.split_options(args, where)[1])

    def make_trainer(self, ctx: SiteContext, args: dict | None, where: str = "") -> LocalTrainer:
        return self.trainer(ctx, **self.split_options(args, where)[0])


_REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    trainer: type[LocalTrainer],
    rule: type[ServerRule],
    doc: str = "",
    *,
    job: str = "",
    comparison: bool = False,
    **defaults,
) -> None:
    """Register a method: its local trainer, its server rule, a one-line ``doc``, the ``job`` that runs it,
    whether it is a ``comparison`` method, and default options (``method_args``, checked when used)."""
    _REGISTRY[name] = Method(name, trainer, rule, defaults, doc, job, comparison)


_load_state = "unloaded"  # "loading" while the modules import (one asking for the registry sees it as it is)


def load_all() -> None:
    """Register the built-in methods (idempotent): every module or package of ``fedpartial.methods`` that defines
    ``register_all(register)`` is imported and registers its methods, so a new method is one new module. A module
    that fails to import is an ``ImportError`` naming it, every time (the registry is never taken as loaded
    with a method missing)."""
    import importlib
    import pkgutil

    global _load_state
    if _load_state != "unloaded":
        return
    _load_state = "loading"
    try:
        for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda i: i.name):
            if info.name in ("base", "common"):
                continue
            name = f"{__package__}.{info.name}"
            try:
                module = importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - any error of a method module's import
                raise ImportError(f"method module {name} cannot be imported: {type(e).__name__}: {e}") from e
            if hasattr(module, "register_all"):
                module.register_all(register)
    except BaseException:
        _load_state = "unloaded"
        raise
    _load_state = "loaded"


def get_method(name: str) -> Method:
    load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown method {name!r}{hint} (available: {sorted(_REGISTRY)})") from None


def available_methods() -> list[str]:
    load_all()
    return sorted(_REGISTRY)


def registered() -> list[Method]:
    """Every registered method, sorted by name."""
    load_all()
    return [_REGISTRY[n] for n in sorted(_REGISTRY)]


def comparison_jobs() -> list[str]:
    """``"job:method"`` for every comparison method (its declared job run with that method), sorted: the
    simulator test's list, derived from the registry (a new comparison method adds itself)."""
    return [f"{m.job}:{m.name}" for m in registered() if m.comparison]
