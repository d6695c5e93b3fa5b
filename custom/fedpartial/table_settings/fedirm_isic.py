"""FedIRM's Table 1 (Liu et al., MICCAI 2021) as the bundle runs it: 10 sites of which 2 hold labelled images and 8
unlabelled ones, 30 rounds, a small CNN with dropout, Adam (betas 0.9 / 0.99, weight decay 5e-4), 10 local steps
of batch 32 per round, 10 warm-up rounds of supervised training before the unlabelled sites join. The jobs:
``fedirm_isic`` and its baselines ``fedavg_labelled_isic``, ``fedavg_labelled_full_isic`` (every site labelled),
``fed_selftraining_isic``, ``fed_consistency_isic``, and ``fedirm_ich`` (the same on the ICH phantom); the table:
``benchmarks/fedirm_ham10000.sh``.
"""

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
METHOD_ARGS = {"warm_rounds": 10}


def settings(preset: str = "ham10000", protocol: str = "labeled_unlabeled") -> dict:
    """The table's recipe keywords on ``preset`` (``ham10000`` or ``ich_phantom``) with the label ``protocol``
    (``labeled_unlabeled``: ``LABELLED_SITES`` labelled sites; ``full``: every site labelled); the preset's own
    split (HAM10000's FedLSM table, the phantom's missing k) is switched off."""
    prepare: dict = {"num_sites": NUM_SITES, "protocol": protocol}
    if protocol == "labeled_unlabeled":
        prepare["m"] = LABELLED_SITES
    prepare["table" if preset == "ham10000" else "k"] = None
    return dict(
        dataset={"preset": preset, "prepare": prepare},
        num_sites=NUM_SITES,
        num_rounds=NUM_ROUNDS,
        model=dict(MODEL),
        train=dict(TRAIN),
    )
