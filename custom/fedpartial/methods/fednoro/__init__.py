"""FedNoRo (Wu, Yu, Jiang, Cheng, Yan, "FedNoRo: Towards Noise-Robust Federated Learning by Addressing Class
Imbalance and Label Noise Heterogeneity", IJCAI 2023; released code wnn2000/FedNoRo) as a (LocalTrainer,
ServerRule) pair: ``maths`` (the equations as pure functions), ``trainer`` (the site), ``rule`` (the server).

In this project the "label noise" is the missing labels: an unannotated entry stored as 0 is a positive
mislabelled as negative (FedMLP, Sec. 3: "all positive samples with unlabeled classes are mislabeled as negative";
``missing: negatives``, the default).

- Stage 1 (rounds ``< warmup_rounds``): every site trains the logit-adjusted loss ``L_LA`` (Menon et al.):
  single-label ``CE(z + tau log pi, y)`` with the site's class prior ``pi`` (a class absent from the site gets
  ``log 0 = -inf``: it leaves the softmax); multi-label the binary form ``BCE(sigmoid(z + tau log(pi/(1-pi))), y)``
  with ``pi_c`` the site's positive share among its annotated entries of c (FedMLP's Eq. 3; no adjustment for a
  class the site does not annotate). FedAvg on the server.
- Detection: in round ``warmup_rounds - 1`` each site evaluates the received global model on its training set
  and sends its per-class mean loss (single-label CE per labelled class, multi-label per-class BCE). The server
  fills a missing class with the column minimum, min-max normalises each class over the sites, fits a
  2-component Gaussian mixture (scikit-learn) to the K vectors and marks the component with the larger mean
  noisy. (The paper uses the model after the last warm-up aggregation, one round later: a site cannot see it
  before it trains its first stage-2 round.)
- Stage 2: clean sites train ``L_LA``; noisy sites ``(1 - lambda) L_LA + lambda L_KD`` with ``L_KD`` the KL from
  the received global model's outputs softened by ``T = 0.8`` to the logit-adjusted student (single-label: KL of
  softmaxes; multi-label: Bernoulli KL per entry, i.e. BCE with the teacher's sigmoid as soft target minus a
  constant) and ``lambda(t) = a exp(-5 (1 - (clip(t, b, e) - b) / (e - b))^2)`` (``a = 0.8``, ``b = 10``,
  ``e = 49``). Server: DaAgg, ``w_k = n_k exp(-d_k / max_j d_j) / sum_i n_i exp(-d_i / max_j d_j)``, ``d_k`` the
  smallest model distance from noisy site k to a clean site (0 for clean sites).
- ``all_noisy: true`` (FedMLP's comparison, "only the second stage is trained as all clients are noisy"): stage
  2 from round 0, every site noisy, FedAvg (DaAgg needs a clean site).

Released-code behaviours offered as options: ``gmm_votes: 9`` (majority of 9 GMM random states),
``distance: tensor_sum`` (sum of per-tensor norms), ``parity: code`` (multi-label only: FedMLP's adaptation, plain
BCE on the annotated entries with its logit adjustment commented out, KD = mean squared difference of sigmoid
outputs on the unannotated entries), ``kd_entries: missing`` (KD on the unannotated entries only).
"""

from __future__ import annotations

from .maths import *  # noqa: F401,F403 - the equations, importable as fedpartial.methods.fednoro.<name>
from .maths import __all__ as _maths_all
from .rule import FedNoRoRule, FedNoRoRuleOptions
from .trainer import FedNoRoOptions, FedNoRoTrainer

__all__ = [*_maths_all, "FedNoRoRule", "FedNoRoRuleOptions", "FedNoRoOptions", "FedNoRoTrainer", "register_all"]


def register_all(register) -> None:
    register(
        "fednoro",
        FedNoRoTrainer,
        FedNoRoRule,
        doc="FedNoRo (Wu et al., IJCAI 2023): LA + KD, GMM noisy sites, DaAgg",
        job="fednoro_ich",
        comparison=True,
    )
