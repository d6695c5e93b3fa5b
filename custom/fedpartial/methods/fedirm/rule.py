"""FedIRM's server rule: FedAvg of the weights and the average of the labelled sites' relation matrices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ...aggregation import robust_rows
from ...options import opt
from ..base import Contribution, RuleOptions, ServerRule
from .maths import META_GLOBAL_RELATION, META_GLOBAL_VALID, META_RELATION, META_RELATION_VALID, server_relation


@dataclass
class FedIRMRuleOptions(RuleOptions):
    """FedIRM's server options (method_args). ``site_weighting`` (FedAvg of the weights): ``samples`` is the
    paper's n_k / N, ``uniform`` the released code."""

    relation_weighting: Literal["uniform", "samples"] = opt(
        "uniform", "labelled sites' matrices: 1/m (paper, code) or n_k weights"
    )
    require_unlabelled: bool = opt(
        True, "refuse a federation without an unlabelled site (FedIRM; off for the baselines)"
    )


def _labelled(info: dict) -> bool:
    return bool(np.asarray(info.get("annotated", []), dtype=bool).any())


class FedIRMRule(ServerRule):
    """FedAvg (``site_weighting``) of the weights of the sites that trained this round; the global relation
    matrix ``M = (1/m) sum_l M^l`` over the labelled sites only (rows each site estimated this round), sent
    to every site with the next model; a row no labelled site estimated keeps its previous value. The matrix
    is part of the rule's state (it survives a restart of the rule). Under ``robust: median / trimmed_mean`` each
    row is the coordinate-wise median / trimmed mean over the same sites (unweighted), as the weights.

    Options: :class:`FedIRMRuleOptions`.
    """

    Options = FedIRMRuleOptions
    required_metadata = ("annotated",)

    def __init__(self, **options):
        super().__init__(**options)
        self.relation: torch.Tensor | None = None  # (C, C)
        self.valid: torch.Tensor | None = None  # (C,) bool

    def check_federation(self, summary: dict) -> None:
        sites = summary.get("sites", {})
        labelled = sorted(s for s, i in sites.items() if _labelled(i))
        unlabelled = sorted(s for s, i in sites.items() if not _labelled(i))
        if not labelled:
            raise ValueError(
                f"FedIRM needs at least one labelled site; every site ({', '.join(sorted(sites))}) annotates no class"
            )
        if self.opts.require_unlabelled and not unlabelled:
            raise ValueError(
                f"FedIRM needs at least one unlabelled site; every site ({', '.join(labelled)}) is "
                "labelled (train them with fedavg_labelled, the all-labelled FedAvg)"
            )

    def update_relation(self, contributions: list[Contribution]) -> None:
        """Average the matrices of the labelled contributors (a matrix from an unlabelled site is ignored)."""
        with_m = [c for c in contributions if c.annotated.any() and META_RELATION in c.meta]
        if not with_m:
            return
        m = torch.stack([torch.as_tensor(np.asarray(c.meta[META_RELATION]), dtype=torch.float64) for c in with_m])
        v = torch.stack([torch.as_tensor(np.asarray(c.meta[META_RELATION_VALID]), dtype=torch.bool) for c in with_m])
        w = None if self.opts.relation_weighting == "uniform" else torch.as_tensor([c.n for c in with_m])
        g, valid = server_relation(m, v, w)
        if self.opts.robust != "none":  # each row over the same sites, their coordinate-wise median / trimmed mean
            g = torch.as_tensor(robust_rows(list(m.numpy()), v.numpy(), g.numpy(), self.opts.robust, self.opts.trim))
        if self.relation is None or self.relation.shape != g.shape:
            self.relation, self.valid = g, valid
        else:
            self.relation = torch.where(valid[:, None], g, self.relation)
            self.valid = self.valid | valid

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        weights = self.average(previous, contributions, groups)
        self.update_relation(contributions)
        if self.relation is None:
            return weights, {}
        return weights, {
            META_GLOBAL_RELATION: self.relation.numpy().astype(np.float64),
            META_GLOBAL_VALID: [int(v) for v in self.valid],
        }

    def state_dict(self) -> dict:
        return {} if self.relation is None else {"relation": self.relation, "valid": self.valid}

    def load_state_dict(self, state: dict) -> None:
        self.relation, self.valid = state.get("relation"), state.get("valid")
