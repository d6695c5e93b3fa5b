"""FedMLP (Sun et al., "FedMLP: Federated Multi-Label Medical Image Classification under Task Heterogeneity",
MICCAI 2024) as a (LocalTrainer, ServerRule) pair:
``maths`` (the equations as pure functions), ``trainer`` (the site), ``rule`` (the server).

Two stages at every site k (active classes AC_k = annotated, negative classes NC_k = missing):

- Stage 1 (rounds ``< warmup_rounds``): weighted-partial-class loss (Eq. 4) on logit-adjusted outputs (Eq. 3)
  over the active classes, on two weak views (Sec. 2.2: L_WPC alone; ``cr_warmup: true``, the released code's
  default under ``parity: code``, adds the consistency term below in stage 1 too).
- Eq. 3's rates: annotated classes the site's share of positives; missing classes (``missing_rates:
  prevalence``) the class prevalence of the data summary (all annotating sites), else ``(positive pseudo labels + 1) /
  (N + 2)`` (``missing_rates: pseudo_labels``: positives / pseudo-labelled entries, a ratio set by T1 / T0 that clamps to 1e-4 when
  only negative pseudo labels exist).
- Loss balance: ``loss_balance: eq4`` (default, Eq. 4: sum over labelled entries / C, consistency a mean over
  its entries: with one labelled class of C, consistency weighs C times more against supervision than in the
  released code) or ``per_term`` (each term the mean over its own entries, as the released code; a short CXR14
  run and an 80-round phantom run favoured neither beyond seed noise: jobs/fedmlp_ich/README.md).
- End of the warm-up and of every later round: local dual prototypes of the active classes (Eq. 5) and the
  learning degree of the missing classes (Eq. 10, left) go to the server in the round's meta.
- Server: FedAvg of the weights (n_k), global prototypes over the sites that annotate each class (Eq. 6),
  global learning degree over the sites where the class is missing (Eq. 10, right); both travel back.
- Stage 2: with the received global model's features, Z = cos(P0, F) - cos(P1, F) (Eq. 7) for every missing
  class; among the samples without a pseudo label for that class, the top ``tau0`` share of the negative candidates
  (Z >= 0, largest Z) get the pseudo label 0 and the top ``tau1`` share of the positive candidates (Z < 0, smallest Z)
  get the pseudo label 1 (Eq. 8-9) with ``tau = d_c^G * T`` (self-adaptive threshold, Sec. 2.3.3). Pseudo labels are permanent
  and accumulate in the trainer state. ``tau * #candidates`` is rounded down every round as in the released
  code (``pseudo_label_rounding: floor``: no pseudo label on a site where it stays below 1, e.g. 88 images at T1 = 1 %; ``carry``
  carries the fractional part to the next round, which on small sites pseudo-labelled many wrong positives and lost
  AUC: jobs/fedmlp_ich/README.md); ``T_rounds`` rescales T0 / T1 from the paper's 450 stage-2 rounds to a
  shorter job. Training: WPC over active + pseudo-labelled entries, MSE to the
  global model on missing entries without a pseudo label.

``parity="code"`` reproduces the released code (szbonaldo/FedMLP) where it departs from the paper: plain
masked BCE (mean over labelled entries, no logit adjustment), fixed selection fractions T0 / T1 (no learning
degree), consistency in stage 1 and not in stage 2, one view in stage 2, features on a weak view, and (server,
if the rule also gets ``parity: code``) n_k-weighted prototype averaging. ``wpc: false`` (Eq. 1, missing as 0)
applies under either parity.

Readings of the paper (see also the docstrings of each function):

- Eq. 3 is the binary form of logit adjustment: ``sigmoid(l)*pi1 / (sigmoid(l)*pi1 + (1-sigmoid(l))*pi0)
  == sigmoid(l + log pi1 - log pi0)``; the temperature generalises it as ``l + tau*(log pi1 - log pi0)``.
- Eq. 4 sums over the labelled entries of a sample and divides by C (all classes), then averages the samples.
- Eq. 8-9: the shares are of the *residual* candidates (samples without a pseudo label for the class); the paper does
  not say how a share of a small pool is rounded (its sites hold ~6,000 images): rounded down, as the released code.
- Eq. 10: ``d_c^k`` is defined for missing classes, so ``d_c^G`` averages (|D_k|-weighted) over the sites where
  c is missing (the printed ``k in S_c`` would be the annotating sites, where d_c^k is undefined; the released
  code averages over the missing sites too); 1 where no site misses c.
"""

from __future__ import annotations

from .maths import *  # noqa: F401,F403 - the equations, importable as fedpartial.methods.fedmlp.<name>
from .maths import __all__ as _maths_all
from .rule import FedMLPRule, FedMLPRuleOptions
from .trainer import FedMLPOptions, FedMLPTrainer

__all__ = [*_maths_all, "FedMLPRule", "FedMLPRuleOptions", "FedMLPOptions", "FedMLPTrainer", "register_all"]


def register_all(register) -> None:
    register("fedmlp", FedMLPTrainer, FedMLPRule, doc="FedMLP (Sun et al., MICCAI 2024)", job="fedmlp_ich")
