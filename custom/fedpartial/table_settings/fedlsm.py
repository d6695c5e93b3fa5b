"""FedLSM's training (Deng, Luo, Chen, MICCAI 2023, and the authors' code): Adam (lr 1e-3, betas 0.9 / 0.99) whose
state a site keeps across rounds, batch 64, a fixed number of local steps per round, adaptive weighted proxy
aggregation (AWPA). The jobs ``fedlsm_isic`` (HAM10000, 30 local steps) and ``fedlsm_cxr14`` (10 local steps).
"""

AWPA = "adaptive"


def train(local_steps: int) -> dict:
    """The ``train`` options of a FedLSM job with ``local_steps`` local steps per round."""
    return {
        "optimizer": "adam",
        "lr": 0.001,
        "betas": [0.9, 0.99],
        "batch_size": 64,
        "local_steps": local_steps,
        "keep_optimizer_state": True,
    }
