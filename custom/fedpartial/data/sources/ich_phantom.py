"""Where the benchmark scripts import the ICH phantom from; it lives in :mod:`fedpartial.data.catalog.ich.phantom`
(the package itself imports it from there)."""

from __future__ import annotations

from ..catalog.ich.phantom import generate_ich_phantom, load_ich_phantom

__all__ = ["generate_ich_phantom", "load_ich_phantom"]
