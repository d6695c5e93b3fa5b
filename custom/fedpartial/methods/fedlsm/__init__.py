"""FedLSM (Deng, Luo, Chen, "Scale Federated Learning for Label Set Mismatch in Medical Image Classification",
MICCAI 2023) as a (LocalTrainer, ServerRule) pair
(``maths``: the equations; ``trainer``: the site; ``rule``: the server), for single-label (``multiclass``) and multi-label tasks.

Every round at site k (I_k = annotated classes, U_k = the others):

- Uncertainty estimation (UE, Sec. 2.3): the received global model scores every local image (eval view):
  softmax entropy (Eq. 3) for single-label; for multi-label the entropy over U_k only, normalised to [0, 1]
  (mean binary entropy / ln 2). The ``n_uncertain`` highest form the uncertain pool D^h, the ``n_confident``
  lowest the confident pool D^l, the rest D^m (sizes as counts or fractions, :func:`pool_sizes`).
- Pseudo labelling on D^l + D^m with an EMA teacher initialised from the global model every round and updated
  after every step (weak view to the teacher, strong view to the student; the weak view is a horizontal flip,
  "weak augmentation refered to horizontal flip", view kind ``"flip"``; ``weak_view: weak`` = FedMLP's flip +
  rotation + translation). Single-label (Eq. 4): an unlabelled row gets
  ``argmax`` of the teacher's softmax when its probability is ``>= tau`` and (paper) the class is in U_k;
  ``L_U = -(1/N_U) sum pseudo rows log p_student(y^)``, N_U = unlabelled rows of the batch; ``L_I`` = CE on the
  labelled rows. Multi-label (Eq. 5): an unannotated entry is a positive pseudo label when ``q >= tau_p``,
  a negative one when ``q <= tau_n``; ``L_I + L_U = (1/B) sum_i sum_{c labelled or pseudo} w-BCE_ic`` with
  FPSL's class weights: the global negative / positive ratio of each class from the server's data summary
  (every site's labels), applied as the positive-term weight (``class_weighting``).
- Uncertain data enhancing (UDE, Eq. 6): ``n_mix`` confident and ``n_mix`` uncertain samples per step are mixed
  with ``lambda ~ Beta(alpha, alpha)``: ``x~ = lambda x_l + (1 - lambda) x_h``, same for the (pseudo) labels;
  uncertain samples get pseudo labels with the lower thresholds (``tau_l`` / ``tau_lp``, ``tau_ln``). A pair
  (single-label) or an entry (multi-label) counts only where both sides have a label (the released code's
  joint-confidence mask); L_UDE is plain (binary) cross-entropy ("The UDE loss function is cross-entropy loss",
  and the released code), ``ude_weighting: class`` adds the class weights. Loss weight ``lam_ude``.
  ``L = L_I + L_U + lam_ude * L_UDE``.
- The site sends ``q_c^k`` (Sec. 2.4): labelled positives of c plus pseudo-label positives of c.
- Server (AWPA, Eq. 7): feature extractor by n_k; classifier row and bias of class c by ``q_c^k / sum_j q_c^j``;
  when no site reports class c, the row falls back to n_k weights (the released code divides by zero).

Ablations (method options): ``ue: false`` (pools drawn at random, same sizes), ``ude: false`` (no mixed samples),
``awpa: adaptive | masked | fedavg`` (masked: rows over the annotating sites only = the paper's "Ours*").

Released code (dzp2095/FedLSM) behaviours offered as options: ``restrict_unknown: false`` (single-label pseudo
labels of any class, not only U_k), ``entropy: plogp`` (multi-label uncertainty as sum of -p ln p over U_k),
``class_weighting: entry`` (the whole BCE entry weighted by the ratio, and the ratio counting every 0 as a
negative, missing entries included, as the code that stores missing labels as 0: ``(sum_k n_k - pos_c) / pos_c``), ``q_counts: seen`` (q counted over the
batches trained this round instead of over the whole local set), ``tau_n: 0.01`` (the code's negative
threshold; the paper's Table 4 says 5e-3, the default here). Not reproduced: the code's samplers, rebuilt with
the same seed every round (a site replays the same images each round), and its ISIC MixUp bug (the mixed
samples never receive pseudo labels); here every round draws a fresh permutation and the mixed samples get
their pseudo labels.
"""

from __future__ import annotations

from .maths import *  # noqa: F401,F403 - the equations, importable as fedpartial.methods.fedlsm.<name>
from .maths import __all__ as _maths_all
from .rule import FedLSMRule, FedLSMRuleOptions
from .trainer import FedLSMOptions, FedLSMTrainer

__all__ = [*_maths_all, "FedLSMRule", "FedLSMRuleOptions", "FedLSMOptions", "FedLSMTrainer", "register_all"]


def register_all(register) -> None:
    register("fedlsm", FedLSMTrainer, FedLSMRule, doc="FedLSM (Deng, Luo, Chen, MICCAI 2023)")
