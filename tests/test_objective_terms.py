"""Each method's local objective and server rule on a tiny batch, computed by hand.

A deterministic site: a linear model (``features`` = the flattened image, ``head`` = one linear layer; no dropout,
no BatchNorm), six 4-pixel images whose second view is the image reversed and whose strong view is the image
negated, batches in row order and plain SGD. One local step moves the weights by exactly ``-lr`` times the
gradient of the objective, so a test that composes the objective term by term from the paper (each term's
function has its own hand-computed test in the method's test file) and compares the weights after the trainer's
own round fails when a term is dropped, mis-weighted, has its sign flipped, sees the wrong view or the wrong
model. The server rules are checked the same way on two or three sites whose aggregate is written out by hand,
against plain FedAvg of the same contributions.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedpartial.methods import Contribution, SiteContext, get_method
from fedpartial.methods import fedlsm as LSM
from fedpartial.methods import fedmlp as MLP

X6 = torch.tensor(
    [
        [2.0, 0.0, 0.5, 1.0],
        [0.0, 3.0, 0.0, -1.0],
        [0.5, -1.0, 2.5, 0.5],
        [1.0, 1.0, -0.5, 0.0],
        [0.2, 0.1, 2.0, -0.8],
        [-1.0, 0.5, 0.0, 1.3],
    ]
)
W0 = torch.tensor([[0.6, -0.5, 0.2, 0.4], [-0.3, 0.7, 0.1, -0.6], [0.1, -0.2, 0.5, 0.3]])
B0 = torch.tensor([0.1, -0.1, 0.05])


class _Lin(torch.nn.Module):
    """``(B, 1, 1, D)`` images -> ``features`` ``(B, D)`` (the pixels) -> ``Linear(D, C)`` logits."""

    def __init__(self, d: int = 4, c: int = 3):
        super().__init__()
        self.classifier = torch.nn.Linear(d, c)
        with torch.no_grad():
            self.classifier.weight.copy_(W0[:c, :d])
            self.classifier.bias.copy_(B0[:c])

    def features(self, x):
        return x.flatten(1)

    def head(self, f):
        return self.classifier(f)

    def forward(self, x):
        return self.head(self.features(x))

    def parameter_groups(self):
        return {"encoder": [], "norm": [], "head": [], "classifier": ["classifier.weight", "classifier.bias"]}


def _view(images: torch.Tensor, key: str, kind: str) -> torch.Tensor:
    """``image_2`` is the image reversed; the ``strong`` view is the image negated; every other view the image."""
    if key == "image_2":
        return images.flip(-1)
    return -images if kind == "strong" else images


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, images, labels, mask, views):
        self.images, self.labels, self.mask, self.views = images, labels, mask, dict(views)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        item = {k: _view(self.images[i], k, kind) for k, kind in self.views.items()}
        item.update(label=self.labels[i].clone(), mask=self.mask[i].clone(), index=torch.tensor(i))
        return item


class _Data:
    """The methods of ``SiteDatasets`` a trainer uses: rows in order, deterministic views."""

    def __init__(self, images, labels, mask):
        self.images, self.labels, self.mask = images, labels, mask

    def dataset(self, split, views):
        return _Dataset(self.images, self.labels, self.mask, views)

    def train_loader(self, views, batch_size, **_):
        return torch.utils.data.DataLoader(self.dataset("train", views), batch_size=batch_size, shuffle=False)

    def fetcher(self, views, seed, batched=False, device="cpu", on_device="off"):
        ds = self.dataset("train", views)
        return lambda idx: torch.utils.data.default_collate([ds[int(i)] for i in idx])


def _ctx(task: str, annotated, labels, mask, lr=0.5, batch_size=3, **train) -> SiteContext:
    c = len(annotated)
    return SiteContext(
        site="s",
        task=task,
        classes=[f"c{i}" for i in range(c)],
        annotated=np.asarray(annotated, bool),
        model=_Lin(4, c),
        data=_Data(X6[:, None, None, :], labels, mask),
        device=torch.device("cpu"),
        state_dir=Path("."),
        seed=0,
        train={"optimizer": "sgd", "momentum": 0.0, "lr": lr, "batch_size": batch_size, **train},
    )


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _sgd(model, loss_of, lr):
    """``model`` after one plain SGD step on ``loss_of(model)`` (in place); returns the loss."""
    loss = loss_of(model)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(lr * g)
    return float(loss.detach())


def _assert_same_weights(model, expected, atol=1e-6):
    for k, v in _params(model).items():
        assert torch.allclose(v, expected[k], atol=atol), (k, v, expected[k])


def _logsig(z):
    return torch.nn.functional.logsigmoid(z)


# ------------------------------------------------------------------------------------------------ FedMLP

# class 0 and 1 annotated, class 2 missing (stored 0); row 0 carries a positive pseudo label of class 2, row 3 a
# negative one, the other rows none (they get the consistency term in stage 2)
MLP_LABELS = torch.tensor(
    [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
)
MLP_MASK = torch.tensor([[True, True, False]] * 6)
MLP_PSEUDO = torch.tensor(
    [[-1, -1, 1], [-1, -1, -1], [-1, -1, -1], [-1, -1, 0], [-1, -1, -1], [-1, -1, -1]], dtype=torch.int8
)


def _fedmlp_objective(model, received, rows, pi1, la_tau, cr_weight, use_cr, pseudo):
    """FedMLP's step objective written out: for each of the two views v (image, image reversed), Eq. 4 on the
    logit-adjusted outputs ``z + tau (log pi1 - log pi0)`` (Eq. 3) summed over the labelled entries (annotated +
    pseudo-labelled) / C and averaged over the samples, plus ``cr_weight`` x the mean squared difference between
    the model's and the received model's sigmoid outputs on that view over the entries with neither label; the
    mean over the two views."""
    x = X6[rows][:, None, None, :]
    y = MLP_LABELS[rows].clone()
    lab = MLP_MASK[rows].clone()
    if pseudo:
        t = MLP_PSEUDO[rows]
        y = torch.where(t >= 0, t.float(), y)
        lab = lab | (t >= 0)
    total = 0.0
    for v in (x, x.flip(-1)):
        z = model(v)
        za = z + la_tau * (torch.log(pi1) - torch.log(1 - pi1))
        bce = -(y * _logsig(za) + (1 - y) * _logsig(-za))
        term = (bce * lab).sum(1).mean() / 3
        if use_cr:
            with torch.no_grad():
                q = torch.sigmoid(received(v))
            free = (~lab).float()
            term = term + cr_weight * (((torch.sigmoid(z) - q) ** 2) * free).sum() / free.sum()
        total = total + term
    return total / 2


@pytest.mark.parametrize("stage", [1, 2])
def test_fedmlp_step_is_wpc_on_annotated_and_pseudo_labels_plus_weighted_consistency_by_hand(stage):
    """Two SGD steps (rows 0-2, then 3-5) of FedMLP's local objective, each term by hand: stage 1 is L_WPC alone
    (parity paper); stage 2 adds the pseudo labels to the supervised entries and ``cr_weight`` x the consistency
    to the frozen received model on the entries with neither label (zero gradient on the first step, where the
    model is the received one; not on the second). Eq. 3's rates: annotated classes the site's share of
    positives (3/6 for both), the missing class ``(positive pseudo labels + 1) / (N + 2) = 2/8`` (no data
    summary); ``la_tau`` 0.5 and ``cr_weight`` 2 so that neither can be dropped unnoticed."""
    ctx = _ctx("multilabel", (True, True, False), MLP_LABELS, MLP_MASK)
    tr = MLP.FedMLPTrainer(ctx, warmup_rounds=1 if stage == 2 else 3, mld=False, la_tau=0.5, cr_weight=2.0)
    if stage == 2:
        tr.pseudo_labels = MLP_PSEUDO.clone()
    received = copy.deepcopy(ctx.model)
    pi1 = torch.tensor([3 / 6, 3 / 6, 2 / 8 if stage == 2 else 1 / 8])
    expected = copy.deepcopy(ctx.model)
    losses = [
        _sgd(expected, lambda m: _fedmlp_objective(m, received, rows, pi1, 0.5, 2.0, stage == 2, stage == 2), 0.5)
        for rows in (slice(0, 3), slice(3, 6))
    ]
    if stage == 2:  # the consistency term is live on the second step: without it the step differs
        alt = copy.deepcopy(ctx.model)
        for rows in (slice(0, 3), slice(3, 6)):
            _sgd(alt, lambda m: _fedmlp_objective(m, received, rows, pi1, 0.5, 2.0, False, True), 0.5)
        assert not torch.allclose(alt.classifier.weight, expected.classifier.weight, atol=1e-4)
    out = tr.train_round(1 if stage == 2 else 0, 4, {})
    assert out.steps == 2 and out.loss == pytest.approx(sum(losses) / 2, abs=1e-6)
    _assert_same_weights(ctx.model, dict(expected.named_parameters()))


def test_fedmlp_sends_prototypes_of_its_annotated_classes_and_degrees_of_the_trained_model_by_hand():
    """After the round (from the last warm-up round on): P1 / P0 of each annotated class = the mean feature (here
    the pixels) of its positive / negative rows (Eq. 5), nothing for the missing class (count 0); the learning
    degree of class c = the share of samples whose probability under the trained model lies outside [L, R]
    (Eq. 10, left), computed here from the weights the round ends with."""
    ctx = _ctx("multilabel", (True, True, False), MLP_LABELS, MLP_MASK)
    tr = MLP.FedMLPTrainer(ctx, warmup_rounds=1, mld=False, cr=False, L=0.45, R=0.55)
    out = tr.train_round(0, 4, {})
    f = X6
    counts = np.asarray(out.meta[MLP.META_COUNTS])
    p0, p1 = np.asarray(out.meta[MLP.META_P0]), np.asarray(out.meta[MLP.META_P1])
    for c in (0, 1):
        pos = MLP_LABELS[:, c] == 1
        assert np.allclose(p1[c], f[pos].mean(0).numpy(), atol=1e-6)
        assert np.allclose(p0[c], f[~pos].mean(0).numpy(), atol=1e-6)
    assert counts.reshape(3, -1)[2].sum() == 0 and counts.reshape(3, -1)[:2].sum() == 12
    with torch.no_grad():
        probs = torch.sigmoid(ctx.model(X6[:, None, None, :]))
    degree = ((probs < 0.45) | (probs > 0.55)).float().mean(0)
    assert not torch.allclose(degree, 1 - degree)  # the band matters: inside (L, R) would differ
    assert np.allclose(np.asarray(out.meta[MLP.META_DEGREE]), degree.numpy(), atol=1e-6)


# ------------------------------------------------------------------------------------------------ FedLSM

# multi-label: classes 0 and 1 annotated (row 5 lacks class 1), class 2 missing; single-label: rows 0-2 labelled
LSM_ML = (
    torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    ),
    torch.tensor([[True, True, False]] * 5 + [[True, False, False]]),
)
LSM_MC = (
    torch.tensor(
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    ),
    torch.tensor([[True, True, False]] * 6),
)
LSM_OPTS = {  # pools of one sample each, one mixed pair per step, thresholds that label some entries and not others
    "multilabel": dict(tau_p=0.68, tau_n=0.30, tau_lp=0.55, tau_ln=0.05),
    "multiclass": dict(tau=0.43, tau_l=0.40, restrict_unknown=False),
}
LAM, LAM_UDE, EMA = 0.7, 0.3, 0.25


def _lsm_targets(task, probs, labels, mask, opts, uncertain=False):
    """Eq. 4-5 written out: the label where annotated (a labelled row / entry), else the teacher's pseudo label
    by the thresholds (the lower ones for the uncertain pool). Returns (targets, known)."""
    if task == "multiclass":
        lab = (labels * mask).sum(1) > 0
        conf, cls = probs.max(1)
        pseudo = ~lab & (conf >= (opts["tau_l"] if uncertain else opts["tau"]))
        t = torch.where(lab[:, None], labels, F.one_hot(cls, 3).float() * pseudo[:, None])
        return t, lab | pseudo
    hi, lo = (opts["tau_lp"], opts["tau_ln"]) if uncertain else (opts["tau_p"], opts["tau_n"])
    pos, neg = ~mask & (probs >= hi), ~mask & (probs <= lo)
    return torch.where(mask, labels, pos.float()), mask | pos | neg


def _lsm_step(task, model, teacher, pool, conf, unc, opts, weights):
    """One FedLSM step by hand: L_I + L_U on the student's strong view (the image negated) of the pseudo pool
    with the teacher's pseudo labels on the weak view (the image), plus lam_UDE x the UDE loss on the MixUp (Eq. 6)
    of the confident and the uncertain sample's weak views and (pseudo) labels, over what both sides label."""
    labels, mask = LSM_ML if task == "multilabel" else LSM_MC
    act = (lambda z: torch.softmax(z, 1)) if task == "multiclass" else torch.sigmoid
    x = X6[:, None, None, :]
    with torch.no_grad():
        tp = act(teacher(x))
    y, known = _lsm_targets(task, tp[pool], labels[pool], mask[pool], opts)
    z = model(-x[pool])
    if task == "multiclass":
        lab = (labels[pool] * mask[pool]).sum(1) > 0
        logp = torch.log_softmax(z, 1)
        l_i = -(logp[lab] * labels[pool][lab]).sum(1).mean()
        n_u = int((~lab).sum())
        l_u = -(logp * y)[known & ~lab].sum() / n_u
        sup = l_i + l_u
    else:
        per = -(weights * y * _logsig(z) + (1 - y) * _logsig(-z))
        sup = (per * known).sum() / len(pool)
    yl, kl = _lsm_targets(task, tp[conf], labels[conf], mask[conf], opts)
    yh, kh = _lsm_targets(task, tp[unc], labels[unc], mask[unc], opts, uncertain=True)
    zm = model(LAM * x[conf] + (1 - LAM) * x[unc])
    ym, km = LAM * yl + (1 - LAM) * yh, kl & kh
    if task == "multiclass":
        ude = -(ym * torch.log_softmax(zm, 1)).sum(1)[km].mean() if bool(km.any()) else zm.sum() * 0
    else:
        ude = (-(ym * _logsig(zm) + (1 - ym) * _logsig(-zm)) * km).sum() / len(conf)
    return sup + LAM_UDE * ude, (y, known, km)


@pytest.mark.parametrize("task", ["multilabel", "multiclass"])
def test_fedlsm_steps_are_pseudo_pool_loss_plus_weighted_ude_with_an_ema_teacher_by_hand(task, monkeypatch):
    """Two SGD steps of FedLSM at a site of 6 images, each term by hand. Pools from the received model's
    uncertainty (multi-label: binary entropy of the missing class; single-label: softmax entropy): the most
    certain image is the confident pool, the least certain the uncertain pool, the pseudo pool the other five
    plus the confident one. Multi-label L_I + L_U: BCE over the known entries / B with FPSL's class weights on
    the positives (negatives / positives of the site's annotated entries: 4/2, 3/2, 1 for the missing class);
    single-label: CE over the labelled rows + CE over the pseudo-labelled rows / the unlabelled rows. The
    teacher is the received model, then its EMA (decay 0.25) after each step; MixUp weight fixed at 0.7."""
    monkeypatch.setattr(torch.distributions.Beta, "sample", lambda self, *a, **k: torch.tensor(LAM))
    labels, mask = LSM_ML if task == "multilabel" else LSM_MC
    opts = LSM_OPTS[task]
    ctx = _ctx(task, (True, True, False), labels, mask, lr=2.0, batch_size=6, local_steps=2)
    tr = LSM.FedLSMTrainer(ctx, n_uncertain=1, n_confident=1, n_mix=1, lam_ude=LAM_UDE, ema=EMA, **opts)
    x = X6[:, None, None, :]
    with torch.no_grad():
        p0 = torch.sigmoid(ctx.model(x)) if task == "multilabel" else torch.softmax(ctx.model(x), 1)
    h = (-(p0 * p0.log() + (1 - p0) * (1 - p0).log()))[:, 2] if task == "multilabel" else -(p0 * p0.log()).sum(1)
    conf, unc = [int(h.argmin())], [int(h.argmax())]
    pool = [i for i in range(6) if i != unc[0]]
    weights = torch.tensor([4 / 2, 3 / 2, 1.0])
    student, teacher = copy.deepcopy(ctx.model), copy.deepcopy(ctx.model)
    inverted = copy.deepcopy(ctx.model)  # the EMA with the decay the wrong way round (1 - 0.25)
    seen = []
    for _ in range(2):
        loss_of = lambda m: _lsm_step(task, m, teacher, pool, conf, unc, opts, weights)[0]  # noqa: E731
        seen.append(
            [
                _lsm_step(task, student, t, pool, conf, unc, opts, weights)[1]
                for t in (teacher, ctx.model, student, inverted)
            ]
        )
        _sgd(student, loss_of, 2.0)
        with torch.no_grad():
            for t, i, s in zip(teacher.parameters(), inverted.parameters(), student.parameters()):
                t.mul_(EMA).add_((1 - EMA) * s)
                i.mul_(1 - EMA).add_(EMA * s)
    # the case exercises every part: the mixed pair shares a known entry; on the second step the EMA teacher
    # labels differently from the received model (multi-label: also from the student and from the inverted EMA)
    assert bool(seen[0][0][2].any())
    step2 = seen[1]
    for other in (1, 2, 3) if task == "multilabel" else (1,):
        assert any(not torch.equal(a, b) for a, b in zip(step2[0], step2[other])), other
    tr.train_round(0, 3, {})
    _assert_same_weights(ctx.model, dict(student.named_parameters()), atol=1e-5)


# ------------------------------------------------------------------------------------------------ comparison methods


class _TwoLayer(_Lin):
    """``features`` = tanh of a linear map of the pixels (so that a representation depends on the weights)."""

    def __init__(self):
        super().__init__(3, 3)
        self.fc = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[0.5, -0.4, 0.3, 0.2], [0.1, 0.6, -0.5, 0.4], [-0.3, 0.2, 0.4, -0.6]]))
            self.fc.bias.copy_(torch.tensor([0.05, -0.1, 0.2]))

    def features(self, x):
        return torch.tanh(self.fc(x.flatten(1)))

    def parameter_groups(self):
        return {
            "encoder": ["fc.weight", "fc.bias"],
            "norm": [],
            "head": [],
            "classifier": ["classifier.weight", "classifier.bias"],
        }


def _two_steps(ctx, trainer, objective, lr=0.5, round_num=0):
    """Run the trainer's round (two steps: rows 0-2, then 3-5) and check it against two SGD steps of
    ``objective(model, rows)`` computed here. Returns the expected per-step losses."""
    expected = copy.deepcopy(ctx.model)
    losses = [_sgd(expected, lambda m: objective(m, rows), lr) for rows in (slice(0, 3), slice(3, 6))]
    out = trainer.train_round(round_num, 3, {})
    assert out.steps == 2
    _assert_same_weights(ctx.model, dict(expected.named_parameters()))
    return losses, out


def _partial_bce(z, y, m, pos_weight=None):
    """Mean BCE over the annotated entries (positives weighted by ``pos_weight``)."""
    w = torch.ones(z.shape[1]) if pos_weight is None else pos_weight
    per = -(w * y * _logsig(z) + (1 - y) * _logsig(-z))
    return (per * m).sum() / m.sum()


def _x(rows, negate=False):
    x = X6[rows][:, None, None, :]
    return -x if negate else x


def test_fedprox_step_adds_half_mu_times_the_squared_distance_to_the_received_weights_by_hand():
    """FedProx: partial BCE + mu/2 ||w - w_received||^2 over every parameter (mu 0.5); the proximal term has no
    gradient on the first step (w = w_received) and pulls back on the second."""
    labels, mask = LSM_ML
    ctx = _ctx("multilabel", (True, True, False), labels, mask)
    received = copy.deepcopy(ctx.model)
    tr = get_method("fedprox").make_trainer(ctx, {"mu": 0.5})

    def objective(m, rows):
        prox = sum(((p - q.detach()) ** 2).sum() for p, q in zip(m.parameters(), received.parameters()))
        return _partial_bce(m(_x(rows)), labels[rows], mask[rows].float()) + 0.5 / 2 * prox

    _two_steps(ctx, tr, objective)


def test_moon_step_adds_mu_times_the_contrastive_term_toward_the_global_and_away_from_the_previous_model():
    """MOON round 1 (after a round 0 that stored the site's model): partial BCE + mu l_con with
    l_con = -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau})), z the
    representation of the model in training, z_glob of the model received this round, z_prev of the site's model
    after its previous round (mu 2, tau 0.5)."""
    labels, mask = LSM_ML
    ctx = _ctx("multilabel", (True, True, False), labels, mask)
    ctx.model = _TwoLayer()
    tr = get_method("moon").make_trainer(ctx, {"mu": 2.0, "tau": 0.5})
    tr.train_round(0, 3, {})
    previous = copy.deepcopy(ctx.model)
    with torch.no_grad():  # the next global model: not the site's own
        ctx.model.fc.weight.mul_(-0.5)
        ctx.model.classifier.bias.add_(0.3)
    received = copy.deepcopy(ctx.model)

    def objective(m, rows):
        x = _x(rows)
        z = m.features(x)
        with torch.no_grad():
            zg, zp = received.features(x), previous.features(x)
        pos = F.cosine_similarity(z, zg, dim=1) / 0.5
        neg = F.cosine_similarity(z, zp, dim=1) / 0.5
        l_con = -torch.log(torch.exp(pos) / (torch.exp(pos) + torch.exp(neg))).mean()
        return _partial_bce(m.head(z), labels[rows], mask[rows].float()) + 2.0 * l_con

    _two_steps(ctx, tr, objective, round_num=1)


def test_fedrs_step_scales_the_logits_of_classes_the_site_does_not_hold_by_hand():
    """FedRS: CE of the restricted softmax on the labelled rows, the logit of class 2 (no labelled image here)
    scaled by alpha 0.5; rows without a label (3-5) add nothing."""
    labels, mask = LSM_MC
    ctx = _ctx("multiclass", (True, True, False), labels, mask)
    tr = get_method("fedrs").make_trainer(ctx, {"alpha": 0.5})
    scale = torch.tensor([1.0, 1.0, 0.5])

    def objective(m, rows):
        z = m(_x(rows)) * scale
        y, lab = labels[rows].argmax(1), labels[rows].sum(1) > 0
        return -(torch.log_softmax(z, 1)[lab, y[lab]]).sum() / max(int(lab.sum()), 1) + 0 * z.sum()

    _two_steps(ctx, tr, objective)


def test_fpsl_step_weights_the_positives_by_negatives_over_positives_by_hand():
    """FPSL (class weights of the site's labels): mean BCE over the annotated entries with the positives of class c
    weighted by its negatives / positives (4/2, 3/2; 1 for the class without annotated entries)."""
    labels, mask = LSM_ML
    ctx = _ctx("multilabel", (True, True, False), labels, mask)
    tr = get_method("fpsl").make_trainer(ctx, {"class_weights": "site"})
    w = torch.tensor([2.0, 1.5, 1.0])
    _two_steps(ctx, tr, lambda m, rows: _partial_bce(m(_x(rows)), labels[rows], mask[rows].float(), w))


def test_fixmatch_step_adds_lambda_u_times_the_strong_view_loss_on_confident_weak_view_pseudo_labels():
    """FixMatch (multi-label, tau 0.6, lambda_u 2): partial BCE on the weak view + lambda_u x BCE of the strong
    view (the image negated) against the weak view's hard pseudo labels (p >= tau -> 1, p <= 1 - tau -> 0) on the
    unannotated entries, summed over the pseudo-labelled entries / the unannotated entries."""
    labels, mask = LSM_ML
    ctx = _ctx("multilabel", (True, True, False), labels, mask)
    tr = get_method("fixmatch").make_trainer(ctx, {"tau": 0.6, "lambda_u": 2.0})
    used = []

    def objective(m, rows):
        zw, zs = m(_x(rows)), m(_x(rows, negate=True))
        p = torch.sigmoid(zw.detach())
        cand = ~mask[rows]
        pos, neg = cand & (p >= 0.6), cand & (p <= 0.4)
        t = pos.float()
        per = -(t * _logsig(zs) + (1 - t) * _logsig(-zs))
        used.append(int((pos | neg).sum()))
        return _partial_bce(zw, labels[rows], mask[rows].float()) + 2.0 * (per * (pos | neg)).sum() / cand.sum()

    _two_steps(ctx, tr, objective)
    assert all(used)  # both steps have pseudo labels


def test_fedlc_step_subtracts_tau_times_count_to_the_minus_quarter_from_each_logit_by_hand():
    """FedLC (tau 1): CE of the logits minus tau n_c^(-1/4) on the labelled rows, n = (2, 1, 0) labelled images
    per class here: class 2 (no image) leaves the softmax."""
    labels, mask = LSM_MC
    ctx = _ctx("multiclass", (True, True, False), labels, mask)
    tr = get_method("fedlc").make_trainer(ctx, {"tau": 1.0})
    offsets = torch.tensor([2.0**-0.25, 1.0, 0.0])

    def objective(m, rows):
        z = m(_x(rows))[:, :2] - offsets[:2]
        y, lab = labels[rows].argmax(1), labels[rows].sum(1) > 0
        return -(torch.log_softmax(z, 1)[lab, y[lab]]).sum() / max(int(lab.sum()), 1) + 0 * m(_x(rows)).sum()

    _two_steps(ctx, tr, objective)


def test_fedpu_step_is_ce_plus_pu_weight_times_the_pu_risk_by_hand():
    """FedPU (priors: the site's labelled shares (2/6, 1/6, 0); pu_weight 0.5): CE on the labelled rows +
    0.5 x sum over the site's classes i of [mean over the unlabelled rows of -log(1 - p_i) - pi_i x mean over the
    rows labelled i of -log(1 - p_i)]."""
    labels, mask = LSM_MC
    ctx = _ctx("multiclass", (True, True, False), labels, mask)
    tr = get_method("fedpu").make_trainer(ctx, {"prior": "site", "pu_weight": 0.5})
    prior = torch.tensor([2 / 6, 1 / 6, 0.0])

    def objective(m, rows):
        z = m(_x(rows))
        logp = torch.log_softmax(z, 1)
        y, lab = labels[rows].argmax(1), labels[rows].sum(1) > 0
        ce = -(logp[lab, y[lab]]).sum() / max(int(lab.sum()), 1)
        nl = -torch.log(1 - torch.softmax(z, 1))
        risk = 0.0
        for i in (0, 1):
            in_l = lab & (y == i)
            u = nl[~lab, i].mean() if bool((~lab).any()) else 0.0
            li = nl[in_l, i].mean() if bool(in_l.any()) else 0.0
            risk = risk + u - prior[i] * li
        return ce + 0.5 * risk

    _two_steps(ctx, tr, objective)


# ------------------------------------------------------------------------------------------------ server rules

GROUPS = {"encoder": ["enc"], "norm": [], "head": [], "classifier": ["cls"]}


def _contribution(site, enc, cls, n, annotated, **meta):
    return Contribution(
        site,
        {"enc": np.asarray(enc, np.float32), "cls": np.asarray(cls, np.float32)},
        n,
        {"annotated": list(annotated), **meta},
    )


def _two_sites(**meta):
    """Site a (n 1) annotates class 0, site b (n 3) classes 0 and 1; each classifier row is one number."""
    return [
        _contribution("a", [1.0, 2.0], [[10.0], [20.0]], 1.0, [True, False], **meta.get("a", {})),
        _contribution("b", [5.0, 6.0], [[30.0], [40.0]], 3.0, [True, True], **meta.get("b", {})),
    ]


def test_fedlsm_awpa_rows_by_estimated_class_counts_not_fedavg_by_hand():
    """AWPA (Eq. 7): the shared weights by n_k (FedAvg: (1 x a + 3 x b) / 4); classifier row c by q_c^k /
    sum_j q_c^j: q = (6, 2) at a and (2, 6) at b: row 0 = (6 x 10 + 2 x 30) / 8 = 15, row 1 = (2 x 20 + 6 x 40) / 8 = 35
    (FedAvg would give 25 and 35)."""
    rule = get_method("fedlsm").make_rule({})
    contribs = _two_sites(a={LSM.META_Q: [6.0, 2.0]}, b={LSM.META_Q: [2.0, 6.0]})
    out, _ = rule.aggregate(None, contribs, GROUPS, 0)
    assert np.allclose(out["enc"], [(1 * 1 + 3 * 5) / 4, (1 * 2 + 3 * 6) / 4])
    assert np.allclose(out["cls"], [[15.0], [35.0]])


def test_fedavg_masked_rows_over_the_annotating_sites_by_hand():
    """fedavg_masked: row 0 (both annotate) = (1 x 10 + 3 x 30) / 4 = 25; row 1 (only b) = 40, not FedAvg's 35."""
    rule = get_method("fedavg_masked").make_rule({})
    out, _ = rule.aggregate({"enc": np.zeros(2), "cls": np.zeros((2, 1))}, _two_sites(), GROUPS, 0)
    assert np.allclose(out["cls"], [[25.0], [40.0]]) and np.allclose(out["enc"], [4.0, 5.0])


def test_fedavgm_server_momentum_over_two_rounds_by_hand():
    """FedAvgM (beta 0.5, eta 1): round 1 from w0 = 0 to the FedAvg a1 (v1 = w0 - a1); round 2 from w1 = a1 with
    the same sites: v2 = 0.5 v1 + (w1 - a2) and w2 = w1 - v2; here a1 = a2 = (4, 5) for enc, so w2 = a1 + 0.5 a1."""
    rule = get_method("fedavgm").make_rule({"server_momentum": 0.5, "server_lr": 1.0})
    w0 = {"enc": np.zeros(2, np.float32), "cls": np.zeros((2, 1), np.float32)}
    w1, _ = rule.aggregate(w0, _two_sites(), GROUPS, 1)
    assert np.allclose(w1["enc"], [4.0, 5.0])
    w2, _ = rule.aggregate(w1, _two_sites(), GROUPS, 2)
    # v1 = -(4, 5); v2 = 0.5 v1 + (w1 - a2) = -(2, 2.5); w2 = w1 - v2 = (6, 7.5)
    assert np.allclose(w2["enc"], [6.0, 7.5])


def test_fednoro_noisy_site_step_blends_la_and_distillation_by_lambda_by_hand():
    """FedNoRo at a noisy site (every site noisy, lambda ramped to kd_weight 0.6 by round 1): (1 - lambda) x CE of
    the logit-adjusted outputs z + log pi (pi = (2/3, 1/3, 0): class 2 leaves the softmax) on the labelled rows
    + lambda x KL(softmax(z_received / T) || softmax(z + log pi)) averaged over the batch (T 0.5; the absent
    class contributes q log q only). The teacher is the model received this round."""
    labels, mask = LSM_MC
    ctx = _ctx("multiclass", (True, True, False), labels, mask)
    tr = get_method("fednoro").make_trainer(
        ctx, {"all_noisy": True, "ramp_begin": 0, "ramp_end": 1, "kd_weight": 0.6, "kd_temperature": 0.5}
    )
    received = copy.deepcopy(ctx.model)
    delta = torch.log(torch.tensor([2 / 3, 1 / 3]))

    def objective(m, rows):
        x = _x(rows)
        z = m(x)
        logp = torch.log_softmax(z[:, :2] + delta, 1)  # class 2: log 0 adjustment, out of the softmax
        y, lab = labels[rows].argmax(1), labels[rows].sum(1) > 0
        la = -(logp[lab, y[lab]]).sum() / max(int(lab.sum()), 1) + 0 * z.sum()
        with torch.no_grad():
            q = torch.softmax(received(x) / 0.5, 1)
        kd = ((q * q.log()).sum(1) - (q[:, :2] * logp).sum(1)).mean()
        return 0.4 * la + 0.6 * kd

    _two_steps(ctx, tr, objective, round_num=1)


def test_rscfed_step_adds_weighted_distillation_to_the_sharpened_mean_teacher_on_the_other_view_by_hand():
    """RSCFed (multi-label): partial BCE of the student on view 1 + consistency_weight (2) x the mean squared
    difference, over the unannotated entries, between the student's sigmoid outputs and the mean teacher's
    sharpened ones (T 0.5: p^2 / (p^2 + (1 - p)^2)) on view 2 (the image reversed). The teacher (step counter 5:
    EMA decay min(1 - 1/6, 0.5) = 0.5) moves halfway to the student after the first step."""
    labels, mask = LSM_ML
    ctx = _ctx("multilabel", (True, True, False), labels, mask)
    tr = get_method("rscfed").make_trainer(ctx, {"consistency_weight": 2.0, "sharpen": 0.5, "ema_decay": 0.5})
    teacher = copy.deepcopy(tr.ensure_teacher())
    with torch.no_grad():  # a teacher that is not the student
        tr.ensure_teacher().classifier.bias.add_(torch.tensor([0.0, 0.4, -0.6]))
        teacher.classifier.bias.add_(torch.tensor([0.0, 0.4, -0.6]))
    tr.mean_teacher.step = 5
    expected = copy.deepcopy(ctx.model)
    for rows in (slice(0, 3), slice(3, 6)):

        def objective(m):
            x = _x(rows)
            z = m(x)
            with torch.no_grad():
                p = torch.sigmoid(teacher(x.flip(-1)))
                t = p**2 / (p**2 + (1 - p) ** 2)
            free = (~mask[rows]).float()
            cons = (((torch.sigmoid(z) - t) ** 2) * free).sum() / free.sum()
            return _partial_bce(z, labels[rows], mask[rows].float()) + 2.0 * cons

        _sgd(expected, objective, 0.5)
        with torch.no_grad():
            for t_, s in zip(teacher.parameters(), expected.parameters()):
                t_.mul_(0.5).add_(0.5 * s)
    tr.train_round(1, 3, {})
    _assert_same_weights(ctx.model, dict(expected.named_parameters()))


def test_fedlsr_step_is_ce_plus_ramped_self_distillation_plus_entropy_on_two_views(monkeypatch):
    """FedLSR (single-label) at round 1 with t_w 4: beta = gamma x 1/4 (gamma 0.4); the step's loss is
    :func:`fedlsr_loss` (its terms by hand in tests/test_fedlsr.py) of the two views' logits (view 2: the image
    reversed) with the round's beta, lambda_e 0.6 and the MixUp weight drawn (fixed here at 0.3)."""
    from fedpartial.methods.fedlsr import fedlsr_loss

    monkeypatch.setattr(torch.distributions.Beta, "sample", lambda self, *a, **k: torch.tensor(0.3))
    labels, mask = LSM_MC
    ctx = _ctx("multiclass", (True, True, False), labels, mask)
    tr = get_method("fedlsr").make_trainer(ctx, {"t_w": 4, "gamma": 0.4, "lambda_e": 0.6})
    v1, v2 = tr.opts.views

    def objective(m, rows):
        x = X6[rows][:, None, None, :]
        z1, z2 = m(_view(x, "image", v1)), m(_view(x, "image_2", v2))
        return fedlsr_loss(
            z1,
            z2,
            labels[rows],
            mask[rows],
            0.3,
            0.1,
            "multiclass",
            tr.opts.sharpen_t,
            tr.opts.distill_t,
            0.6,
            tr.opts.missing,
        )[0]

    losses, out = _two_steps(ctx, tr, objective, round_num=1)
    assert out.meta["fedlsr_sd_weight"] == pytest.approx(0.1)


def test_fedmlp_rule_prototypes_over_annotating_sites_and_degrees_over_missing_sites_by_size_by_hand():
    """FedMLP's server: the weights by n_k (FedAvg: (1 x 1 + 3 x 2 + 6 x 4) / 10 = 3.1); P0 / P1 of class 0 the
    plain mean over the sites annotating it (A and B: (1 + 3) / 2 = 2 and (2 + 6) / 2 = 4; n_k weights would
    give 2.5 and 5); the learning degree of class 1 the |D_k|-weighted mean over the sites missing it (A and C:
    (1 x 0.2 + 6 x 0.6) / 7; uniform would give 0.4), of class 0 C's alone (0.8)."""

    def site(name, w, n, annotated, p0, p1, counts, degree):
        return Contribution(
            name,
            {"w": np.asarray([w], np.float32)},
            n,
            {
                "annotated": annotated,
                MLP.META_P0: np.asarray(p0, np.float32),
                MLP.META_P1: np.asarray(p1, np.float32),
                MLP.META_COUNTS: np.asarray(counts, np.int64),
                MLP.META_DEGREE: np.asarray(degree, np.float64),
            },
        )

    contribs = [
        site("A", 1.0, 1.0, [True, False], [[1.0], [0.0]], [[2.0], [0.0]], [[1, 1], [0, 0]], [0.9, 0.2]),
        site("B", 2.0, 3.0, [True, True], [[3.0], [5.0]], [[6.0], [7.0]], [[1, 1], [1, 1]], [0.5, 0.5]),
        site("C", 4.0, 6.0, [False, False], [[0.0], [0.0]], [[0.0], [0.0]], [[0, 0], [0, 0]], [0.8, 0.6]),
    ]
    weights, meta = get_method("fedmlp").make_rule({}).aggregate(None, contribs, {}, 0)
    assert weights["w"][0] == pytest.approx(3.1)
    assert np.allclose(meta[MLP.META_GLOBAL_P0], [[2.0], [5.0]])
    assert np.allclose(meta[MLP.META_GLOBAL_P1], [[4.0], [7.0]])
    assert meta[MLP.META_GLOBAL_DEGREE] == pytest.approx([0.8, (0.2 + 6 * 0.6) / 7])


def test_cbafed_step_trains_on_the_labels_and_the_fixed_pseudo_labels_of_the_received_model_by_hand():
    """CBAFed (multi-label) after its warm-up, class shares (0.4, 0.4, 0.2) from the server: thresholds
    tau_c = clip(p_c + 0.45 - std(p), 0.55, 0.95) with std = sqrt(0.04 / 3) = 0.11547: (0.73453, 0.73453, 0.55); an
    unannotated entry whose received-model probability is > tau_c is a fixed positive, < 1 - tau_c a fixed
    negative; each step is the mean BCE over the annotated and pseudo-labelled entries."""
    labels, mask = LSM_ML
    ctx = _ctx("multilabel", (True, True, False), labels, mask)
    tr = get_method("cbafed").make_trainer(ctx, {"warmup_rounds": 1})
    with torch.no_grad():
        p = torch.sigmoid(ctx.model(X6[:, None, None, :]))
    free = ~mask
    tau = torch.tensor([0.4 + 0.45 - math.sqrt(0.04 / 3)] * 2 + [0.55])
    pos, neg = free & (p > tau), free & (p < 1 - tau)
    assert int(pos.sum()) > 0 and int(neg.sum()) > 0
    y, known = torch.where(mask, labels, pos.float()), (mask | pos | neg).float()
    expected = copy.deepcopy(ctx.model)
    for rows in (slice(0, 3), slice(3, 6)):
        _sgd(expected, lambda m: _partial_bce(m(_x(rows)), y[rows], known[rows]), 0.5)
    from fedpartial.methods import cbafed

    out = tr.train_round(1, 3, {cbafed.META_SHARE: [0.4, 0.4, 0.2]})
    assert out.meta[cbafed.META_PSEUDO] == int((pos | neg).sum())
    assert np.allclose(out.meta[cbafed.META_TAU], tau.numpy(), atol=1e-5)
    _assert_same_weights(ctx.model, dict(expected.named_parameters()))
