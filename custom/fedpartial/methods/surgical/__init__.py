"""Surgical aggregation (Kulkarni, Kanhere, Yi, Parekh, "Surgical Aggregation: Federated Class-Heterogeneous
Learning"; released TensorFlow code UM2ii/SurgicalAggregation) and the paper's baselines that need more than an
option of ``fedavg``: PFL and the individually trained models.

The model is the representation block plus the task block. With ``model.head_hidden: 256, head_dropout: 0.3``
every backbone ends as the paper's: global average pooling -> Dense(256, ReLU) -> Dropout(0.3) -> Dense(C);
only the last Dense is the task block (the ``classifier`` parameter group, ``weight (C, 256)``, ``bias (C,)``).

- Site, round 0 (its first round) = the local warm-up (:class:`SurgicalTrainer`): representation frozen, the
  fully connected head trained for ``warmup_epochs`` (15) epochs with Adam (``warmup_lr``), partial BCE over the
  site's own classes, the epoch with the lowest local validation BCE kept (the last one without val data).
  ``warmup_train: ['classifier']`` trains only the last layer. Without pretrained weights the BatchNorm
  statistics are first estimated over the site's images (one pass, encoder frozen).
- Site, rounds 1..: ``train.local_epochs`` of partial BCE (``missing: partial``) on all trainable layers.
- Server (:class:`SurgicalRule`): representation = unweighted mean over sites (``site_weighting: samples`` =
  FedAvg's n_k); task block row c = unweighted mean over the sites annotating c (one site: its row; none this
  round: the previous row). ``norm``: ``frozen`` (FedBN+, the default: norm layers in eval mode with their
  affine parameters fixed; with pretrained weights frozen at the pretrained statistics, without them at the
  average of the sites' warm-up statistics, averaged once after round 0), ``local`` (FedBN: each site keeps its
  own, the global model holds their average) or ``average`` (FedAvg).

Registered methods:

- ``surgical``: the method (FedBN+, unweighted means).
- ``pfl``: the PFL baseline: the same, but each site keeps its own task block (``keep_local: ['classifier']``);
  evaluated per site on its own classes (``own_classes`` in results.json).
- ``individual``: each site trains alone (warm-up, then local training; nothing taken from the server);
  evaluated per site on its own classes. After the warm-up BatchNorm trains (``norm: average``: the paper's
  individually trained baseline is "standard deep learning"); ``norm: frozen`` freezes the norm layers (eval mode,
  affine fixed) as the released ``src/local.py`` (``layer.trainable = False`` for every BatchNormalization layer
  before fine-tuning).

Vanilla FL and FL with partial loss through the same pipeline (warm-up, unweighted means, same norm strategy):
``surgical`` with ``task_block: average`` and ``missing: negatives`` / ``partial``. The plain ``fedavg`` /
``fedavg_pl`` methods (no warm-up, FedAvg weights) take ``norm`` too. The centralised baseline is the data
protocol option ``centralise`` of ``fedpartial-prepare`` (one site holding every site's rows with their partial
labels) run with ``fedavg`` (missing labels as negatives).

Not here (server-side, shared with every method, :mod:`fedpartial.fl.selection`): model selection and early
stopping. The paper selects the global model by the mean local validation BCE ("Convergence of the global model
is determined by the mean of local validation BCE loss for each client"): the model selector's
``key_metric: site_bce`` (each site's BCE over its own annotated classes, averaged over the sites; the surgical
jobs should use it rather than AUC). The released ``src/federated.py`` also stops early on that loss with
``patience: 25`` and ``min_delta: 1e-4`` (a round restarts the count only when it improves by more than 1e-4;
the selector's ``patience`` and ``min_delta``). The evaluation statistics are in :mod:`fedpartial.stats`.
"""

from __future__ import annotations

from .maths import average_norm, estimate_norm_statistics, freeze_for_warmup, local_bce
from .rule import SurgicalRule, SurgicalRuleOptions
from .trainer import IndividualTrainer, SurgicalOptions, SurgicalTrainer

__all__ = [
    "SurgicalRule",
    "SurgicalRuleOptions",
    "SurgicalTrainer",
    "SurgicalOptions",
    "IndividualTrainer",
    "average_norm",
    "estimate_norm_statistics",
    "freeze_for_warmup",
    "local_bce",
    "register_all",
]

PAPER = dict(missing="partial", norm="frozen", site_weighting="uniform", row_weighting="uniform")


def register_all(register) -> None:
    register("surgical", SurgicalTrainer, SurgicalRule, doc="surgical aggregation (FedBN+ by default)", **PAPER)
    register(
        "pfl",
        SurgicalTrainer,
        SurgicalRule,
        doc="PFL baseline: shared representation, local task blocks",
        **PAPER,
        keep_local=["classifier"],
    )
    register(
        "individual",
        IndividualTrainer,
        SurgicalRule,
        doc="individually trained models (nothing shared)",
        **{**PAPER, "norm": "average"},
    )
