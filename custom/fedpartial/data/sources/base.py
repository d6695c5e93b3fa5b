"""What every source loader returns: the whole labelled dataset as one table (method- and protocol-agnostic)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd


@dataclass
class SourceTable:
    """A source dataset, fully labelled.

    Attributes:
        name: source name (e.g. 'ham10000', 'nih_cxr14', 'rsna_ich', 'ich_phantom').
        task: 'multilabel' or 'multiclass' (single-label, one-hot rows).
        classes: class names, in column order.
        root: data root; ``frame['image']`` paths are relative to it.
        frame: one row per image with columns ``image`` (str, relative to root), ``patient_id`` (str; the image
            id itself where the source has no patient id) and one int 0/1 column per class.
        synthetic: True for generated data (logged loudly by users of the table).
    """

    name: str
    task: str
    classes: list[str]
    root: Path
    frame: pd.DataFrame
    synthetic: bool = False

    def __post_init__(self):
        self.root = Path(self.root)
        missing = [c for c in ["image", "patient_id", *self.classes] if c not in self.frame.columns]
        if missing:
            raise ValueError(f"source {self.name}: frame lacks columns {missing}")
