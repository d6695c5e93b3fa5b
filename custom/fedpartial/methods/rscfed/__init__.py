"""RSCFed (Liang, Lin, Fu, Zhu, Li, "RSCFed: Random Sampling Consensus Federated Semi-supervised Learning",
CVPR 2022; released code XMed-Lab/RSCFed) as a (LocalTrainer, ServerRule) pair (``maths``: the formulas;
``trainer``: the site; ``rule``: the server), for both task types, in the form FedMLP (MICCAI 2024) compares
with: a site's missing labels are its unlabelled part (FedMLP's released code has this multi-label version).

- Site (:class:`RSCFedTrainer`): supervised loss on the annotated labels + ``consistency_weight`` x mean-teacher
  distillation on the unannotated entries (multi-label) / unlabelled rows (single-label): MSE between the
  student's probabilities on one weak view and the mean teacher's (optionally sharpened) on another; the
  teacher is the EMA of the student, kept across rounds as site state.
- Server (:class:`RSCFedRule`): M random sub-sets of K sites; each averaged by distance-reweighted aggregation
  into a sub-consensus model; the global model is the mean of the M sub-consensus models:

      theta_bar_m = sum_{k in S_m} (n_k / N_m) theta_k,  d_k = ||theta_k - theta_bar_m||_2,
      w_k = (n_k / N_m) exp(-beta d_k / n_k) / sum_{j in S_m} (n_j / N_m) exp(-beta d_j / n_j),
      theta_hat_m = sum_{k in S_m} w_k theta_k,  theta^{t+1} = (1/M) sum_m theta_hat_m.

What changed against the paper's protocol: the paper samples K clients per sub-round, trains each from the
global model and repeats M times (a client drawn twice trains twice, one never drawn does not train). In this
project the server rule gets all of the round's updates at once (``ServerRule.aggregate``), so every site trains
once per round and the server draws the M sub-sets from those updates with a generator seeded by ``seed`` and the
round (as FedMLP's multi-label RSCFed): a site in two sub-sets contributes the same update to both, and the
updates of sites drawn into no sub-set are not used (``rscfed_unsampled``).

Defaults: the released RSCFed code's server (M = 3, K = half the sites, beta = 1e4, d_k from the n_k-weighted
average) and FedMLP's multi-label local loss (weight 1, no sharpening, EMA 0.999); the RSCFed code's local values
are options (``consistency_weight: 0.02``, ``sharpen: 0.5``, ``max_grad_norm: 5``), FedMLP's server values too
(``subsets: 10``, ``subset_size: 6``, ``beta: 0.01``, ``center: uniform``, ``distance: sum``). Not reproduced:
the code's labelled-client up-weighting (``w_mul_times``, ``sup_scale``: this project's sites are all partially
labelled), its warm-start checkpoint, its per-client persistent optimiser state (set
``train.keep_optimizer_state``), its loss ramp-up (disabled in its defaults).

Counters: sites send ``rscfed_supervised``, ``rscfed_consistency``, ``rscfed_unlabelled`` (rows / entries
distilled), ``rscfed_confident`` (share of those where the teacher's probability is >= 0.9, or <= 0.1 for an
entry); the server sends ``rscfed_sites``, ``rscfed_subsets`` (indices into ``rscfed_sites``),
``rscfed_subset_weights``, ``rscfed_distances``, ``rscfed_site_share`` and ``rscfed_unsampled``.
"""

from __future__ import annotations

from .maths import *  # noqa: F401,F403 - the formulas, importable as fedpartial.methods.rscfed.<name>
from .maths import __all__ as _maths_all
from .rule import RSCFedRule, RSCFedRuleOptions
from .trainer import RSCFedOptions, RSCFedTrainer

__all__ = [*_maths_all, "RSCFedRule", "RSCFedRuleOptions", "RSCFedOptions", "RSCFedTrainer", "register_all"]


def register_all(register) -> None:
    register(
        "rscfed",
        RSCFedTrainer,
        RSCFedRule,
        doc="RSCFed (Liang et al., CVPR 2022): sub-consensus models + mean teacher",
        job="rscfed_ich",
        comparison=True,
    )
