"""Who scores a shared evaluation set: each site reports a fingerprint of its validation and test sets in the
data summary; a set several sites hold (the simulator's central splits) is scored once, by the first of them by
name (:func:`scorer_of`), the others skip it. Read by the sites (:mod:`fedpartial.fl.executor`) and the server's
selection (:mod:`fedpartial.fl.selection`)."""

from __future__ import annotations


def scorer_of(split: str, fingerprint: str, sites: dict) -> str | None:
    """The site that scores an evaluation set: the first by name of the data summary's sites (``{site: {"eval_sets":
    {split: fingerprint}}}``) holding a set with this fingerprint; None when no site reports it."""
    holders = sorted(s for s, info in sites.items() if (info.get("eval_sets") or {}).get(split) == fingerprint)
    return holders[0] if holders else None
