"""Mutation run of the four papers' methods and the comparison methods: does a test fail when a behaviour is removed?

    python benchmarks/mutation.py --out benchmarks/results/mutation

For every mutation below, a temporary copy of ``custom/`` gets one source patch (an exact text replacement that
must match once, so a mutation that no longer applies is an error, not a silent pass), and the method's targeted
test files (e.g. ``tests/test_objective_terms.py`` and ``tests/test_fedmlp.py``, without the simulator tests) run
against the copy (``PYTHONPATH`` puts it before the installed package; the run checks that the copy is the one
imported). The shared checkout is never modified. A mutation is caught when at least one test fails; the table
names the first failing test (pytest ``-x``, in the order given: the hand-computed tests come first;
``--all-tests`` runs every listed test and names every failing one). The unmutated copy runs first and must pass
every test. Left out of every run: the simulator tests and ``DESELECT`` (a model-architecture test that no
mutation touches and that costs a DenseNet-121 build). Writes ``<out>.md`` and ``<out>.json``; ``--only NAME``
runs some mutations, ``--method NAME`` those of one method.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FEDIRM = "custom/fedpartial/methods/fedirm"
SURGICAL = "custom/fedpartial/methods/surgical"
FEDMLP = "custom/fedpartial/methods/fedmlp"
FEDLSM = "custom/fedpartial/methods/fedlsm"
METHODS = "custom/fedpartial/methods"


@dataclass
class Mutation:
    name: str
    what: str  # the behaviour removed, in words
    path: str  # file, relative to the checkout root
    patches: list[tuple[str, str]]  # (old, new): each old must occur exactly once
    tests: str | tuple[str, ...]  # the test files (or test ids) run, in this order
    origin: str = "issue"  # issue: listed as uncaught; caught: listed as caught before; option: a new option
    extra: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)  # patches of further files
    method: str = ""  # the table's group (default: from the path)

    @property
    def test_args(self) -> tuple[str, ...]:
        return (self.tests,) if isinstance(self.tests, str) else tuple(self.tests)

    @property
    def group(self) -> str:
        if self.method:
            return self.method
        for key, name in (
            ("fedirm", "FedIRM"),
            ("surgical", "surgical aggregation"),
            ("fedmlp", "FedMLP"),
            ("fedlsm", "FedLSM"),
        ):
            if f"/{key}/" in self.path:
                return name
        return "comparison methods"


T_FEDIRM, T_SURGICAL = "tests/test_fedirm.py", "tests/test_surgical.py"
T_OBJ = "tests/test_objective_terms.py"  # one local step / one aggregation of each method, computed by hand
_O, _FW = T_OBJ + "::test_", "tests/test_framework.py::test_"
T_MLP = (
    _O + "fedmlp_step_is_wpc_on_annotated_and_pseudo_labels_plus_weighted_consistency_by_hand",
    _O + "fedmlp_sends_prototypes_of_its_annotated_classes_and_degrees_of_the_trained_model_by_hand",
    _O + "fedmlp_rule_prototypes_over_annotating_sites_and_degrees_over_missing_sites_by_size_by_hand",
    "tests/test_fedmlp.py",
)
T_LSM = (
    _O + "fedlsm_steps_are_pseudo_pool_loss_plus_weighted_ude_with_an_ema_teacher_by_hand",
    _O + "fedlsm_awpa_rows_by_estimated_class_counts_not_fedavg_by_hand",
    "tests/test_fedlsm.py",
)
T_CMP_SUP = (
    _O + "fedprox_step_adds_half_mu_times_the_squared_distance_to_the_received_weights_by_hand",
    _O + "moon_step_adds_mu_times_the_contrastive_term_toward_the_global_and_away_from_the_previous_model",
    _O + "fedrs_step_scales_the_logits_of_classes_the_site_does_not_hold_by_hand",
    _FW + "fedprox_term_and_gradient_by_hand",
    _FW + "fedrs_restricted_softmax_by_hand",
    _FW + "moon_contrastive_term_by_hand_and_previous_model_kept_as_site_state",
)
T_FPSL = (
    _O + "fpsl_step_weights_the_positives_by_negatives_over_positives_by_hand",
    _O + "fixmatch_step_adds_lambda_u_times_the_strong_view_loss_on_confident_weak_view_pseudo_labels",
    "tests/test_fpsl_fixmatch.py",
)
T_FEDNORO = (_O + "fednoro_noisy_site_step_blends_la_and_distillation_by_lambda_by_hand", "tests/test_fednoro.py")
T_FEDLSR = (_O + "fedlsr_step_is_ce_plus_ramped_self_distillation_plus_entropy_on_two_views", "tests/test_fedlsr.py")
T_RSCFED = (
    _O + "rscfed_step_adds_weighted_distillation_to_the_sharpened_mean_teacher_on_the_other_view_by_hand",
    "tests/test_rscfed.py",
)
T_CBAFED = (
    _O + "cbafed_step_trains_on_the_labels_and_the_fixed_pseudo_labels_of_the_received_model_by_hand",
    "tests/test_cbafed.py",
)
T_FEDPU = (_O + "fedpu_step_is_ce_plus_pu_weight_times_the_pu_risk_by_hand", "tests/test_fedpu.py")
T_FEDLC = (
    _O + "fedlc_step_subtracts_tau_times_count_to_the_minus_quarter_from_each_logit_by_hand",
    "tests/test_fedlc.py",
)
T_FEDAVGM = (_O + "fedavgm_server_momentum_over_two_rounds_by_hand", "tests/test_fedavgm.py")
T_MASKED = (_O + "fedavg_masked_rows_over_the_annotating_sites_by_hand", "tests/test_aggregation.py")
DESELECT = [
    "tests/test_surgical.py::test_paper_head_for_every_backbone_and_only_the_last_dense_is_the_task_block[densenet121]"
]

MUTATIONS = [
    # ---------------------------------------------------------------- FedIRM, listed as not caught
    Mutation(
        "irm_sign",
        "IRM term's sign flipped",
        f"{FEDIRM}/trainer.py",
        [("loss = loss + i_loss", "loss = loss - i_loss")],
        T_FEDIRM,
    ),
    Mutation(
        "consistency_sign",
        "consistency term's sign flipped",
        f"{FEDIRM}/trainer.py",
        [("loss = loss + c_loss", "loss = loss - c_loss")],
        T_FEDIRM,
    ),
    Mutation(
        "ramp_not_applied",
        "ramp-up weight never applied",
        f"{FEDIRM}/trainer.py",
        [("            loss = w * loss\n", "            loss = loss\n")],
        T_FEDIRM,
    ),
    Mutation(
        "teacher_is_student",
        "teacher replaced by the student",
        f"{FEDIRM}/trainer.py",
        [('t_out = teacher_forward(teacher, b["image_2"])', 't_out = teacher_forward(model, b["image_2"])')],
        T_FEDIRM,
    ),
    Mutation(
        "views_swapped",
        "teacher and student views swapped",
        f"{FEDIRM}/trainer.py",
        [
            ('out = model(b["image"])', 'out = model(b["image_2"])'),
            ('t_out = teacher_forward(teacher, b["image_2"])', 't_out = teacher_forward(teacher, b["image"])'),
            ('self.unlabelled_relation(b["image"], out)', 'self.unlabelled_relation(b["image_2"], out)'),
        ],
        T_FEDIRM,
    ),
    Mutation(
        "irm_row_mask_ignored",
        "IRM row mask ignored",
        f"{FEDIRM}/trainer.py",
        [
            (
                "i_loss = symmetric_kl(received[0], m, rows, self.kind, self.opts.kl)",
                "i_loss = symmetric_kl(received[0], m, None, self.kind, self.opts.kl)",
            )
        ],
        T_FEDIRM,
    ),
    Mutation(
        "filter_on_teacher",
        "uncertainty filter run on the teacher",
        f"{FEDIRM}/trainer.py",
        [("passes = mc_dropout_probs(self.ctx.model, x,", "passes = mc_dropout_probs(self.teacher, x,")],
        T_FEDIRM,
    ),
    Mutation(
        "labelled_ce_one_view",
        "labelled CE on one view only",
        f"{FEDIRM}/trainer.py",
        [
            (
                "+ supervised_loss(\n                o2,",
                "+ 0.0 * supervised_loss(\n                o2,",
            )
        ],
        T_FEDIRM,
    ),
    Mutation(
        "labelled_matrix_from_probs",
        "labelled relation matrix from probabilities",
        f"{FEDIRM}/trainer.py",
        [
            (
                "m, n = relation_matrix(o1.detach().float(), t.float(),",
                "m, n = relation_matrix(torch.softmax(o1.detach().float(), 1), t.float(),",
            )
        ],
        T_FEDIRM,
    ),
    Mutation(
        "labelled_loss_ramped",
        "labelled loss scaled by the ramp",
        f"{FEDIRM}/trainer.py",
        [
            (
                "            self.step(loss)\n            with torch.no_grad():\n                m, n = relation_matrix(",
                "            self.step(self.loss_weight(round_num) * loss)\n            with torch.no_grad():\n"
                "                m, n = relation_matrix(",
            )
        ],
        T_FEDIRM,
    ),
    # ---------------------------------------------------------------- FedIRM, listed as caught
    Mutation(
        "matrix_detached",
        "unlabelled relation matrix detached (no IRM gradient)",
        f"{FEDIRM}/trainer.py",
        [
            (
                'rows = outputs if self.opts.unlabelled_rows == "logits"',
                'rows = outputs.detach() if self.opts.unlabelled_rows == "logits"',
            )
        ],
        T_FEDIRM,
        "caught",
    ),
    Mutation(
        "softmax_axis",
        "relation rows: softmax over the wrong axis",
        f"{FEDIRM}/maths.py",
        [("m = torch.softmax(v / tau, dim=1) if kind", "m = torch.softmax(v / tau, dim=0) if kind")],
        T_FEDIRM,
        "caught",
    ),
    Mutation(
        "consistency_on_logits",
        "consistency on logits instead of probabilities",
        f"{FEDIRM}/maths.py",
        [
            (
                "diff = act(student_logits) - act(teacher_logits.detach())",
                "diff = student_logits - teacher_logits.detach()",
            )
        ],
        T_FEDIRM,
        "caught",
    ),
    Mutation(
        "pseudo_label",
        "pseudo label: arg-min instead of arg-max",
        f"{FEDIRM}/maths.py",
        [("targets = F.one_hot(source.argmax(1),", "targets = F.one_hot(source.argmin(1),")],
        T_FEDIRM,
        "caught",
    ),
    Mutation(
        "ema_removed",
        "mean teacher never updated (EMA removed)",
        f"{FEDIRM}/trainer.py",
        [("            self.mean_teacher.update(model, self.opts.ema_max_decay)\n", "            pass\n")],
        T_FEDIRM,
        "caught",
    ),
    Mutation(
        "unlabelled_matrices_averaged",
        "server averages the unlabelled sites' matrices too",
        f"{FEDIRM}/rule.py",
        [
            (
                "with_m = [c for c in contributions if c.annotated.any() and META_RELATION in c.meta]",
                "with_m = [c for c in contributions if META_RELATION in c.meta]",
            )
        ],
        T_FEDIRM,
        "caught",
    ),
    # ---------------------------------------------------------------- FedIRM, options (ignored)
    Mutation(
        "pseudo_label_option_ignored",
        "option pseudo_label ignored (always the forward pass)",
        f"{FEDIRM}/trainer.py",
        [('source = conf if self.opts.pseudo_label == "forward" else None', "source = conf")],
        T_FEDIRM,
        "option",
    ),
    Mutation(
        "pseudo_label_from_mc_mean",
        "default pseudo label from the MC mean (the previous reading)",
        f"{FEDIRM}/trainer.py",
        [('source = conf if self.opts.pseudo_label == "forward" else None', "source = None")],
        T_FEDIRM,
        "option",
    ),
    Mutation(
        "role_lr_ignored",
        "per-role learning rates ignored (train.lr everywhere)",
        f"{FEDIRM}/trainer.py",
        [('            group["lr"] = self.learning_rate(round_num)\n', "            pass\n")],
        T_FEDIRM,
        "option",
    ),
    Mutation(
        "lr_switch_at_warm_ignored",
        "labelled_lr_after_warm applied from round 0",
        f"{FEDIRM}/trainer.py",
        [
            (
                "if round_num >= self.opts.warm_rounds and self.opts.labelled_lr_after_warm is not None:",
                "if self.opts.labelled_lr_after_warm is not None:",
            )
        ],
        T_FEDIRM,
        "option",
    ),
    Mutation(
        "optimizer_state_ignored",
        "train.keep_optimizer_state ignored (always a fresh optimiser)",
        "custom/fedpartial/methods/base.py",
        [
            (
                "        if self.keeps_optimizer_state:\n            # the previous round's optimiser",
                "        if False:\n            # the previous round's optimiser",
            )
        ],
        T_FEDIRM,
        "option",
        method="FedIRM",
    ),
    Mutation(
        "warm_rounds_off_by_one",
        "warm rounds end one round late (round == warm_rounds sits out)",
        f"{FEDIRM}/trainer.py",
        [
            (
                'if self.opts.unlabelled == "skip" or round_num < self.opts.warm_rounds:',
                'if self.opts.unlabelled == "skip" or round_num <= self.opts.warm_rounds:',
            )
        ],
        T_FEDIRM,
        "option",
    ),
    # ---------------------------------------------------------------- surgical aggregation
    Mutation(
        "warmup_best_epoch_removed",
        "warm-up best-epoch selection removed (last epoch's weights kept)",
        f"{SURGICAL}/trainer.py",
        [("                model.load_state_dict({**model.state_dict(), **best_state})\n", "                pass\n")],
        T_SURGICAL,
    ),
    Mutation(
        "surgical_rows_over_all_sites",
        "task block rows averaged over all sites",
        f"{SURGICAL}/rule.py",
        [('if self.opts.task_block == "masked":', "if False:")],
        T_SURGICAL,
        "caught",
    ),
    Mutation(
        "pfl_head_shared",
        "PFL: the task block shared (not kept local)",
        f"{SURGICAL}/__init__.py",
        [('**PAPER,\n        keep_local=["classifier"],', "**PAPER,")],
        T_SURGICAL,
        "caught",
    ),
    Mutation(
        "norm_frozen_ignored",
        "norm: frozen ignored (BatchNorm trains; the individual baseline's code option)",
        "custom/fedpartial/methods/base.py",
        [
            (
                '        if self.opts.norm == "frozen":\n            for m in model.modules():',
                "        if False:\n            for m in model.modules():",
            )
        ],
        T_SURGICAL,
        "option",
        method="surgical aggregation",
    ),
    Mutation(
        "min_delta_ignored",
        "early stopping min_delta ignored",
        "custom/fedpartial/fl/selection.py",
        [
            (
                "if self.patience_metric is None or self.best_val_metric > self.patience_metric + self.min_delta:",
                "if True:",
            )
        ],
        T_SURGICAL,
        "option",
        method="surgical aggregation",
    ),
    # ---------------------------------------------------------------- FedMLP: the local objective (trainer)
    Mutation(
        "mlp_wpc_dropped",
        "supervised (WPC) term multiplied by 0",
        f"{FEDMLP}/trainer.py",
        [
            (
                "loss = self.supervised_loss(logits, y, lab, pi1, pi0)",
                "loss = 0.0 * self.supervised_loss(logits, y, lab, pi1, pi0)",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_cr_dropped",
        "consistency term multiplied by 0",
        f"{FEDMLP}/trainer.py",
        [("loss = loss + self.opts.cr_weight * consistency_loss(", "loss = loss + 0.0 * consistency_loss(")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_cr_sign",
        "consistency term's sign flipped",
        f"{FEDMLP}/trainer.py",
        [
            (
                "loss = loss + self.opts.cr_weight * consistency_loss(",
                "loss = loss - self.opts.cr_weight * consistency_loss(",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_cr_weight_ignored",
        "cr_weight ignored (weight 1)",
        f"{FEDMLP}/trainer.py",
        [("loss = loss + self.opts.cr_weight * consistency_loss(", "loss = loss + consistency_loss(")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_cr_target_is_student",
        "consistency target: the training model, not the received one",
        f"{FEDMLP}/trainer.py",
        [("targets = torch.sigmoid(received_model(torch.cat(", "targets = torch.sigmoid(model(torch.cat(")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_cr_views_swapped",
        "consistency target of the other view",
        f"{FEDMLP}/trainer.py",
        [
            (
                "consistency_loss(torch.sigmoid(logits), targets[i], cr_mask)",
                "consistency_loss(torch.sigmoid(logits), targets[len(views) - 1 - i], cr_mask)",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_cr_on_pseudo_labelled",
        "consistency also on pseudo-labelled entries",
        f"{FEDMLP}/trainer.py",
        [("            cr_mask = ~lab\n", "            cr_mask = ~m\n")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_pseudo_labels_unused",
        "pseudo labels left out of the supervised term",
        f"{FEDMLP}/trainer.py",
        [
            (
                "            lab = m | tg\n            cr_mask = ~lab\n",
                "            lab = m\n            cr_mask = ~(m | tg)\n",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_pseudo_positives_as_0",
        "pseudo labels written as 0 (pseudo positives lost)",
        f"{FEDMLP}/trainer.py",
        [
            (
                'torch.where(tg, t.float(), torch.zeros_like(batch["label"].float()))',
                'torch.where(tg, 0.0 * t.float(), torch.zeros_like(batch["label"].float()))',
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_one_view",
        "second view dropped (loss of view 1 only)",
        f"{FEDMLP}/trainer.py",
        [("loss = torch.stack(losses).mean()", "loss = losses[0]")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_views_summed",
        "views summed, not averaged",
        f"{FEDMLP}/trainer.py",
        [("loss = torch.stack(losses).mean()", "loss = torch.stack(losses).sum()")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_rates_swapped",
        "Eq. 3 rates pi1 / pi0 swapped",
        f"{FEDMLP}/trainer.py",
        [
            (
                "return wpc_loss(logits, labels, label_mask, pi1, pi0, self.opts.la_tau, reduction)",
                "return wpc_loss(logits, labels, label_mask, pi0, pi1, self.opts.la_tau, reduction)",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_la_tau_ignored",
        "logit-adjustment temperature ignored (1)",
        f"{FEDMLP}/trainer.py",
        [
            (
                "return wpc_loss(logits, labels, label_mask, pi1, pi0, self.opts.la_tau, reduction)",
                "return wpc_loss(logits, labels, label_mask, pi1, pi0, 1.0, reduction)",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_eq4_as_entries",
        "Eq. 4's 1/C balance replaced by the mean over entries",
        f"{FEDMLP}/trainer.py",
        [('reduction = "classes" if self.opts.loss_balance == "eq4" else "entries"', 'reduction = "entries"')],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_missing_rates_from_site",
        "missing classes' rates from the site's own labels, not prevalence",
        f"{FEDMLP}/trainer.py",
        [("pi1 = torch.where(missing, prev1.to(pi1), pi1)", "pi1 = pi1")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_cr_in_stage1",
        "consistency in stage 1 under parity paper",
        f"{FEDMLP}/trainer.py",
        [
            (
                'return self.opts.parity == "code" if self.opts.cr_warmup is None else bool(self.opts.cr_warmup)',
                "return True",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_tags_annotated_classes",
        "pseudo labels also for the site's annotated classes",
        f"{FEDMLP}/trainer.py",
        [("usable = ~self.annotated & valid.all(dim=1)", "usable = valid.all(dim=1)")],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_degree_ignored",
        "learning degree ignored in the selection shares (tau = T)",
        f"{FEDMLP}/trainer.py",
        [
            (
                "tau0, tau1 = selection_ratios(degree, T0, T1, adaptive=self.adaptive)",
                "tau0, tau1 = selection_ratios(torch.ones_like(degree), T0, T1, adaptive=self.adaptive)",
            )
        ],
        T_MLP,
        "term",
    ),
    Mutation(
        "mlp_prototypes_sent_of_all_classes",
        "local prototypes of missing classes too (their 0 labels)",
        f"{FEDMLP}/trainer.py",
        [
            (
                "p0, p1, counts = class_prototypes(feats, labels, active_mask)",
                "p0, p1, counts = class_prototypes(feats, labels, torch.ones_like(active_mask))",
            )
        ],
        T_MLP,
        "term",
    ),
    # ---------------------------------------------------------------- FedMLP: the server rule
    Mutation(
        "mlp_rule_prototypes_fedavg",
        "prototypes averaged over every site with n_k (plain FedAvg)",
        f"{FEDMLP}/rule.py",
        [
            (
                'p0, p1, counts, annotated, sizes if self.proto_weighting == "samples" else None\n',
                "p0, p1, counts, torch.ones_like(annotated), sizes\n",
            )
        ],
        T_MLP,
        "rule",
    ),
    Mutation(
        "mlp_rule_prototypes_over_all_sites",
        "prototypes averaged over every site (not S_c)",
        f"{FEDMLP}/rule.py",
        [
            (
                "p0, p1, counts, annotated, sizes",
                "p0, p1, counts, torch.ones_like(annotated), sizes",
            )
        ],
        T_MLP,
        "rule",
    ),
    Mutation(
        "mlp_rule_prototypes_by_samples",
        "prototypes weighted by n_k under parity paper (uniform 1/|S_c|)",
        f"{FEDMLP}/rule.py",
        [('sizes if self.proto_weighting == "samples" else None\n', "sizes\n")],
        T_MLP,
        "rule",
    ),
    Mutation(
        "mlp_rule_degree_over_all_sites",
        "learning degree averaged over every site (not the missing ones)",
        f"{FEDMLP}/rule.py",
        [("        missing = ~annotated\n", "        missing = torch.ones_like(annotated)\n")],
        T_MLP,
        "rule",
    ),
    Mutation(
        "mlp_rule_degree_uniform",
        "learning degree averaged uniformly (not |D_k|)",
        f"{FEDMLP}/rule.py",
        [
            (
                "d = aggregate_learning_degree(degrees, sizes, missing)",
                "d = aggregate_learning_degree(degrees, torch.ones_like(sizes), missing)",
            )
        ],
        T_MLP,
        "rule",
    ),
    Mutation(
        "mlp_rule_weights_uniform",
        "model weights averaged uniformly, not FedAvg n_k",
        f"{FEDMLP}/rule.py",
        [
            (
                "weights = self.average(previous, contributions, groups)",
                "weights = self.average(previous, [Contribution(c.site, c.weights, 1.0, c.meta) for c in contributions], groups)",
            )
        ],
        T_MLP,
        "rule",
    ),
    # ---------------------------------------------------------------- FedMLP: equations
    Mutation(
        "mlp_logit_adjust_sign",
        "Eq. 3: log pi1 - log pi0 with the sign flipped",
        f"{FEDMLP}/maths.py",
        [
            (
                "return logits + tau * (torch.log(pi1) - torch.log(pi0))",
                "return logits - tau * (torch.log(pi1) - torch.log(pi0))",
            )
        ],
        T_MLP,
        "maths",
    ),
    Mutation(
        "mlp_consistency_unmasked",
        "consistency over every entry (mask ignored)",
        f"{FEDMLP}/maths.py",
        [
            (
                "    m = mask.to(p_local.dtype)\n    return ((p_local",
                "    m = torch.ones_like(p_local)\n    return ((p_local",
            )
        ],
        T_MLP,
        "maths",
    ),
    Mutation(
        "mlp_degree_band_inverted",
        "Eq. 10: confident = inside (L, R) instead of outside",
        f"{FEDMLP}/maths.py",
        [("confident = (probs < L) | (probs > R)", "confident = (probs >= L) & (probs <= R)")],
        T_MLP,
        "maths",
    ),
    # ---------------------------------------------------------------- FedLSM: the local objective (trainer)
    Mutation(
        "lsm_supervised_dropped",
        "L_I + L_U (pseudo-pool term) multiplied by 0",
        f"{FEDLSM}/trainer.py",
        [("loss = self.supervised_loss(out[:B],", "loss = 0.0 * self.supervised_loss(out[:B],")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_ude_dropped",
        "UDE term multiplied by 0",
        f"{FEDLSM}/trainer.py",
        [("loss = loss + self.opts.lam_ude * self.ude_loss(", "loss = loss + 0.0 * self.ude_loss(")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_ude_sign",
        "UDE term's sign flipped",
        f"{FEDLSM}/trainer.py",
        [("loss = loss + self.opts.lam_ude * self.ude_loss(", "loss = loss - self.opts.lam_ude * self.ude_loss(")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_lam_ude_ignored",
        "lam_ude ignored (weight 1)",
        f"{FEDLSM}/trainer.py",
        [("loss = loss + self.opts.lam_ude * self.ude_loss(", "loss = loss + self.ude_loss(")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_l_i_dropped",
        "single-label L_I multiplied by 0",
        f"{FEDLSM}/trainer.py",
        [
            (
                "return ce_labelled(logits, labels, mask) + pseudo_ce(",
                "return 0.0 * ce_labelled(logits, labels, mask) + pseudo_ce(",
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_l_u_dropped",
        "single-label L_U (pseudo labels) multiplied by 0",
        f"{FEDLSM}/trainer.py",
        [
            (
                "return ce_labelled(logits, labels, mask) + pseudo_ce(",
                "return ce_labelled(logits, labels, mask) + 0.0 * pseudo_ce(",
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_class_weights_ignored",
        "multi-label class weights ignored in L_I + L_U",
        f"{FEDLSM}/trainer.py",
        [
            (
                "        return weighted_bce(logits, targets, known, weights, self.opts.class_weighting)\n\n    def ude_loss",
                "        return weighted_bce(logits, targets, known, None, self.opts.class_weighting)\n\n    def ude_loss",
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_student_on_weak",
        "student trained on the weak view (not the strong one)",
        f"{FEDLSM}/trainer.py",
        [('inputs = [b["strong"]]', 'inputs = [b["weak"]]')],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_teacher_on_strong",
        "teacher's pseudo labels from the strong view",
        f"{FEDLSM}/trainer.py",
        [('            weak = [b["weak"]]\n', '            weak = [b["strong"]]\n')],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_teacher_is_student",
        "pseudo labels from the student, not the EMA teacher",
        f"{FEDLSM}/trainer.py",
        [
            (
                "tp = self.teacher_probs(teacher, torch.cat(weak), self.teacher_rows(labels[read], mask[read]))",
                "tp = self.teacher_probs(model, torch.cat(weak), self.teacher_rows(labels[read], mask[read]))",
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_ema_removed",
        "EMA teacher never updated",
        f"{FEDLSM}/trainer.py",
        [("            ema_update(teacher, model, self.opts.ema)\n", "            pass\n")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_ema_decay_inverted",
        "EMA decay 1 - ema (teacher follows the student)",
        f"{FEDLSM}/trainer.py",
        [("ema_update(teacher, model, self.opts.ema)", "ema_update(teacher, model, 1 - self.opts.ema)")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_pools_inverted",
        "pools by negated uncertainty (confident and uncertain swapped)",
        f"{FEDLSM}/trainer.py",
        [
            (
                "confident, medium, uncertain = split_pools(scores, n_h, n_l)",
                "confident, medium, uncertain = split_pools(-scores, n_h, n_l)",
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_uncertain_in_pseudo_pool",
        "uncertain pool also trained with L_I + L_U",
        f"{FEDLSM}/trainer.py",
        [("pseudo_pool = torch.cat([confident, medium])", "pseudo_pool = torch.cat([confident, medium, uncertain])")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_uncertain_high_thresholds",
        "uncertain samples labelled with the pseudo-pool thresholds",
        f"{FEDLSM}/trainer.py",
        [
            (
                'yh, kh, _ = self.targets(uncertain["label"], uncertain["mask"], teacher_uncertain, uncertain=True)',
                'yh, kh, _ = self.targets(uncertain["label"], uncertain["mask"], teacher_uncertain)',
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_mix_teacher_swapped",
        "mixed pairs labelled with each other's teacher outputs",
        f"{FEDLSM}/trainer.py",
        [
            (
                'bl, bh, tp[B : B + len(bl["weak"])], tp[B + len(bl["weak"]) :], lam',
                'bl, bh, tp[B + len(bl["weak"]) :], tp[B : B + len(bl["weak"])], lam',
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_mix_joint_or",
        "mixed entries labelled on either side count (not both)",
        f"{FEDLSM}/trainer.py",
        [("return x_mix, y_mix, kl[:m] & kh[:m]", "return x_mix, y_mix, kl[:m] | kh[:m]")],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_mix_lambda_flipped",
        "MixUp weight 1 - lam on the confident sample",
        f"{FEDLSM}/trainer.py",
        [
            (
                'mixup(confident["weak"][:m], yl[:m], uncertain["weak"][:m], yh[:m], lam)',
                'mixup(confident["weak"][:m], yl[:m], uncertain["weak"][:m], yh[:m], 1 - lam)',
            )
        ],
        T_LSM,
        "term",
    ),
    Mutation(
        "lsm_q_labelled_only",
        "q_c^k without the pseudo-label positives",
        f"{FEDLSM}/trainer.py",
        [("return (pos + targets * (known & ~mask.bool())).sum(0)", "return pos.sum(0)")],
        T_LSM,
        "term",
    ),
    # ---------------------------------------------------------------- FedLSM: the server rule
    Mutation(
        "lsm_awpa_fedavg",
        "AWPA replaced by plain FedAvg",
        f"{FEDLSM}/rule.py",
        [
            (
                'return self.average(previous, contributions, groups, awpa_weights(q, n), zero_rows="samples"), {}',
                "return self.average(previous, contributions, groups), {}",
            )
        ],
        T_LSM,
        "rule",
    ),
    Mutation(
        "lsm_awpa_by_samples",
        "AWPA weights replaced by n_k",
        f"{FEDLSM}/maths.py",
        [("return np.where(total > 0, q / np.where(total > 0, total, 1.0), by_n)", "return by_n")],
        T_LSM,
        "rule",
    ),
    Mutation(
        "lsm_masked_fedavg",
        "FedAvg* (masked) replaced by plain FedAvg",
        f"{FEDLSM}/rule.py",
        [
            (
                'return self.average(previous, contributions, groups, cw, zero_rows="previous"), {}',
                "return self.average(previous, contributions, groups), {}",
            )
        ],
        T_LSM,
        "rule",
    ),
    # ---------------------------------------------------------------- comparison methods: the main term
    Mutation(
        "fedprox_term_dropped",
        "FedProx: proximal term multiplied by 0",
        f"{METHODS}/fedprox.py",
        [
            (
                "return self.prox(self.ctx.model, self.global_model)",
                "return 0.0 * self.prox(self.ctx.model, self.global_model)",
            )
        ],
        T_CMP_SUP,
        "term",
    ),
    Mutation(
        "extra_loss_ignored",
        "SupervisedTrainer: extra_loss never added (FedProx, MOON, FedNoRo KD)",
        f"{METHODS}/baselines.py",
        [("                loss = loss + extra\n", "                loss = loss\n")],
        T_CMP_SUP,
        "term",
    ),
    Mutation(
        "moon_term_dropped",
        "MOON: contrastive term multiplied by 0",
        f"{METHODS}/moon.py",
        [("return self.opts.mu * model_contrastive_loss(", "return 0.0 * model_contrastive_loss(")],
        T_CMP_SUP,
        "term",
    ),
    Mutation(
        "moon_global_previous_swapped",
        "MOON: global and previous representations swapped",
        f"{METHODS}/moon.py",
        [
            (
                "model_contrastive_loss(features, z_glob, z_prev, self.opts.tau)",
                "model_contrastive_loss(features, z_prev, z_glob, self.opts.tau)",
            )
        ],
        T_CMP_SUP,
        "term",
    ),
    Mutation(
        "fedrs_restriction_dropped",
        "FedRS: logit scales ignored (plain softmax CE)",
        f"{METHODS}/fedrs.py",
        [
            (
                'return restricted_softmax_ce(logits, batch["label"], batch["mask"], self.scales)',
                'return restricted_softmax_ce(logits, batch["label"], batch["mask"], torch.ones_like(self.scales))',
            )
        ],
        T_CMP_SUP,
        "term",
    ),
    Mutation(
        "fpsl_class_weights_dropped",
        "FPSL: class weights ignored",
        f"{METHODS}/fpsl.py",
        [
            (
                'return fpsl_loss(logits, batch["label"], batch["mask"], self.pos_weight)',
                'return fpsl_loss(logits, batch["label"], batch["mask"], None)',
            )
        ],
        T_FPSL,
        "term",
    ),
    Mutation(
        "fixmatch_unlabelled_dropped",
        "FixMatch: unlabelled term multiplied by 0",
        f"{METHODS}/fixmatch.py",
        [("loss = loss + self.opts.lambda_u * unsupervised_loss(", "loss = loss + 0.0 * unsupervised_loss(")],
        T_FPSL,
        "term",
    ),
    Mutation(
        "fednoro_kd_dropped",
        "FedNoRo: distillation term multiplied by 0",
        f"{METHODS}/fednoro/trainer.py",
        [("        return self.lam * kd\n", "        return 0.0 * kd\n")],
        T_FEDNORO,
        "term",
    ),
    Mutation(
        "fednoro_la_unblended",
        "FedNoRo: L_LA not scaled by 1 - lambda",
        f"{METHODS}/fednoro/trainer.py",
        [("        return (1.0 - self.lam) * la\n", "        return la\n")],
        T_FEDNORO,
        "term",
    ),
    Mutation(
        "fednoro_daagg_fedavg",
        "FedNoRo: DaAgg weights replaced by plain FedAvg",
        f"{METHODS}/fednoro/rule.py",
        [("return w if self._distances is None else daagg_weights(w, self._distances)", "return w")],
        T_FEDNORO,
        "rule",
    ),
    Mutation(
        "fedlsr_sd_dropped",
        "FedLSR: self-distillation term dropped",
        f"{METHODS}/fedlsr.py",
        [("    loss = ce + beta * sd\n", "    loss = ce + 0.0 * sd\n")],
        T_FEDLSR,
        "term",
    ),
    Mutation(
        "fedlsr_entropy_dropped",
        "FedLSR: entropy regulariser dropped",
        f"{METHODS}/fedlsr.py",
        [("        loss = loss + lambda_e * ent\n", "        loss = loss + 0.0 * ent\n")],
        T_FEDLSR,
        "term",
    ),
    Mutation(
        "rscfed_consistency_dropped",
        "RSCFed: consistency term multiplied by 0",
        f"{METHODS}/rscfed/trainer.py",
        [("loss = sup + self.opts.consistency_weight * cons", "loss = sup + 0.0 * cons")],
        T_RSCFED,
        "term",
    ),
    Mutation(
        "fedlsr_ramp_ignored",
        "FedLSR: self-distillation weight gamma from round 0 (ramp ignored)",
        f"{METHODS}/fedlsr.py",
        [("beta = sd_weight(round_num, o.gamma, self.t_w(num_rounds))", "beta = o.gamma")],
        T_FEDLSR,
        "term",
    ),
    Mutation(
        "fedlsr_one_view",
        "FedLSR: both logits from view 1",
        f"{METHODS}/fedlsr.py",
        [
            (
                'z1, z2 = model(batch["image"]), model(batch["image_2"])',
                'z1, z2 = model(batch["image"]), model(batch["image"])',
            )
        ],
        T_FEDLSR,
        "term",
    ),
    Mutation(
        "rscfed_teacher_same_view",
        "RSCFed: teacher on the student's view",
        f"{METHODS}/rscfed/trainer.py",
        [('p, t = self.teacher_probs(b["image_2"])', 'p, t = self.teacher_probs(b["image"])')],
        T_RSCFED,
        "term",
    ),
    Mutation(
        "rscfed_ema_removed",
        "RSCFed: mean teacher never updated",
        f"{METHODS}/rscfed/trainer.py",
        [("            self.mean_teacher.update(model, self.opts.ema_decay)\n", "            pass\n")],
        T_RSCFED,
        "term",
    ),
    Mutation(
        "rscfed_unsharpened",
        "RSCFed: teacher's probabilities not sharpened",
        f"{METHODS}/rscfed/trainer.py",
        [("return p, sharpen(p, float(self.opts.sharpen), self.kind)", "return p, p")],
        T_RSCFED,
        "term",
    ),
    Mutation(
        "rscfed_dma_fedavg",
        "RSCFed: sub-consensus models replaced by plain FedAvg",
        f"{METHODS}/rscfed/rule.py",
        [
            (
                "        out = {key: weighted_average([m[key] for m in models], np.ones(len(models))) for key in models[0]}\n",
                "        out = {key: weighted_average([s[key] for s in states], a) for key in states[0]}\n",
            )
        ],
        T_RSCFED,
        "rule",
    ),
    Mutation(
        "cbafed_pseudo_labels_unused",
        "CBAFed: fixed pseudo labels left out of the local loss",
        f"{METHODS}/cbafed.py",
        [
            (
                'loss = self.loss(model(batch["image"].to(dev)), targets[idx], known[idx])',
                'loss = self.loss(model(batch["image"].to(dev)), targets[idx], base_known.to(dev)[idx])',
            )
        ],
        T_CBAFED,
        "term",
    ),
    Mutation(
        "cbafed_thresholds_fixed",
        "CBAFed: class-balanced thresholds replaced by tau_min",
        f"{METHODS}/cbafed.py",
        [
            (
                "return (p + base - std).clamp(min=tau_min, max=tau_max).float()",
                "return torch.full_like(p, tau_min).float()",
            )
        ],
        T_CBAFED,
        "term",
    ),
    Mutation(
        "cbafed_residual_dropped",
        "CBAFed: global residual connection never mixed",
        f"{METHODS}/cbafed.py",
        [
            (
                "            new = mix_states(new, self.residual, float(self.opts.residual_weight))\n",
                "            new = new\n",
            )
        ],
        T_CBAFED,
        "rule",
    ),
    Mutation(
        "cbafed_fedavg_weights",
        "CBAFed: trained-sample weights replaced by n_k (plain FedAvg)",
        f"{METHODS}/cbafed.py",
        [
            (
                '        if self.opts.weighting == "trained":\n            trained',
                "        if False:\n            trained",
            )
        ],
        T_CBAFED,
        "rule",
    ),
    Mutation(
        "fedpu_risk_dropped",
        "FedPU: PU risk multiplied by 0",
        f"{METHODS}/fedpu.py",
        [("        return ce + self.opts.pu_weight * risk\n", "        return ce + 0.0 * risk\n")],
        T_FEDPU,
        "term",
    ),
    Mutation(
        "fedlc_calibration_dropped",
        "FedLC: logit calibration ignored (plain CE)",
        f"{METHODS}/fedlc.py",
        [
            (
                'return calibrated_ce(logits, batch["label"], batch["mask"], self.offsets)',
                'return calibrated_ce(logits, batch["label"], batch["mask"], torch.zeros_like(self.offsets))',
            )
        ],
        T_FEDLC,
        "term",
    ),
    Mutation(
        "fedavgm_momentum_dropped",
        "FedAvgM: server momentum 0 (plain FedAvg)",
        f"{METHODS}/fedavgm.py",
        [("self.opts.server_momentum, self.opts.server_lr\n", "0.0, self.opts.server_lr\n")],
        T_FEDAVGM,
        "rule",
    ),
    Mutation(
        "fedavg_masked_rows_fedavg",
        "fedavg_masked: classifier rows averaged over every site (plain FedAvg)",
        f"{METHODS}/baselines.py",
        [
            (
                'return self.average(previous, contributions, groups, cw, zero_rows="previous"), {}',
                "return self.average(previous, contributions, groups), {}",
            )
        ],
        T_MASKED,
        "rule",
    ),
]


def _apply(root: Path, path: str, patches: list[tuple[str, str]]) -> None:
    f = root / path
    text = f.read_text()
    for old, new in patches:
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutation patch for {path} matches {n} times (needs exactly 1): {old[:80]!r}")
        text = text.replace(old, new)
    f.write_text(text)


def _run_tests(
    copy_root: Path, tests: tuple[str, ...], xml: Path, first_failure: bool = False
) -> tuple[int, list[str], int, float]:
    """Run test files / ids against ``copy_root/custom``; returns (rc, failing test ids, tests run, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy_root / "custom")}
    files = {t.split("::")[0] for t in tests}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-m",
        "not integration",
        *tests,
        f"--junitxml={xml}",
        *(f"--deselect={d}" for d in DESELECT if d.split("::")[0] in files),
    ]
    if first_failure:
        cmd.append("-x")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if not xml.exists():
        raise SystemExit(f"pytest wrote no report ({' '.join(tests)}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    failed, total = [], 0
    for case in ET.parse(xml).getroot().iter("testcase"):
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(case.get("name"))
    return proc.returncode, failed, total, seconds


def _check_import(copy_root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(copy_root / "custom")}
    out = subprocess.run(
        [sys.executable, "-c", "import fedpartial; print(fedpartial.__file__)"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not out.startswith(str(copy_root)):
        raise SystemExit(f"the mutated copy is not the imported package ({out})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/mutation", help="output prefix (.md and .json)")
    ap.add_argument("--only", nargs="*", help="run only these mutations (by name)")
    ap.add_argument("--method", help="run only the mutations of this table group (e.g. FedMLP)")
    ap.add_argument(
        "--all-tests",
        action="store_true",
        help="run every listed test for each mutation (default: stop at the first failing test)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="mutations tested at once (one pytest process each)")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the table (.md beside it) from a result file")
    args = ap.parse_args(argv)
    if args.render:  # the table again from a result (its groups from the current mutation list)
        result = json.loads(Path(args.render).read_text())
        groups = {m.name: m.group for m in MUTATIONS}
        for r in result["mutations"]:
            r["method"] = groups.get(r["name"], r["method"])
        Path(args.render).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.render).with_suffix(".md").write_text(_markdown(result))
        return 0
    names = [m.name for m in MUTATIONS]
    if len(names) != len(set(names)):
        raise SystemExit(f"duplicate mutation names: {sorted({n for n in names if names.count(n) > 1})}")
    chosen = [
        m
        for m in MUTATIONS
        if (not args.only or m.name in args.only) and (not args.method or m.group.lower() == args.method.lower())
    ]
    if args.only and len({m.name for m in chosen}) != len(set(args.only)):
        raise SystemExit(f"unknown mutation(s): {sorted(set(args.only) - {m.name for m in chosen})}")
    if not chosen:
        raise SystemExit("no mutation chosen")
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedpartial-mutation-") as tmp:
        tmp = Path(tmp)
        pristine = tmp / "pristine"
        shutil.copytree(REPO / "custom", pristine / "custom", ignore=shutil.ignore_patterns("__pycache__"))
        _check_import(pristine)
        # the baseline: every listed file (or, for a file listed only by test ids, those tests) on the unmutated copy
        listed = [t for m in chosen for t in m.test_args]
        whole = {t for t in listed if "::" not in t}
        units: dict[str, tuple[str, ...]] = {}
        for t in dict.fromkeys(listed):
            f = t.split("::")[0]
            units[f] = (f,) if f in whole else (*units.get(f, ()), t)

        def check(item: tuple[str, tuple[str, ...]]) -> tuple[str, dict]:
            f, tests = item
            xml = tmp / f"baseline-{Path(f).stem}.xml"
            rc, failed, total, sec = _run_tests(pristine, tests, xml)
            if rc != 0 or failed:
                raise SystemExit(f"the unmutated code fails {f}: {failed}")
            print(f"baseline {f}: {total} tests pass ({sec:.0f} s)", flush=True)
            return f, {"tests": total, "seconds": round(sec, 1)}

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            baseline = dict(pool.map(check, sorted(units.items())))

        def run(m: Mutation) -> dict:
            work = tmp / m.name
            shutil.copytree(pristine, work)
            _apply(work, m.path, m.patches)
            for path, patches in m.extra:
                _apply(work, path, patches)
            rc, failed, total, sec = _run_tests(work, m.test_args, tmp / f"{m.name}.xml", not args.all_tests)
            shutil.rmtree(work)
            if rc not in (0, 1) and not failed:  # pytest itself failed (collection, usage): not a verdict
                raise SystemExit(f"{m.name}: pytest exited {rc} without a failing test")
            print(
                f"{m.name:36s} {'CAUGHT' if failed else 'MISSED'} by {len(failed)} / {total}: {', '.join(failed)}"
                f" ({sec:.0f} s)",
                flush=True,
            )
            return {
                "name": m.name,
                "method": m.group,
                "what": m.what,
                "file": m.path,
                "origin": m.origin,
                "tests": list(m.test_args),
                "caught": bool(failed),
                "failing": failed,
                "run": total,
                "seconds": round(sec, 1),
            }

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            rows = list(pool.map(run, chosen))  # in the table's order
    total_s = time.perf_counter() - started
    result = {
        "command": "python benchmarks/mutation.py"
        + (" --all-tests" if args.all_tests else "")
        + (f" --jobs {args.jobs}" if args.jobs != 1 else "")
        + (f" --method {args.method}" if args.method else "")
        + (f" --only {' '.join(args.only)}" if args.only else ""),
        "first_failure": not args.all_tests,
        "baseline": baseline,
        "mutations": rows,
        "caught": sum(r["caught"] for r in rows),
        "total": len(rows),
        "seconds": round(total_s, 1),
    }
    out = REPO / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result))
    print(f"{result['caught']} / {result['total']} mutations caught ({total_s:.0f} s); wrote {out}.md / .json")
    return 0 if result["caught"] == result["total"] else 1


def _markdown(result: dict) -> str:
    origin = {
        "issue": "previously not caught",
        "caught": "previously caught",
        "option": "option / schedule",
        "term": "objective term",
        "rule": "server rule",
        "maths": "equation",
    }
    order = ["FedMLP", "FedLSM", "FedIRM", "surgical aggregation", "comparison methods"]
    groups: dict[str, list[dict]] = {}
    for r in sorted(
        result["mutations"], key=lambda r: order.index(r["method"]) if r["method"] in order else len(order)
    ):
        groups.setdefault(r["method"], []).append(r)
    lines = [
        "# Mutation run: FedMLP, FedLSM, FedIRM, surgical aggregation and the comparison methods",
        "",
        f"Command: `{result['command']}` ({result['seconds']:.0f} s wall time on the shared 2-core machine). Each",
        "mutation is one source patch on a temporary copy of `custom/` (the checkout is never modified); the",
        "method's targeted test files run against it (simulator tests left out"
        + (
            ", stopping at the first failing test: the table names that test"
            if result["first_failure"]
            else "; the table names every failing test"
        )
        + "). Caught = at least one test fails. "
        "The unmutated code passes: "
        + ", ".join(f"`{k}` {v['tests']} tests" for k, v in result["baseline"].items())
        + ".",
        "",
        f"**{result['caught']} of {result['total']} mutations caught.**",
        "",
        "| method | mutations | caught |",
        "|---|---|---|",
        *(f"| {g} | {len(rs)} | {sum(r['caught'] for r in rs)} |" for g, rs in groups.items()),
    ]
    for g, rs in groups.items():
        lines += [
            "",
            f"## {g}",
            "",
            "| mutation | behaviour removed | file | kind | tests run | caught by |",
            "|---|---|---|---|---|---|",
        ]
        for r in rs:
            by = ", ".join(f"`{t}`" for t in r["failing"]) if r["failing"] else "**not caught**"
            run = ", ".join(f"`{t.removeprefix('tests/')}`" for t in r["tests"])
            lines.append(
                f"| `{r['name']}` | {r['what']} | `{r['file'].removeprefix('custom/fedpartial/')}` | "
                f"{origin[r['origin']]} | {run} | {by} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
