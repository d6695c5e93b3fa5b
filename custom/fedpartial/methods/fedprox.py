"""FedProx (Li et al., MLSys 2020): the supervised local loss plus ``mu/2 ||w - w_global||^2`` against the weights
received this round (NVFlare's ``PTFedProxLoss``). ``fedprox_masked`` adds the class-masked classifier rows
(FedLSM's FedProx*). The whole method is one extra loss term on :class:`~.baselines.SupervisedTrainer`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..options import opt
from .base import ServerRule
from .baselines import MaskedRule, SupervisedOptions, SupervisedTrainer
from .common import frozen_copy


@dataclass
class FedProxOptions(SupervisedOptions):
    mu: float = opt(0.01, "weight of the proximal term mu/2 ||w - w_global||^2")


class FedProxTrainer(SupervisedTrainer):
    Options = FedProxOptions

    def start_round(self, round_num: int, global_meta: dict) -> None:
        from nvflare.app_opt.pt.fedproxloss import PTFedProxLoss  # imported where used: importing the methods

        #                                                              does not import NVFlare's runtime
        self.global_model = frozen_copy(self.ctx.model)  # the weights received this round
        self.prox = PTFedProxLoss(mu=self.opts.mu)

    def extra_loss(self, batch: dict, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.prox(self.ctx.model, self.global_model)


def register_all(register) -> None:
    register(
        "fedprox",
        FedProxTrainer,
        ServerRule,
        doc="FedProx, partial loss",
        job="fedprox_ich",
        comparison=True,
        missing="partial",
    )
    register(
        "fedprox_masked",
        FedProxTrainer,
        MaskedRule,
        doc="FedProx* (class-masked rows)",
        job="fedavg_masked_ham10000",
        comparison=True,
        missing="partial",
    )
