"""FedPU (Lin, Chen, Xu, Xu, Gui, Deng, Wang, "Federated Learning with Positive and Unlabeled Data", ICML 2022;
released code littleSunlxy/FedPU-torch): at site k the classes it labels, ``P_k``, are its *positive* classes;
its images of other classes are *unlabelled*. The site minimises the cross-entropy on its labelled images plus a
multi-class positive-unlabelled (PU) risk: the risk that data which is not of class ``i`` (the negatives of the
site, which may come from several classes it does not know) is classified as ``i``, for every ``i`` in ``P_k``,
estimated from the unlabelled images and the labelled positives with class priors ``pi_i``. The risk of the
negative classes among themselves is left to the sites where those classes are positive; FedAvg combines them.

Notation (one batch): ``p = softmax(z)`` ``(B, C)``; ``lbar_i(x) = -log(1 - p_i(x))`` the loss of "x is not class
i"; ``L_i`` the labelled rows of class ``i``; ``U`` the unlabelled rows (rows whose class is not annotated here,
see :func:`fedpartial.losses.labelled_rows`; every row with ``unlabelled: all``).

    L_k = CE(labelled rows) + pu_weight * R_PU
    R_PU = sum_{i in P_k} [ mean_{x in U} lbar_i(x) - pi_i * mean_{x in L_i} lbar_i(x) ]          (form "paper")

Why the subtraction: if the unlabelled images hold a share ``pi_i`` of class-i images (as FedPU's data, where only
a fraction of each positive class is labelled), then ``E_U[lbar_i] - pi_i E_{P_i}[lbar_i]`` is the "not i" risk of
the rest of U, i.e. of the data that truly is not class i: an unbiased estimate of the negatives' risk of being
classified as i (the multi-class form of uPU, du Plessis et al. 2015). An empty set contributes 0.
``non_negative: true`` clamps each class's term at 0 (the nnPU estimator of Kiryo et al. 2017; not in the
released code): the estimate can go negative when the prior overstates the positives hidden in U.

Readings (the paper's method section was not available, only its abstract; the risk above is
the decomposition the abstract describes written with the released code's per-class terms):

- the labelled term is the mean cross-entropy over the labelled rows (softmax over all C classes), as the
  released code, which equals the risk's prior-weighted sum of per-class means when the batch's class shares
  match the priors;
- ``lbar_i`` is computed stably as ``logsumexp_j z_j - logsumexp_{j != i} z_j`` (the code: ``-log(1 - p + 1e-6)``);
- the unlabelled sample U (``unlabelled``): ``rows`` (default, the released code: labelled and unlabelled sets
  are disjoint) or ``all`` (every row of the batch: U is then a sample of the site's data, the case-control PU
  setting);
- priors ``pi_i`` (``prior``): ``unlabelled`` (default) = FedPU's definition, the share of class i in U (the
  released code counts it from the true labels). With ``unlabelled: rows`` it is 0 for every class the site
  annotates: a site's manifest annotates its classes on all of its images (every protocol of this project),
  so U holds none of them (a warning is logged when some rows of the site leave an annotated class blank, where
  0 may be wrong); the estimator is then exact and ``R_PU = sum_i mean_U lbar_i``. With ``unlabelled: all`` it is
  the site's labelled share of class i. ``site`` = the site's labelled count of class i over its training-set
  size; ``summary`` = the federation's share of class i over the rows annotated for i at every site, from the
  server's data summary (the site's own shares, with a warning, when no summary came).

Priors that do not match U bias the estimate downwards without bound: with ``unlabelled: rows`` and ``prior:
site`` the term ``-pi_i mean_{L_i} lbar_i`` rewards ``p_i -> 1`` on the labelled positives with nothing in U
to balance it (on a 3-site fake federation the round's mean PU risk fell to -17 in 10 rounds); with
``unlabelled: all`` and ``prior: site`` it is unbiased for the whole set but a batch holding fewer class-i rows
than ``pi_i`` still gives them a negative weight (mean risk -0.5 there); ``non_negative: true`` bounds both.

``form: code`` is the released code's ``MPULoss_V2`` (``modules/loss.py``), kept as it is:
``pu3 = sum_{x in U} sum_{i in P} lbar_i(x) / |U| / |P|``,
``pu1 = sum_{x in L} sum_{i in P} lbar_i(x) * pi_{P[0]} / |L| / (C - |P|)`` (only when ``C > |P|``; P[0] the
first positive class),
``pu2 = -sum_{x in L} sum_c pi_c * (-log(1 - p_c(x) 1[c = y_x] + 1e-6)) / |L|``, ``R_PU = pu1 + pu2 + pu3`` with
``lbar = -log(1 - p + 1e-6)`` and ``|.|`` at least 1; its priors are the share of each class among the client's
unlabelled images, which the code reads from the true labels (here ``prior`` as above); its U is always the
unlabelled rows and it has no non-negative correction.

Single-label only (FedLSM: "not applicable to multi-label classification"); FedAvg on the server.

Counters in each round's site meta (``results.json``, ``site_stats``): ``fedpu_prior`` ``(C,)`` the priors used,
``fedpu_ce`` / ``fedpu_pu_risk`` the mean cross-entropy and the mean (unweighted) PU risk over the round's steps,
``fedpu_unlabelled`` the unlabelled rows seen, ``fedpu_clamped`` the class terms clamped at 0 (``non_negative``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..losses import labelled_rows, row_ce
from ..options import opt
from .base import RoundOutput, ServerRule, summary_counts
from .baselines import SupervisedOptions, SupervisedTrainer
from .common import DeviceSums, label_table

META_PRIOR = "fedpu_prior"  # (C,) the class priors pi used this round
META_CE = "fedpu_ce"  # mean cross-entropy on the labelled rows over the round's steps
META_PU = "fedpu_pu_risk"  # mean PU risk R_PU over the round's steps (before pu_weight)
META_UNLABELLED = "fedpu_unlabelled"  # unlabelled rows seen this round
META_CLAMPED = "fedpu_clamped"  # class terms clamped at 0 this round (non_negative)

CODE_EPS = 1e-6  # MPULoss_V2's eps


def not_class_loss(logits: torch.Tensor) -> torch.Tensor:
    """``lbar (B, C)``: ``-log(1 - softmax(z)_i)`` for every class, as ``logsumexp z - logsumexp_{j != i} z_j``."""
    c = logits.shape[1]
    eye = torch.eye(c, dtype=torch.bool, device=logits.device)
    others = logits[:, None, :].masked_fill(eye[None], float("-inf"))  # (B, C, C): row i without class i
    return torch.logsumexp(logits, dim=1, keepdim=True) - torch.logsumexp(others, dim=2)


def row_classes(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` long: the class of each labelled row, -1 for an unlabelled row."""
    rows = labelled_rows(labels, mask)
    return torch.where(rows, (labels * mask.to(labels.dtype)).argmax(1), torch.full_like(rows, -1, dtype=torch.long))


def pu_risk(
    logits: torch.Tensor,
    y: torch.Tensor,
    positive: torch.Tensor,
    prior: torch.Tensor,
    non_negative: bool = False,
    all_rows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedPU's PU risk (form "paper", see the module docstring).

    Args:
        logits: ``(B, C)``; y: ``(B,)`` class of a labelled row, -1 for an unlabelled row;
        positive: ``(C,)`` bool, the site's classes P_k; prior: ``(C,)`` pi.
        non_negative: clamp each class's term at 0 (nnPU).
        all_rows: U is every row of the batch (labelled ones included), not only the unlabelled rows.

    Returns:
        ``(R_PU scalar, terms (C,))`` with ``terms[i] = mean_U lbar_i - pi_i mean_{L_i} lbar_i`` for i in P_k
        (before the clamp: a negative entry is a clamped term under ``non_negative``), 0 elsewhere.
    """
    nl = not_class_loss(logits)
    pos = positive.to(logits.device, non_blocking=True).bool()
    lab = y >= 0
    unl = torch.ones_like(lab) if all_rows else ~lab
    zero = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device)
    # row selections as masks over the whole batch (no row count read back to the host)
    u_mean = torch.where(unl[:, None], nl, 0.0).sum(0) / unl.sum().clamp_min(1).to(nl.dtype)
    onehot = F.one_hot(y.clamp_min(0), logits.shape[1]).to(logits.dtype) * lab[:, None].to(logits.dtype)
    l_mean = (onehot * nl).sum(0) / onehot.sum(0).clamp_min(1.0)
    terms = torch.where(pos, u_mean - prior.to(logits.device, logits.dtype, non_blocking=True) * l_mean, zero)
    used = terms.clamp_min(0.0) if non_negative else terms
    return used.sum() + logits.sum() * 0.0, terms


def pu_risk_code(logits: torch.Tensor, y: torch.Tensor, positive: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """The released code's ``MPULoss_V2`` PU term ``pu1 + pu2 + pu3`` (form "code", see the module docstring);
    arguments as :func:`pu_risk`."""
    p = torch.softmax(logits, dim=1)
    c = logits.shape[1]
    k = int(positive.sum())  # positive and its first class read where they live (the host for a site's P_k)
    first = int(torch.nonzero(positive > 0)[0]) if k else 0
    pos = positive.to(logits.device, non_blocking=True).to(p.dtype)
    prior = prior.to(logits.device, p.dtype, non_blocking=True)
    unl, lab = (y < 0)[:, None], (y >= 0)[:, None]  # (B, 1) row selections over the whole batch
    n_u, n_l = unl.sum().clamp_min(1).to(p.dtype), lab.sum().clamp_min(1).to(p.dtype)
    risk = torch.where(unl, -torch.log(1 - p + CODE_EPS) * pos, 0.0).sum() / n_u / max(k, 1)  # pu3
    if c > k and k > 0:  # pu1: the prior of the first positive class
        risk = risk + torch.where(lab, -torch.log(1 - p + CODE_EPS) * pos, 0.0).sum() * prior[first] / n_l / (c - k)
    onehot = F.one_hot(y.clamp_min(0), c).to(p.dtype)
    risk = risk - torch.where(lab, -torch.log(1 - p * onehot + CODE_EPS) * prior, 0.0).sum() / n_l  # pu2
    return risk


def class_priors(
    kind: str, labels: torch.Tensor, mask: torch.Tensor, summary: dict | None, num_classes: int, all_rows: bool = False
) -> torch.Tensor:
    """``(C,)`` priors pi: ``site`` = labelled count of c / N (``labels``, ``mask`` ``(N, C)``: the site's table),
    ``summary`` = positives_c / (positives_c + negatives_c) over every site annotating c (0 where none does),
    ``unlabelled`` = the share of c in U: the site shares when U is every row (``all_rows``), else 0 (U holds
    no image of a class annotated on every row)."""
    if kind == "unlabelled":
        kind = "site" if all_rows else "zero"
    if kind == "zero":
        return torch.zeros(num_classes)
    if kind == "summary":
        pos, neg = summary_counts(summary, num_classes)
        total = pos + neg
        return torch.where(total > 0, pos / total.clamp_min(1.0), torch.zeros_like(pos)).float()
    n = max(labels.shape[0], 1)
    return ((labels * mask.float()).sum(0) / n).float()


@dataclass
class FedPUOptions(SupervisedOptions):
    """FedPU's site options (method_args); ``missing`` does not apply (the labelled term is CE over all classes)."""

    pu_weight: float = opt(1.0, "weight of the PU risk (the code's pu_weight)")
    prior: Literal["unlabelled", "site", "summary"] = opt(
        "unlabelled",
        "class priors pi: the share of each class in U (FedPU; 0 with unlabelled: rows), the site's "
        "labelled share, or the federation's (data summary)",
    )
    non_negative: bool = opt(False, "clamp each class's PU term at 0 (nnPU; not in the released code)")
    form: Literal["paper", "code"] = opt("paper", "the PU risk as derived (paper) or the released MPULoss_V2 (code)")
    unlabelled: Literal["rows", "all"] = opt(
        "rows",
        "the unlabelled sample U: the rows without a label (the released code) or every row of the batch "
        "(a sample of the site's data, whose class shares are the site priors)",
    )

    def __post_init__(self):
        if self.pu_weight < 0:
            raise ValueError(f"fedpu: pu_weight must be >= 0, got {self.pu_weight}")


class FedPUTrainer(SupervisedTrainer):
    """FedPU at one site: CE on the labelled rows + ``pu_weight * R_PU`` (its ``label_loss``).

    Options: :class:`FedPUOptions`.
    """

    Options = FedPUOptions
    tasks = ("multiclass",)

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        self.positive = torch.as_tensor(np.asarray(ctx.annotated, dtype=bool))
        self.prior = torch.zeros(ctx.num_classes)
        self._warned_summary = self._warned_blank = False
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._sums, self._steps = DeviceSums(), 0  # read once, after the round

    def priors(self) -> torch.Tensor:
        """``(C,)`` the priors of this round (option ``prior``)."""
        labels, mask = label_table(self.ctx.data)
        kind, all_rows = self.opts.prior, self.opts.unlabelled == "all"
        if kind == "summary" and not self.ctx.summary:
            if not self._warned_summary:
                self.ctx.log.warning("fedpu: no data summary received; class priors from the site's labels")
                self._warned_summary = True
            kind = "site"
        if kind == "unlabelled" and not all_rows and not self._warned_blank:
            idx = torch.nonzero(self.positive).flatten().tolist()
            blank = [self.ctx.classes[i] for i in idx if not bool(mask[:, i].all())]
            if blank:
                self.ctx.log.warning(
                    f"fedpu: site '{self.ctx.site}' leaves {blank} blank on some rows; the prior of "
                    "those classes in U is taken as 0"
                )
                self._warned_blank = True
        return class_priors(kind, labels, mask, self.ctx.summary, self.ctx.num_classes, all_rows)

    def start_round(self, round_num: int, global_meta: dict) -> None:
        self.prior = self.priors()
        self._reset_counters()

    def label_loss(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        y = row_classes(batch["label"], batch["mask"])
        lab = y >= 0
        ce = row_ce(logits, y.clamp_min(0), lab)
        if self.opts.form == "code":
            risk = pu_risk_code(logits, y, self.positive, self.prior)
        else:
            risk, terms = pu_risk(
                logits, y, self.positive, self.prior, self.opts.non_negative, self.opts.unlabelled == "all"
            )
            if self.opts.non_negative:
                self._sums.add(clamped=terms < 0)
        self._sums.add(ce=ce, pu=risk, unlabelled=~lab)
        self._steps += 1
        return ce + self.opts.pu_weight * risk

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        out = super().train_round(round_num, num_rounds, global_meta)
        got, s = self._sums.read(), max(self._steps, 1)
        out.meta.update(
            {
                META_PRIOR: self.prior.double().numpy(),
                META_CE: got.get("ce", 0.0) / s,
                META_PU: got.get("pu", 0.0) / s,
                META_UNLABELLED: int(got.get("unlabelled", 0)),
                META_CLAMPED: int(got.get("clamped", 0)),
            }
        )
        return out


def register_all(register) -> None:
    register(
        "fedpu",
        FedPUTrainer,
        ServerRule,
        doc="FedPU (Lin et al., ICML 2022): CE + multi-class PU risk, FedAvg",
        job="fedpu_ham10000",
        comparison=True,
    )
