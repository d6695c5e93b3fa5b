"""A run's results as text, read without torch (``fedpartial-admin results``, ``show_results``): the names of the
files a run writes beside its global models, why a finished run is degraded, and the tables of ``results.md``.
:mod:`fedpartial.fl.results` (the server's recorder) writes them."""

from __future__ import annotations

import re

from ..metrics import format_table, format_thresholds
from ..tables import across_sites_line, paper_table
from .keys import BEST_MODEL, LAST_MODEL

RESULTS_FILE = "results.json"
TABLE_FILE = "results.md"
THRESHOLDS_FILE = "thresholds.json"  # next to the global models: per-class thresholds chosen on validation


def render_tables(results: dict) -> str:
    """The run's tables: the paper-layout row (last-round and best-on-validation global model on test) and
    the per-class tables of both models on test and validation."""
    out = [
        f"# {results['method']} on {results['dataset']} ({results.get('setting', 'unknown')}), "
        f"{results['num_rounds']} rounds, {(results.get('seconds_per_round') or 0):.1f} s/round"
    ]
    if results.get("global_model_note"):
        out.append(f"Note: {results['global_model_note']}.")
    if results.get("scores_note"):
        out.append(f"Note: {results['scores_note']}.")
    if results.get("encoder"):
        out.append(
            f"Encoder ({results.get('encoder_from', 'the last round')} global model's): {results['encoder']} "
            "(start a job from it: --set model.pretrained=<that file>)."
        )
    failed = [r["round"] for r in results.get("rounds", []) if r.get("rule_error")]
    if failed:
        out.append(
            f"The server rule failed in round(s) {failed} (previous global model kept; see rounds[].rule_error)."
        )
    final = results.get("final", {})
    rows = {}
    for name, label in ((LAST_MODEL, "last round"), (BEST_MODEL, "best on validation")):
        test = (final.get(name) or {}).get("test")
        if test:
            rows[f"{results['method']} ({label})"] = {results.get("setting", "unknown"): [test["macro"]]}
            task = test["task"]
    if rows:
        out.append("Test set, macro averages in the layout of the papers' tables (%):\n\n" + paper_table(rows, task))
    if results.get("best"):
        out.append(f"best on validation: after {results['best']['trained_rounds']} rounds ({results['best']})")
    for name, res in final.items():
        if res.get("across_sites"):
            out.append(across_sites_line(name, res["across_sites"]))
    for name, res in final.items():
        for split in ("test", "val"):
            if res.get(split):
                out.append("```\n" + format_table(res[split], title=f"{name} on {split} (site average)") + "\n```")
        if res.get("thresholds") and res.get("test"):
            out.append(format_thresholds(res["test"], res["thresholds"], title=f"{name} on test:"))
    return "\n\n".join(out) + "\n"


def _spans(rounds: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, r in enumerate(rounds):
        if start is None:
            start = r
        if i + 1 == len(rounds) or rounds[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def degradation(results: dict) -> dict | None:
    """Why a finished run is degraded, from its ``results.json`` record: the sites missing from rounds (dead,
    slow or failed), the sites whose updates were refused, the final evaluation without the sites missing from
    the last round, the classes no present site annotated. None when nothing of this happened.

    A refused site's reason line names why (its distinct refusal reasons, up to three).

    Returns ``{"missing_sites": {site: [rounds]}, "rejected_sites": {site: [rounds]}, "final_without": [sites],
    "classes_without_annotator": [classes], "reasons": [one line each]}``.
    """
    rounds = results.get("rounds") or []
    missing: dict[str, list[int]] = {}
    rejected: dict[str, list[int]] = {}
    why: dict[str, list[str]] = {}  # site -> the distinct reasons its updates were refused (first seen first)
    for r in rounds:
        for s in r.get("missing") or []:
            missing.setdefault(s, []).append(int(r["round"]))
        for s, reason in (r.get("rejected") or {}).items():
            rejected.setdefault(s, []).append(int(r["round"]))
            text = re.sub(r"^round \d+: ", "", str(reason))
            if text not in why.setdefault(s, []):
                why[s].append(text)
    last = list((rounds[-1].get("missing") or [])) if rounds else []
    first_val = (rounds[0].get("val") or {}) if rounds else {}
    classes = list(first_val.get("per_class") or [])  # the class names in the model's column order
    present = [info for s, info in ((results.get("data") or {}).get("sites") or {}).items() if s not in last]
    covered = {int(j) for info in present for j in (info.get("annotated") or [])}
    lost_classes = [c for j, c in enumerate(classes) if j not in covered] if last else []
    reasons = [
        f"site {s} sent no update in round(s) {_spans(r)} of {len(rounds)} (dead, slow or failed)"
        for s, r in sorted(missing.items())
    ]
    reasons += [
        f"site {s}'s update was refused in round(s) {_spans(r)}: "
        + "; ".join(why[s][:3])
        + (f" (and {len(why[s]) - 3} other reason(s))" if len(why[s]) > 3 else "")
        for s, r in sorted(rejected.items())
    ]
    if last:
        reasons.append(f"the final evaluation ran without {', '.join(sorted(last))}")
    if lost_classes:
        reasons.append(f"class(es) {lost_classes} had no annotating site at the end (not learnt from then on)")
    if not reasons:
        return None
    return {
        "missing_sites": missing,
        "rejected_sites": rejected,
        "final_without": sorted(last),
        "classes_without_annotator": lost_classes,
        "reasons": reasons,
    }
