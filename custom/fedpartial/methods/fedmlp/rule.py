"""FedMLP's server rule: FedAvg of the weights, global prototypes and learning degrees back to the sites."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from ...aggregation import robust_rows
from ...options import opt
from ..base import Contribution, RuleOptions, ServerRule
from .maths import (
    META_COUNTS,
    META_DEGREE,
    META_GLOBAL_DEGREE,
    META_GLOBAL_P0,
    META_GLOBAL_P1,
    META_GLOBAL_VALID,
    META_P0,
    META_P1,
    aggregate_learning_degree,
    aggregate_prototypes,
)


@dataclass
class FedMLPRuleOptions(RuleOptions):
    """FedMLP's server options (method_args)."""

    parity: Literal["paper", "code"] = opt("paper", "'code': prototypes averaged with n_k weights (released code)")
    proto_weighting: Literal["uniform", "samples"] | None = opt(
        None, "Eq. 6 weights: uniform 1/|S_c| or n_k; overrides parity"
    )


class FedMLPRule(ServerRule):
    """FedAvg (n_k) of the weights; global prototypes (Eq. 6) over the sites annotating each class and the
    global learning degree (Eq. 10) over the sites missing it, sent to the sites as the next round's meta.

    Options: :class:`FedMLPRuleOptions`.

    A class no contributing site annotates this round keeps its previous global prototypes; a class no
    contributing site misses keeps its previous degree (1 if none yet). Under ``robust: median / trimmed_mean``
    each global prototype and degree is the coordinate-wise median / trimmed mean over the same sites (unweighted),
    as the weights: one site's statistics cannot pull them past the honest sites' range.
    """

    Options = FedMLPRuleOptions
    required_metadata = ("annotated",)

    def __init__(self, **options):
        super().__init__(**options)
        self.proto_weighting = self.opts.proto_weighting or ("samples" if self.opts.parity == "code" else "uniform")
        self.p0: torch.Tensor | None = None
        self.p1: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.degree: torch.Tensor | None = None

    def aggregate(self, previous, contributions: list[Contribution], groups, round_num, summary=None):
        weights = self.average(previous, contributions, groups)
        with_stats = [c for c in contributions if META_P0 in c.meta]
        if with_stats:
            self._update(with_stats)
        if self.p0 is None:
            return weights, {}
        return weights, {
            META_GLOBAL_P0: self.p0.numpy().astype(np.float32),
            META_GLOBAL_P1: self.p1.numpy().astype(np.float32),
            META_GLOBAL_VALID: self.valid.tolist(),
            META_GLOBAL_DEGREE: [float(v) for v in self.degree],
        }

    def _update(self, contributions: Sequence[Contribution]) -> None:
        p0 = torch.stack([torch.as_tensor(np.asarray(c.meta[META_P0]), dtype=torch.float32) for c in contributions])
        p1 = torch.stack([torch.as_tensor(np.asarray(c.meta[META_P1]), dtype=torch.float32) for c in contributions])
        counts = torch.stack(
            [torch.as_tensor(np.asarray(c.meta[META_COUNTS]), dtype=torch.int64) for c in contributions]
        )
        annotated = torch.stack([torch.as_tensor(c.annotated, dtype=torch.bool) for c in contributions])
        sizes = torch.as_tensor([c.n for c in contributions], dtype=torch.float64)
        g0, g1, valid = aggregate_prototypes(
            p0, p1, counts, annotated, sizes if self.proto_weighting == "samples" else None
        )
        if self.opts.robust != "none":  # the same sites per prototype, their coordinate-wise median / trimmed mean
            g0, g1 = (
                torch.as_tensor(
                    robust_rows(
                        p.numpy(),
                        (annotated & (counts[..., j] > 0)).numpy(),
                        g.numpy(),
                        self.opts.robust,
                        self.opts.trim,
                    )
                )
                for j, (p, g) in enumerate(((p0, g0), (p1, g1)))
            )
        if self.p0 is None or self.p0.shape != g0.shape:
            self.p0, self.p1, self.valid = g0, g1, valid
        else:  # keep the previous prototype where nobody contributed one this round
            self.p0 = torch.where(valid[:, :1], g0, self.p0)
            self.p1 = torch.where(valid[:, 1:], g1, self.p1)
            self.valid = self.valid | valid
        degrees = torch.stack(
            [torch.as_tensor(np.asarray(c.meta[META_DEGREE]), dtype=torch.float64) for c in contributions]
        )
        missing = ~annotated
        d = aggregate_learning_degree(degrees, sizes, missing)
        if self.opts.robust != "none":  # over the same sites (those missing c), unweighted
            d = torch.as_tensor(
                robust_rows(list(degrees.numpy()), missing.numpy(), d.numpy(), self.opts.robust, self.opts.trim)
            )
        if self.degree is not None and self.degree.shape == d.shape:
            d = torch.where(missing.any(0), d, self.degree)
        self.degree = d

    def state_dict(self) -> dict:
        """Nothing: the rule's state is exactly the metadata it sends (global prototypes, which classes have them,
        degrees), stored once in the server checkpoint with the global model and given back by
        :meth:`load_sent_meta`."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        for k in ("p0", "p1", "valid", "degree"):  # a checkpoint written when the state was saved separately
            if state.get(k) is not None:
                setattr(self, k, state[k])

    def load_sent_meta(self, meta: dict) -> None:
        """Rebuild ``p0``, ``p1`` ``(C, D)`` float32, ``valid`` ``(C, 2)`` bool and ``degree`` ``(C,)`` float64 from
        the metadata sent last (as :meth:`aggregate` returned it, after NVFlare's and the checkpoint's conversion to
        lists); nothing when it holds no prototypes (stage 1)."""
        if META_GLOBAL_P0 not in meta:
            return
        self.p0 = torch.as_tensor(np.asarray(meta[META_GLOBAL_P0], dtype=np.float32))
        self.p1 = torch.as_tensor(np.asarray(meta[META_GLOBAL_P1], dtype=np.float32))
        self.valid = torch.as_tensor(np.asarray(meta[META_GLOBAL_VALID], dtype=bool))
        self.degree = torch.as_tensor(np.asarray(meta[META_GLOBAL_DEGREE], dtype=np.float64))
