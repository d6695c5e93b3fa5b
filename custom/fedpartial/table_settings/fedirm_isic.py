"""FedIRM's Table 1 (Liu et al., MICCAI 2021) as the bundle runs it: 10 sites of which 2 hold labelled images and 8
unlabelled ones, Adam (betas 0.9 / 0.99, weight decay 5e-4), 10 local steps of batch 32 per round, 10 warm-up
rounds of supervised training before the unlabelled sites join, dropout 0.2 on the pooled feature. On HAM10000 the
authors' start: EfficientNet-Lite0 from the ImageNet weights shipped with the project, 64 px, lr 3e-4, 20 rounds,
5 % of the images for validation (the table of ``benchmarks/start_tables.sh``, ``TABLE=fedirm START=imagenet``; the
small CNN from random weights one option away: ``--set model.arch=small_cnn --set model.pretrained=null``, which
``benchmarks/fedirm_ham10000.sh`` pins with its 30 rounds and lr 1e-3). On the ICH phantom (synthetic images, where
ImageNet's features have nothing to offer and nothing was measured): the small CNN from random weights, lr 1e-3,
30 rounds. The jobs: ``fedirm_isic`` and its baselines ``fedavg_labelled_isic``, ``fedavg_labelled_full_isic``
(every site labelled), ``fed_selftraining_isic``, ``fed_consistency_isic``, and ``fedirm_ich``.
"""

from fedpartial.data.presets import deep_merge

from . import ham10000_fedlsm_split

NUM_SITES = 10
LABELLED_SITES = 2
NUM_ROUNDS = 30
MODEL = {"arch": "small_cnn", "in_channels": 3, "dropout": 0.2}
TRAIN = {
    "optimizer": "adam",
    "lr": 0.001,
    "betas": [0.9, 0.99],
    "weight_decay": 0.0005,
    "batch_size": 32,
    "local_steps": 10,
}
IMAGENET = {  # HAM10000: the authors' start at the budget the HAM10000 tables were measured at (FedLSM's table's)
    "num_rounds": ham10000_fedlsm_split.SETTINGS["num_rounds"],
    "model": {k: ham10000_fedlsm_split.MODEL[k] for k in ("arch", "pretrained")},
    "train": {"lr": ham10000_fedlsm_split.TRAIN["lr"]},
    "dataset": {k: ham10000_fedlsm_split.SETTINGS["dataset"][k] for k in ("image_size", "prepare")},
}
METHOD_ARGS = {"warm_rounds": 10}


def settings(preset: str = "ham10000", protocol: str = "labeled_unlabeled") -> dict:
    """The table's recipe keywords on ``preset`` (``ham10000`` or ``ich_phantom``) with the label ``protocol``
    (``labeled_unlabeled``: ``LABELLED_SITES`` labelled sites; ``full``: every site labelled); the preset's own
    split (HAM10000's FedLSM table, the phantom's missing k) is switched off."""
    prepare: dict = {"num_sites": NUM_SITES, "protocol": protocol}
    if protocol == "labeled_unlabeled":
        prepare["m"] = LABELLED_SITES
    prepare["table" if preset == "ham10000" else "k"] = None
    start = IMAGENET if preset == "ham10000" else {"num_rounds": NUM_ROUNDS, "model": {}, "train": {}, "dataset": {}}
    return dict(
        dataset=deep_merge({"preset": preset, "prepare": prepare}, start["dataset"]),
        num_sites=NUM_SITES,
        num_rounds=start["num_rounds"],
        model={**MODEL, **start["model"]},
        train={**TRAIN, **start["train"]},
    )
