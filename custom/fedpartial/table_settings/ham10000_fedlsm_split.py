"""The HAM10000 table on FedLSM's label-set split (README.md "Jobs": 5 sites x 3 classes, single-label; the
``ham10000`` preset's ``fedlsm_isic`` table): FedLSM's authors start from ImageNet, so every job of the table does
too: EfficientNet-Lite0 from the ImageNet weights shipped with the project, at 64 px, Adam lr 3e-4, 20 rounds of
10 local steps of batch 32, 5 % of the images for validation. That is the configuration of the table measured in
``benchmarks/start_tables.sh`` (``TABLE=fedlsm START=imagenet``), so a job's command runs one of its rows.

One option away: random weights (``--set model.pretrained=null``), the small CNN of the older tables
(``--set model.arch=small_cnn --set model.pretrained=null``: ``benchmarks/fedlsm_ham10000.sh`` and
``benchmarks/paper_tables.sh`` pin it), the paper's DenseNet-121 at 224 px (``--set model.arch=densenet121 --set
dataset.image_size=224``, with ``model.pretrained`` a weights file a site holds: docs/warm-start.md).
"""

MODEL = {"arch": "efficientnet_lite0", "in_channels": 3, "pretrained": "imagenet"}
TRAIN = {"optimizer": "adam", "lr": 0.0003, "batch_size": 32, "local_steps": 10}
_PREPARE = {"val_frac": 0.05}
SETTINGS = dict(
    dataset={"preset": "ham10000", "image_size": 64, "prepare": dict(_PREPARE)},
    num_sites=5,
    num_rounds=20,
    model=dict(MODEL),
    train=dict(TRAIN),
)
ALL_LABELS = {"preset": "ham10000", "image_size": 64, "prepare": {**_PREPARE, "protocol": "full", "table": None}}
"""The upper bound's data: every site annotates every class."""
SELF_SUPERVISED = {**SETTINGS, "model": {**MODEL, "pretrained": None}}
"""The self-supervised stage's settings: the table's model from random weights (``--set model.pretrained=imagenet``
continues ImageNet's), its budget."""
