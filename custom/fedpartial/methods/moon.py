"""MOON (Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021): the supervised local loss plus
``mu * l_con``, a contrastive term that pulls the local representation of an image towards the received global
model's and away from the site's previous local model's:

    l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

with ``sim`` the cosine similarity and ``z`` the pooled representation (this project's models have no
projection head; the paper's MLP projection is left out). The previous local model is site state (saved every
round, restored by a fresh process); in a site's first round there is none and ``l_con`` is 0. ``moon_masked``
adds the class-masked classifier rows (FedLSM's MOON*). Both task types.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..options import opt
from .base import ServerRule
from .baselines import MaskedRule, SupervisedOptions, SupervisedTrainer
from .common import frozen_copy


def model_contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """MOON's ``l_con``, mean over the batch: ``z``, ``z_glob``, ``z_prev`` ``(B, D)`` -> scalar."""
    pos = F.cosine_similarity(z, z_glob, dim=1) / tau
    neg = F.cosine_similarity(z, z_prev, dim=1) / tau
    return -(pos - torch.logsumexp(torch.stack([pos, neg], 1), dim=1)).mean()


@dataclass
class MOONOptions(SupervisedOptions):
    mu: float = opt(1.0, "weight of the model-contrastive term")
    tau: float = opt(0.5, "temperature of the model-contrastive term")


class MOONTrainer(SupervisedTrainer):
    Options = MOONOptions

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        self.previous: dict[str, torch.Tensor] | None = None  # the site's local model after its last round

    def start_round(self, round_num: int, global_meta: dict) -> None:
        self.global_model = frozen_copy(self.ctx.model)  # the weights received this round
        self.previous_model = None
        if self.previous is not None:
            self.previous_model = frozen_copy(self.ctx.model)
            self.previous_model.load_state_dict(self.previous)

    def extra_loss(self, batch: dict, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor | None:
        if self.previous_model is None:
            return None
        with torch.no_grad():
            z_glob = self.global_model.features(batch["image"])
            z_prev = self.previous_model.features(batch["image"])
        return self.opts.mu * model_contrastive_loss(features, z_glob, z_prev, self.opts.tau)

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict):
        out = super().train_round(round_num, num_rounds, global_meta)
        self.previous = {k: v.detach().cpu().clone() for k, v in self.ctx.model.state_dict().items()}
        self.global_model = self.previous_model = None
        return out

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.previous is not None:
            state["moon_previous"] = self.previous
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.previous = state.get("moon_previous")


def register_all(register) -> None:
    register(
        "moon",
        MOONTrainer,
        ServerRule,
        doc="MOON (model-contrastive), partial loss",
        job="moon_ich",
        comparison=True,
        missing="partial",
    )
    register(
        "moon_masked",
        MOONTrainer,
        MaskedRule,
        doc="MOON* (class-masked rows)",
        job="fedavg_masked_ham10000",
        comparison=True,
        missing="partial",
    )
