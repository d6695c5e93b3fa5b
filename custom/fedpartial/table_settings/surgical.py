"""Surgical aggregation's settings (Kulkarni, Kanhere, Yi, Parekh 2023): a small CNN with a 256-unit head
(dropout 0.3), 15 local warm-up epochs at lr 0.005, FedBN+ (``norm: local``), and the model chosen by the lowest
mean local validation BCE. The jobs ``surgical_ich``, ``pfl_ich`` (its PFL baseline, same data) and
``surgical_cxr14``.
"""

KEY_METRIC = "site_bce"  # the paper selects the model with the lowest mean local validation BCE
METHOD_ARGS = {"warmup_epochs": 15, "warmup_lr": 0.005, "norm": "local"}


def model(in_channels: int) -> dict:
    """The model of a surgical aggregation job on images of ``in_channels`` channels."""
    return {"arch": "small_cnn", "in_channels": in_channels, "head_hidden": 256, "head_dropout": 0.3}


# the ICH phantom, each of 5 sites annotating 2 of the 5 subtypes (missing 3), 20 rounds
ICH = dict(
    dataset={"preset": "ich_phantom", "prepare": {"protocol": "missing_k", "k": 3}},
    num_sites=5,
    num_rounds=20,
    key_metric=KEY_METRIC,
    model=model(3),
)
