"""Supervised losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fedpartial.losses import bce_missing_as_negative, ce_labelled, ce_restricted, masked_bce, supervised_loss

LOGITS = torch.tensor([[0.0, 2.0], [1.0, -1.0]])
LABELS = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
MASK = torch.tensor([[True, False], [True, False]])


def bce(z, y):
    p = 1 / (1 + math.exp(-z))
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


def test_masked_bce_only_annotated_entries():
    expected = (bce(0.0, 1) + bce(1.0, 0)) / 2  # two annotated entries
    assert masked_bce(LOGITS, LABELS, MASK).item() == pytest.approx(expected, rel=1e-6)


def test_missing_as_negative_uses_all_entries():
    expected = (bce(0.0, 1) + bce(2.0, 0) + bce(1.0, 0) + bce(-1.0, 0)) / 4
    assert bce_missing_as_negative(LOGITS, LABELS, MASK).item() == pytest.approx(expected, rel=1e-6)


def test_masked_bce_empty_mask_is_zero_with_grad():
    z = LOGITS.clone().requires_grad_()
    loss = masked_bce(z, LABELS, torch.zeros_like(MASK))
    loss.backward()
    assert loss.item() == 0.0 and z.grad is not None


def test_single_label_losses():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    labels = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # row 2 unlabelled here
    mask = torch.tensor([[True, True, False], [True, True, False]])
    full = -math.log(math.exp(2) / (math.exp(1) + math.exp(2) + math.exp(3)))
    restricted = -math.log(math.exp(2) / (math.exp(1) + math.exp(2)))  # class 3 not annotated at the site
    assert ce_labelled(logits, labels, mask).item() == pytest.approx(full, rel=1e-6)
    assert ce_restricted(logits, labels, mask).item() == pytest.approx(restricted, rel=1e-6)


def test_supervised_loss_dispatch():
    assert supervised_loss("multilabel", "partial") is masked_bce
    with pytest.raises(ValueError):
        supervised_loss("multilabel", "bogus")
