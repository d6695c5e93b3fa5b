"""FedLSM's server rule: adaptive weighted proxy aggregation (AWPA) of the classifier rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ...aggregation import masked_class_weights
from ...options import opt
from ..base import Contribution, RuleOptions, ServerRule
from .maths import META_Q, awpa_weights


@dataclass
class FedLSMRuleOptions(RuleOptions):
    """FedLSM's server options (method_args)."""

    awpa: Literal["adaptive", "masked", "fedavg"] = opt(
        "adaptive", "classifier rows by q_c^k (Eq. 7), over the annotating sites (Ours*), or FedAvg"
    )


class FedLSMRule(ServerRule):
    """FedAvg (n_k) of the feature extractor; classifier rows by AWPA (Eq. 7) from the sites' ``q_c^k``.

    Options: :class:`FedLSMRuleOptions`.
    """

    Options = FedLSMRuleOptions
    required_metadata = ("annotated",)

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        n = self.site_weights(contributions)
        if self.opts.awpa == "fedavg":
            return self.average(previous, contributions, groups), {}
        if self.opts.awpa == "masked":
            cw = masked_class_weights(np.stack([c.annotated for c in contributions]), n)
            return self.average(previous, contributions, groups, cw, zero_rows="previous"), {}
        lacking = [c.site for c in contributions if META_Q not in c.meta]
        if lacking:
            raise ValueError(f"fedlsm: site(s) {lacking} sent no class counts '{META_Q}' (not FedLSM trainers?)")
        q = np.stack([np.asarray(c.meta[META_Q], dtype=np.float64) for c in contributions])
        return self.average(previous, contributions, groups, awpa_weights(q, n), zero_rows="samples"), {}
