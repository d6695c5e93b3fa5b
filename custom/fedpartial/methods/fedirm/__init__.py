"""FedIRM (Liu, Yang, Dou, Heng, "Federated Semi-supervised Medical Image Classification via Inter-client Relation
Matching", MICCAI 2021) as a (LocalTrainer, ServerRule) pair (``maths``: the equations; ``trainer``: the site;
``rule``: the server), with the baselines of the paper's Table 1 as switches of the same trainer.

Setting: m labelled sites (every class annotated) and n unlabelled sites (no label at all; their manifests may be
plain image lists, data protocol ``labeled_unlabeled``). A federation without a labelled or without an
unlabelled site is refused before training (the rule's ``check_federation``, naming the sites).

Every round:

- Labelled site l: ``L_ce`` on two augmented views (rotation, translation, flip: the ``weak`` view; the model's
  dropout is the further perturbation). Its disease relation matrix: row c = ``softmax(v_c / tau)``, v_c the
  mean pre-softmax output of its samples of class c (Eq. 2-3, tau = 2), per batch, averaged over the round's
  batches (row c over the batches holding class c); sent to the server in the round's meta.
- Server: FedAvg of the weights by sample count (paper); the global matrix ``M = (1/m) sum_l M^l`` over the
  labelled sites only, sent to every site with the next model; kept in the rule's state.
- Unlabelled site u: a mean teacher kept across rounds (EMA decay ``min(1 - 1/(step+1), 0.99)``, steps counted
  across rounds, saved as site state). ``L_u = lambda(omega) (L_c + L_IRM)``: ``L_c`` = squared distance between the
  student's softmax on one view and the teacher's on another (Eq. 1); ``L_IRM`` = symmetric KL between the
  global matrix and the batch's local matrix (Eq. 6), the local one built from the student's pre-softmax outputs
  of the samples whose MC-dropout predictive entropy (T = 8 passes, Eq. 4) is below h = ln 2, grouped by their
  pseudo label ``y^u = argmax(p^u)`` of the training forward pass (Eq. 5; ``pseudo_label: mc_mean``: argmax of
  the MC mean). ``lambda(omega) = exp(-5 (1 - min(omega, 30)/30)^2)``, omega = the round.

Readings of the paper: Eq. 5 prints the probabilities p^u where "(c.f. Eq. 2)" refers to the pre-softmax mean
feature vectors; the default takes the pre-softmax outputs (as Eq. 2 and the released code: a softmax of
probabilities / 2 could never match the labelled sites' matrix); ``unlabelled_rows: probs`` is the literal
Eq. 5. The printed warm-up ``e^(-5(1 - omega/Omega))`` lacks the square of its reference [28]; the square is used.
Eq. 6 is averaged over the classes that have a selected sample in the batch and a global row (the others carry
no gradient), still divided by C. The MC-dropout passes keep BatchNorm in eval mode (dropout only).

Multi-label tasks (ICH, CXR14): by default the documented generalisation: sigmoid outputs, BCE at labelled
sites, relation row c from the positives of class c with ``sigmoid(v_c / tau)`` per class, compared by the sum
of Bernoulli KLs; an unlabelled entry is a pseudo positive when its MC mean probability is > 0.5 and its binary
entropy < ``ml_entropy_threshold`` (0.5 nats ~ p >= 0.8); consistency on sigmoid outputs. ``label_mode: argmax``
is the released code's ICH treatment: the label row's argmax as a single-label softmax target (rows without a
positive are left out); the model is still scored with per-class sigmoid scores by the evaluation.

Released code (liuquande/FedIRM) behaviours offered as options: ``warm_rounds: 21`` (``train_main.py`` trains the
unlabelled clients when ``com_round * local_ep > 20``: rounds 0-20 are labelled-only; unlabelled sites sit them
out with weight 0), ``site_weighting: uniform`` (FedAvg with equal
site weights), ``label_smoothing: 0.1``, ``mc_passes: 11``, ``entropy_threshold: 2.0`` (never filters with 5
classes), ``min_confidence: 0.3``, ``loss_weight: 15``, ``kl: code`` (the two KLs averaged instead of summed),
``relation_average: code`` (batches without class c contribute a uniform row), ``train.lr: 2e-4`` with
``labelled_lr_after_warm: 3e-4`` (the labelled clients' rate from round 21 on; the unlabelled clients' fixed
2e-4 is ``unlabelled_lr``), ``train.keep_optimizer_state: true`` (each client's Adam state kept across rounds;
the default builds a fresh Adam every round). The code and the paper agree on the pseudo label (argmax of the
training forward pass, the default). Not reproduced: its MC passes with BatchNorm in training mode, its
teacher EMA of parameters only (here buffers too). Details and pointers: :class:`FedIRMOptions`.

Baselines (registered methods, any dataset):

- ``fedavg_labelled``: FedAvg over the labelled sites only (unlabelled sites sit out every round): the lower bound.
  With every site labelled (data protocol ``full``) it is the all-labelled upper bound.
- ``fed_consistency``: the same mean teacher and consistency at unlabelled sites, no relation matching.
- ``fed_selftraining``: unlabelled sites train on the received model's confident pseudo labels
  (``pseudo_threshold``, weighted by the same ramp-up).

Counters in each round's site meta (``results.json``, ``site_stats``): ``fedirm_selected`` (samples passing the
filter), ``fedirm_distance`` (symmetric KL between the global and the local matrix), ``fedirm_irm``,
``fedirm_consistency``, ``fedirm_ramp``, ``fedirm_decay_dominated`` (at the round's first step, the share of the
parameter entries whose weight-decay term outweighs the loss's gradient: under Adam they step towards zero);
labelled sites send ``fedirm_relation``; the server ``fedirm_global_relation``.
"""

from __future__ import annotations

from .maths import *  # noqa: F401,F403 - the equations, importable as fedpartial.methods.fedirm.<name>
from .maths import __all__ as _maths_all
from .rule import FedIRMRule, FedIRMRuleOptions
from .trainer import FedIRMOptions, FedIRMTrainer

__all__ = [*_maths_all, "FedIRMRule", "FedIRMRuleOptions", "FedIRMOptions", "FedIRMTrainer", "register_all"]


def register_all(register) -> None:
    register("fedirm", FedIRMTrainer, FedIRMRule, doc="FedIRM (Liu et al., MICCAI 2021)")
    register(
        "fedavg_labelled",
        FedIRMTrainer,
        FedIRMRule,
        doc="FedAvg over the labelled sites only (FedIRM's lower bound)",
        unlabelled="skip",
        irm=False,
        require_unlabelled=False,
    )
    register(
        "fed_consistency",
        FedIRMTrainer,
        FedIRMRule,
        doc="mean-teacher consistency at unlabelled sites (FedIRM w/o IRM)",
        irm=False,
        require_unlabelled=False,
    )
    register(
        "fed_selftraining",
        FedIRMTrainer,
        FedIRMRule,
        doc="self-training on the received model's pseudo labels",
        unlabelled="self_training",
        irm=False,
        require_unlabelled=False,
    )
