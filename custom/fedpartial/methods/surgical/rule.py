"""Surgical aggregation's server rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...options import opt
from ..base import Contribution
from ..baselines import MaskedRule, MaskedRuleOptions
from .maths import average_norm
from .trainer import META_NORM_FROM_WARMUP


@dataclass
class SurgicalRuleOptions(MaskedRuleOptions):
    """Options of the surgical-aggregation rule (``site_weighting`` / ``row_weighting`` default to 'uniform'
    in the registered methods: the paper's unweighted means)."""

    task_block: Literal["masked", "average"] = opt(
        "masked",
        "last layer: column c over the sites annotating c (surgical), or averaged over all sites "
        "(vanilla FL / FL + partial loss run through the same pipeline)",
    )


class SurgicalRule(MaskedRule):
    """Representation block (every tensor but the last layer): mean over the contributing sites with
    ``site_weighting`` weights (uniform: the paper; 'samples': n_k). Task block (the ``classifier`` group:
    ``weight (C, D)``, ``bias (C,)``): row c = mean over the sites annotating c (``row_weighting``), one
    annotating site keeps its row, no annotating site keeps the previous global row (:class:`MaskedRule`).
    Norm layers per ``norm``: averaged (FedAvg), averaged in the global model but kept local at the sites
    (FedBN), or frozen (FedBN+: the previous global values), except in the round where the sites sent norm
    statistics estimated in their warm-up (no pretrained weights): those are averaged once and frozen from then on.
    """

    Options = SurgicalRuleOptions

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        if self.opts.task_block == "masked":
            out, meta = super().aggregate(previous, contributions, groups, round_num, summary)
        else:
            out, meta = self.average(previous, contributions, groups), {}
        if self.opts.norm == "frozen" and any(c.meta.get(META_NORM_FROM_WARMUP) for c in contributions):
            out.update(
                average_norm(
                    [c.weights for c in contributions], self.site_weights(contributions), groups.get("norm", ())
                )
            )
        return out, meta
