"""FedMLP's published configuration (Sun et al., MICCAI 2024, Sec. 3.1.3): an encoder started from ImageNet, Adam
lr 3e-5 with L2 regularisation, batch 32, one local epoch, 500 rounds, t1 = 50 warm-up rounds (stage 1: L_WPC only),
L = 0.3, R = 0.7, T0 = 0.5 %, T1 = 1 %, the paper's parity; tested every 10 rounds. The jobs ``fedmlp_ich_paper``
(RSNA ICH) and ``fedmlp_cxr14_paper`` (NIH ChestX-ray14); the data is not shipped.

The paper's encoder is torchvision's ResNet-18 from ImageNet. The ImageNet start shipped with the project is
EfficientNet-Lite0's (``model.pretrained: imagenet``), so that is the jobs' default: the authors' start, another
backbone. ``RESNET18_IMAGENET`` is the paper's own, for a site that holds torchvision's file
(``--set model.arch=resnet18 --set model.pretrained=/weights/resnet18-f37072fd.pth``); ``pretrained: null``
trains from random weights.
"""

NUM_ROUNDS = 500
TRAIN = {
    "optimizer": "adam",
    "lr": 3e-05,
    "weight_decay": 0.0005,
    "batch_size": 32,
    "local_epochs": 1,
    "num_workers": 4,
}
EVALUATION = {"test_every": 10, "batch_size": 128}
RESNET18_IMAGENET = "resnet18-f37072fd.pth"  # torchvision's ImageNet ResNet-18, the paper's start (not shipped)
METHOD_ARGS = dict(warmup_rounds=50, L=0.3, R=0.7, T0=0.005, T1=0.01, cr_warmup=False, parity="paper")


def settings(in_channels: int) -> dict:
    """The recipe keywords of a paper job whose images have ``in_channels`` channels (the method's options
    included, for :class:`~fedpartial.recipes.FedMLPRecipe`)."""
    return dict(
        num_rounds=NUM_ROUNDS,
        model={"arch": "efficientnet_lite0", "in_channels": in_channels, "pretrained": "imagenet"},
        train=dict(TRAIN),
        evaluation=dict(EVALUATION),
        **METHOD_ARGS,
    )
