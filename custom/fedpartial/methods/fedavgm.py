"""FedAvgM (Hsu, Qi, Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", 2019): FedAvg with momentum on the server. With ``w`` the global model the sites received and
``avg`` the FedAvg of their updates, each round

    delta = w - avg                 (the pseudo-gradient)
    v    <- beta * v + delta        (v = 0 before the first round)
    w    <- w - eta * v

``beta`` = ``server_momentum`` (0: plain FedAvg at ``eta`` = 1), ``eta`` = ``server_lr``. The momentum ``v`` is
the rule's state: it survives a checkpoint (``state_dict``), so a resumed job continues it instead of
restarting it at zero. Momentum applies to the floating-point tensors; integer buffers (BatchNorm's
``num_batches_tracked``) take the average, and under ``norm: frozen`` / ``local`` the norm layers follow the
``norm`` policy without momentum. Sites train as ``fedavg_pl`` (the partial loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..options import opt
from .base import Contribution, RuleOptions, ServerRule
from .baselines import SupervisedTrainer


def momentum_step(
    previous: np.ndarray, average: np.ndarray, velocity: np.ndarray | None, beta: float, eta: float
) -> tuple[np.ndarray, np.ndarray]:
    """One server step on one tensor: ``(new weights in previous's dtype, new velocity float64)``; all arrays of one
    shape, ``velocity`` None before the first round."""
    delta = np.asarray(previous, dtype=np.float64) - np.asarray(average, dtype=np.float64)
    v = delta if velocity is None else beta * np.asarray(velocity, dtype=np.float64) + delta
    return (np.asarray(previous, dtype=np.float64) - eta * v).astype(np.asarray(previous).dtype), v


@dataclass
class FedAvgMOptions(RuleOptions):
    """FedAvgM's server options (method_args)."""

    server_momentum: float = opt(0.9, "beta, the server momentum (0: FedAvg)")
    server_lr: float = opt(1.0, "eta, the server learning rate applied to the momentum")

    def __post_init__(self):
        if not 0.0 <= self.server_momentum < 1.0 or not self.server_lr > 0.0:
            raise ValueError(
                f"fedavgm: need 0 <= server_momentum < 1 and server_lr > 0, got "
                f"{self.server_momentum} and {self.server_lr}"
            )


class FedAvgMRule(ServerRule):
    """FedAvg of the updates (``site_weighting``, robust options as every rule), then the momentum step above.

    Options: :class:`FedAvgMOptions`.
    """

    Options = FedAvgMOptions

    def __init__(self, **options):
        super().__init__(**options)
        self.velocity: dict[str, np.ndarray] = {}  # tensor name -> v, float64

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        average = self.average(previous, contributions, groups)
        if previous is None:
            return average, {}
        fixed = set(groups.get("norm", ())) if self.opts.norm != "average" else set()
        out = dict(average)
        for k, avg in average.items():
            if k in fixed or not np.issubdtype(np.asarray(avg).dtype, np.floating):
                continue
            out[k], self.velocity[k] = momentum_step(
                previous[k], avg, self.velocity.get(k), self.opts.server_momentum, self.opts.server_lr
            )
        return out, {}

    def state_dict(self) -> dict:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = {k: np.asarray(v.numpy()) for k, v in (state.get("velocity") or {}).items()}


def register_all(register) -> None:
    register(
        "fedavgm",
        SupervisedTrainer,
        FedAvgMRule,
        doc="FedAvgM (Hsu et al. 2019): FedAvg with server momentum",
        job="fedavgm_ich",
        comparison=True,
        missing="partial",
    )
