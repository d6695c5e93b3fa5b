"""FedLC's calibrated cross-entropy on a tiny tensor computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedpartial.methods.fedlc import calibrated_ce, calibration

COUNTS = torch.tensor([16.0, 1.0, 0.0])  # the site's labelled images per class


def test_calibration_offsets():
    """tau * n^(-1/4): 16 -> 0.5, 1 -> 1, 0 -> +inf (the class leaves the softmax); tau 0: none."""
    off = calibration(COUNTS, 1.0)
    assert off[:2].tolist() == pytest.approx([0.5, 1.0]) and math.isinf(off[2])
    assert calibration(COUNTS, 2.0)[:2].tolist() == pytest.approx([1.0, 2.0])
    assert calibration(COUNTS, 0.0).tolist() == [0.0, 0.0, 0.0]


def test_calibrated_loss_by_hand():
    """Row 1: logits (1, 0, 0), class 0 -> calibrated (0.5, -1, -inf): CE = log(1 + e^-1.5).
    Row 2: logits (0, 0, 0), class 1 -> (-0.5, -1, -inf): CE = log(1 + e^0.5).
    Row 3: its class is not annotated here -> left out. Mean of the two."""
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [5.0, -5.0, 0.0]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False], [True, True, False]])
    loss = calibrated_ce(logits, labels, mask, calibration(COUNTS, 1.0))
    expected = (math.log(1 + math.exp(-1.5)) + math.log(1 + math.exp(0.5))) / 2
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert torch.all(logits.grad[2] == 0) and torch.all(logits.grad[:, 2] == 0)  # unlabelled row, absent class


def test_tau_zero_is_plain_cross_entropy():
    logits = torch.tensor([[0.3, -0.2, 0.9]])
    labels, mask = torch.tensor([[0.0, 1.0, 0.0]]), torch.ones(1, 3, dtype=torch.bool)
    plain = F.cross_entropy(logits, torch.tensor([1]))
    assert float(calibrated_ce(logits, labels, mask, calibration(COUNTS, 0.0))) == pytest.approx(float(plain))
