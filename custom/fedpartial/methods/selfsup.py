"""A federated self-supervised warm start: every site trains the encoder on its own training images WITHOUT labels
(labelled rows and unlabelled rows alike; never its validation or test rows) and the server averages the encoder.
The encoder it writes (``encoder.pt``, named under ``encoder`` in ``results.json``) starts any job of the bundle
through ``model.pretrained``.

Objective: BYOL (Grill et al., "Bootstrap Your Own Latent", NeurIPS 2020). Two random views ``v1``, ``v2`` of each
image; the online network (the job's encoder, a projector ``g`` and a predictor ``q``) predicts the target
network's projection of the other view::

    p_i = q(g(f(v_i)))        z_i = g'(f'(v_i))   (target: f', g', no gradient)
    L   = l(p_1, z_2) + l(p_2, z_1),     l(p, z) = 2 - 2 cos(p, z)            (BYOL eq. 2, symmetrised)

and after each step the target follows the online network, ``theta' <- m theta' + (1 - m) theta`` (BYOL eq. 1;
``m = target_decay``). Chosen because it needs no negative pairs (SimCLR needs large batches for them; a CPU site or
one GPU trains with 16-64 images per step) and because the federated variants of the literature build on it
(FedU, FedEMA). The projector and predictor (Linear, BatchNorm, ReLU, Linear as BYOL) and the target network are
site state: only the encoder travels, as a whole model whose head is the received one, untouched.

Option ``fedema`` (Zhuang et al., "Divergence-aware Federated Self-Supervised Learning", ICLR 2022): a site that
trained before does not take the received encoder as it is but moves its own towards it by a divergence-aware
moving average, ``W_l <- mu W_l + (1 - mu) W_g`` with ``mu = min(lambda ||W_g - W_l||, 1)`` (the distance over
every floating-point tensor of the encoder and its norm layers); ``lambda = tau / ||W_g - W_l||`` is set at the
site's first such update (FedEMA's autoscaler: ``mu = tau`` there), ``tau = fedema_tau``.

Validation while the stage runs: the classifier is never trained, so a site scores its validation / test sets with
a weighted k-nearest-neighbour vote in the encoder's feature space (:func:`knn_probabilities`: cosine similarity,
weights ``exp(s / T)``, each row's ``k`` neighbours within the same set, itself excluded; the labels used are that
set's own), reported as the usual metrics (macro AUROC etc.).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ..data.views import ViewKind
from ..options import opt
from .base import LocalTrainer, RoundOutput, ServerRule, TrainerOptions
from .common import DeviceSums, ema_update

# ------------------------------------------------------------------------------------------ the mathematics


def byol_loss(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """BYOL's regression loss ``2 - 2 cos(p, z)`` averaged over the batch: ``p``, ``z`` ``(B, K)`` -> scalar.
    ``z`` (the target's projection) is detached here: no gradient reaches the target through the loss."""
    return (2.0 - 2.0 * F.cosine_similarity(p, z.detach(), dim=1)).mean()


def symmetric_byol_loss(p1: torch.Tensor, p2: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """``l(p1, z2) + l(p2, z1)``: each view's prediction regresses the target's projection of the other view."""
    return byol_loss(p1, z2) + byol_loss(p2, z1)


def state_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys) -> float:
    """``||a - b||_2`` over the floating-point tensors named by ``keys`` (one flat vector)."""
    total = 0.0
    for k in keys:
        if torch.is_floating_point(a[k]):
            total += float(((a[k].double() - b[k].double()) ** 2).sum())
    return math.sqrt(total)


def fedema_decay(distance: float, scale: float) -> float:
    """FedEMA's divergence-aware decay ``mu = min(lambda * ||W_g - W_l||, 1)``."""
    return min(float(scale) * float(distance), 1.0)


def fedema_scale(tau: float, distance: float) -> float:
    """FedEMA's autoscaler ``lambda = tau / ||W_g - W_l||`` (so that the first decay is ``tau``); a zero distance
    gives ``lambda = 0`` (the global encoder is taken as it is)."""
    return float(tau) / float(distance) if distance > 0 else 0.0


def moving_average(local: torch.Tensor, received: torch.Tensor, mu: float) -> torch.Tensor:
    """``mu * local + (1 - mu) * received`` for floating-point tensors; integer buffers take the received value."""
    if not torch.is_floating_point(received):
        return received.clone()
    return (mu * local.to(received.dtype) + (1.0 - mu) * received).to(received.dtype)


def mlp(dim_in: int, hidden: int, dim_out: int) -> nn.Sequential:
    """BYOL's projector / predictor: ``Linear(dim_in, hidden) -> BatchNorm1d -> ReLU -> Linear(hidden, dim_out)``."""
    return nn.Sequential(
        nn.Linear(dim_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim_out)
    )


# ------------------------------------------------------------------------------------------ nearest neighbours


def knn_probabilities(
    features: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    task: str,
    k: int = 20,
    temperature: float = 0.07,
    chunk: int = 1024,
) -> torch.Tensor:
    """Leave-one-out weighted kNN scores of every row from the other rows of the same set.

    Args:
        features: ``(N, D)``; labels, mask: ``(N, C)`` (mask: the annotated entries).
        k: neighbours per row (at most ``N - 1``); temperature: the weights are ``exp(cos / temperature)``.

    Returns:
        ``(N, C)``: per class ``sum_j w_j y_jc m_jc / sum_j w_j m_jc`` over the row's neighbours ``j`` (0.5 where no
        neighbour is annotated for the class); single-label rows are then normalised to sum 1.
    """
    n = features.shape[0]
    c = labels.shape[1]
    out = torch.full((n, c), 0.5 if task == "multilabel" else 1.0 / max(c, 1), dtype=torch.float64)
    if n < 2:
        return out.float()
    z = F.normalize(features.double(), dim=1)
    y = labels.double() * mask.double()
    m = mask.double()
    kk = min(int(k), n - 1)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        sim = z[lo:hi] @ z.T
        sim[torch.arange(hi - lo), torch.arange(lo, hi)] = -math.inf  # itself is no neighbour
        s, j = sim.topk(kk, dim=1)
        w = torch.exp((s - s[:, :1]) / float(temperature))  # shifted by the row's maximum: same ratios, no overflow
        num = torch.einsum("rk,rkc->rc", w, y[j])
        den = torch.einsum("rk,rkc->rc", w, m[j])
        block = out[lo:hi]
        has = den > 0
        block[has] = num[has] / den[has]
    if task == "multiclass":
        out = out / out.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return out.float()


# ------------------------------------------------------------------------------------------ the site


@dataclass
class SelfSupervisedOptions(TrainerOptions):
    view: ViewKind = opt("ssl", "the augmentation both views are drawn with")
    projection_dim: int = opt(128, "output size of the projector and the predictor")
    hidden_dim: int = opt(512, "hidden size of the projector and the predictor")
    target_decay: float = opt(0.99, "BYOL's m: the target network's moving-average decay per step")
    fedema: bool = opt(False, "FedEMA: move the site's own encoder towards the received one (divergence-aware)")
    fedema_tau: float = opt(0.7, "FedEMA's autoscaler: the decay mu of the site's first moving-average update")
    sites: Literal["all", "labelled"] = opt(
        "all", "which sites train: every site, or only those that annotate a class (the others sit out; an ablation)"
    )
    knn_k: int = opt(20, "validation: neighbours of the kNN vote")
    knn_temperature: float = opt(0.07, "validation: temperature of the kNN weights")


class SelfSupervisedTrainer(LocalTrainer):
    """BYOL at a site (module docstring); every training row is used, labelled or not."""

    Options = SelfSupervisedOptions
    accepts_unlabelled = True

    def __init__(self, ctx, **options):
        super().__init__(ctx, **options)
        if not 0.0 <= self.opts.target_decay < 1.0:
            raise ValueError(f"target_decay must be in [0, 1), got {self.opts.target_decay}")
        if not 0.0 <= self.opts.fedema_tau <= 1.0:
            raise ValueError(f"fedema_tau must be in [0, 1], got {self.opts.fedema_tau}")
        dim = ctx.model.feature_dim
        gen = torch.Generator().manual_seed(int(ctx.seed) * 7919 + 17)  # the same heads whichever process builds them
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
            self.projector = mlp(dim, self.opts.hidden_dim, self.opts.projection_dim).to(ctx.device)
            self.predictor = mlp(self.opts.projection_dim, self.opts.hidden_dim, self.opts.projection_dim).to(
                ctx.device
            )
        groups = ctx.model.parameter_groups()
        self.encoder_keys = [k for g in ("encoder", "norm") for k in groups[g]]
        self.target_encoder: nn.Module | None = None  # f' and g' (site state, built on first use)
        self.target_projector: nn.Module | None = None
        self._saved_target: dict | None = None
        self.local_encoder: dict[str, torch.Tensor] | None = None  # the site's W_l after its last round (FedEMA)
        self.fedema_lambda: float | None = None
        self.last_decay: float | None = None

    # -- receiving: FedEMA's divergence-aware moving average ----------------------------------------------------
    def receive(self, weights) -> None:
        super().receive(weights)
        self.last_decay = None
        if not self.opts.fedema or self.local_encoder is None:
            return
        model = self.ctx.model
        received = model.state_dict()
        local = {k: self.local_encoder[k].to(received[k].device) for k in self.encoder_keys}
        dist = state_distance(received, local, self.encoder_keys)
        if self.fedema_lambda is None:
            self.fedema_lambda = fedema_scale(self.opts.fedema_tau, dist)
        mu = fedema_decay(dist, self.fedema_lambda)
        mixed = dict(received)
        for k in self.encoder_keys:
            mixed[k] = moving_average(local[k], received[k], mu)
        model.load_state_dict(mixed)
        self.last_decay = mu

    # -- one round ---------------------------------------------------------------------------------------------------
    def _targets(self) -> tuple[nn.Module, nn.Module]:
        if self.target_encoder is None:
            enc = copy.deepcopy(self.ctx.model.encoder)
            proj = copy.deepcopy(self.projector)
            if self._saved_target is not None:
                enc.load_state_dict(self._saved_target["encoder"])
                proj.load_state_dict(self._saved_target["projector"])
                self._saved_target = None
            for m in (enc, proj):
                for p in m.parameters():
                    p.requires_grad_(False)
            self.target_encoder, self.target_projector = enc, proj
        return self.target_encoder, self.target_projector

    def train_round(self, round_num: int, num_rounds: int, global_meta: dict) -> RoundOutput:
        if self.opts.sites == "labelled" and not self.ctx.labelled:
            return RoundOutput(steps=0, loss=0.0, weight=0.0)  # sits the round out (its images unused)
        model = self.train_mode()
        t_enc, t_proj = self._targets()
        self.projector.train()
        self.predictor.train()
        t_enc.train()  # BatchNorm in the target normalises with the batch's statistics, as the online network
        t_proj.train()
        params = [p for p in model.encoder.parameters() if p.requires_grad]
        params += list(self.projector.parameters()) + list(self.predictor.parameters())
        self.make_optimizer(params)
        sums, steps = DeviceSums(), 0
        for batch in self.batches({"v1": self.opts.view, "v2": self.opts.view}, round_num):
            x = torch.cat([batch["v1"], batch["v2"]])  # both views in one pass (BatchNorm sees both)
            p1, p2 = self.predictor(self.projector(model.features(x))).chunk(2)
            with torch.no_grad():
                z1, z2 = t_proj(t_enc(x).float()).chunk(2)
            loss = symmetric_byol_loss(p1, p2, z1, z2)
            self.step(loss)
            ema_update(t_enc, model.encoder, self.opts.target_decay)
            ema_update(t_proj, self.projector, self.opts.target_decay)
            sums.add(loss=loss)
            steps += 1
        self.local_encoder = {
            k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in self.encoder_keys
        }
        meta = {} if self.last_decay is None else {"fedema_decay": float(self.last_decay)}
        return RoundOutput(steps=steps, loss=sums.read().get("loss", 0.0) / max(steps, 1), meta=meta)

    # -- validation: kNN in the feature space -------------------------------------------------------------------------
    def score_probabilities(self, features: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return knn_probabilities(features, labels, mask, self.ctx.task, self.opts.knn_k, self.opts.knn_temperature)

    # -- persistence ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["byol_projector"] = {k: v.detach().cpu().clone() for k, v in self.projector.state_dict().items()}
        state["byol_predictor"] = {k: v.detach().cpu().clone() for k, v in self.predictor.state_dict().items()}
        if self.target_encoder is not None:
            state["byol_target"] = {
                "encoder": {k: v.detach().cpu().clone() for k, v in self.target_encoder.state_dict().items()},
                "projector": {k: v.detach().cpu().clone() for k, v in self.target_projector.state_dict().items()},
            }
        elif self._saved_target is not None:
            state["byol_target"] = self._saved_target
        if self.local_encoder is not None:
            state["byol_local_encoder"] = self.local_encoder
        if self.fedema_lambda is not None:
            state["fedema_lambda"] = float(self.fedema_lambda)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "byol_projector" in state:
            self.projector.load_state_dict(state["byol_projector"])
            self.predictor.load_state_dict(state["byol_predictor"])
        if "byol_target" in state:
            self.target_encoder = self.target_projector = None
            self._saved_target = state["byol_target"]
        self.local_encoder = state.get("byol_local_encoder")
        self.fedema_lambda = state.get("fedema_lambda")


class EncoderRule(ServerRule):
    """FedAvg of the encoder (the head the sites send back is the one they received); at the end the server writes
    the encoder of the global model that was best on validation (the kNN vote; the last one where no site scores a
    validation set) to ``encoder.pt`` (:attr:`writes_encoder`)."""

    writes_encoder = True
    scores_note = (
        "the classifier of a self-supervised stage is never trained: val / test scores are a kNN vote in the "
        "encoder's feature space (each row from its nearest neighbours in the same set, with their labels)"
    )


def register_all(register) -> None:
    register(
        "byol",
        SelfSupervisedTrainer,
        EncoderRule,
        doc="federated BYOL: self-supervised encoder warm start (labels unused; option fedema)",
        job="selfsup_ich",
    )
