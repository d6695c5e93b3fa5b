"""The model card of an exported bundle (``docs/README.md``): data, sites, metrics with intervals, thresholds,
known limits, with the final model's figures (``fedpartial.plots``) beside it in ``docs/``."""

from __future__ import annotations

import math
from pathlib import Path

from ..plots import write_final_figures
from ..stats import f1_interval, wilson_interval
from ..tables import across_sites_line


def _pct(v) -> str:
    return "n/a" if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) else f"{100 * v:.1f}"


def _ci(iv) -> str:
    return f" [{100 * iv[0]:.1f}, {100 * iv[1]:.1f}]" if iv else ""


def _rate_ci(rate, n) -> str:
    """`` [lo, hi]`` of a proportion measured on ``n`` cases (Wilson), '' when unknown."""
    if rate is None or not n or not isinstance(rate, (int, float)) or not math.isfinite(rate):
        return ""
    return _ci(wilson_interval(round(rate * n), int(n)))


def metrics_table(test: dict) -> list[str]:
    """Per class: the test positives / negatives, AUROC with its 95 % bootstrap interval, and sensitivity,
    specificity (95 % Wilson intervals) and F1 (95 % parametric-bootstrap interval from the confusion counts) at
    the validation thresholds where the run has them (else at 0.5 / the argmax), AP and BACC for multi-label, in
    percent."""
    if not test:
        return ["No test evaluation is recorded for this model file."]
    multilabel = test.get("task", "multilabel") == "multilabel"
    ci = (test.get("ci") or {}).get("auc") or {}
    counts = test.get("counts") or {}
    at = "_val_thr" if multilabel and any("bacc_val_thr" in (m or {}) for m in test["per_class"].values()) else ""
    head = ["AP", "BACC"] if multilabel else []
    lines = [
        "| class | test +/- | AUROC [95 % CI] | " + " | ".join(head + ["sensitivity", "specificity", "F1"]) + " |",
        "|---|---|---|" + "---|" * (len(head) + 3),
    ]

    def row(name: str, m: dict, n: dict, auc_iv) -> str:
        sens = m.get("recall" + at) if multilabel else m.get("sensitivity")
        spec = m.get("specificity")
        if multilabel and m.get("bacc" + at) is not None and sens is not None:
            spec = 2 * m["bacc" + at] - sens
        pos, neg = n.get("pos"), n.get("neg")
        f1 = m.get("f1" + at)
        f1_iv = f1_interval(sens, spec, pos, neg) if pos and neg is not None and spec is not None else None
        cells = ([_pct(m.get("ap")), _pct(m.get("bacc" + at))] if multilabel else []) + [
            _pct(sens) + _rate_ci(sens, pos),
            _pct(spec) + _rate_ci(spec, neg),
            _pct(f1) + _ci(f1_iv),
        ]
        size = f"{pos} / {neg}" if pos is not None and neg is not None else n.get("all", "n/a")
        return f"| {name} | {size} | {_pct(m.get('auc'))}{_ci(auc_iv)} | " + " | ".join(cells) + " |"

    for c, m in test["per_class"].items():
        m = m or {}
        iv = (ci.get("per_class") or {}).get(c) if m.get("auc") is not None else None
        lines.append(row(c, m, counts.get(c) or {}, iv))
    macro = dict(test.get("macro") or {})
    macro["ap"] = macro.get("map")
    mrow = row("**macro**", macro, {"all": f"{test.get('n')} images"}, ci.get("macro"))
    lines.append(mrow)
    where = "the validation thresholds" if at else ("0.5" if multilabel else "the argmax")
    lines += [
        "",
        f"Percent, on the test set (n = {test.get('n')}); `test +/-`: the class's scored positive / negative "
        f"test images; thresholded columns at {where}, with 95 % intervals (sensitivity, specificity: "
        "Wilson; F1: bootstrap of the confusion counts; AUROC: bootstrap of the images); `n/a`: the class "
        "lacks an outcome there or its numbers stayed at the sites (minimum count).",
    ]
    return lines


SMALL_CLASS = 30
"""Test positives below which a class's numbers get a warning."""


def warnings_for(meta: dict, final: dict) -> list[str]:
    """What a reader must know before trusting the numbers: few rounds, a small test set or class, predictions
    concentrated on one class, a class always or never predicted."""
    train, test = meta["training"], final.get("test") or {}
    out = []
    rounds = int(train.get("rounds") or 0)
    if rounds and rounds < 5:
        out.append(f"Trained for {rounds} round(s) only: a demonstration, not a finished model.")
    n = int(test.get("n") or 0)
    if test and n < 200:
        out.append(f"Small test set: {n} images; every number below moves by several points with a few images.")
    counts = test.get("counts") or {}
    small = [f"{c} ({v['pos']})" for c, v in counts.items() if v.get("pos") is not None and v["pos"] < SMALL_CLASS]
    if small:
        out.append(
            f"Fewer than {SMALL_CLASS} positive test images: {', '.join(small)}; their sensitivity and F1 rest "
            "on these few cases (see the intervals)."
        )
    preds = {c: v.get("pred") for c, v in counts.items() if v.get("pred") is not None}
    if test.get("task") == "multiclass" and preds and n:
        top = max(preds, key=preds.get)
        share, truth = preds[top] / n, (counts[top].get("pos") or 0) / n
        if share >= 0.7 and share > 2 * truth:
            out.append(
                f"Predictions concentrate on {top}: {100 * share:.0f} % of the test images are predicted "
                f"{top}, {100 * truth:.0f} % are {top}."
            )
    elif preds:
        always = [
            c
            for c, v in counts.items()
            if v.get("pred") is not None
            and v.get("pos") is not None
            and v["pos"] + v["neg"]
            and v["pred"] >= v["pos"] + v["neg"]
        ]
        never = [c for c, v in counts.items() if v.get("pred") == 0 and v.get("pos")]
        if always:
            out.append(f"Predicted positive for every test image: {', '.join(always)}.")
        if never:
            out.append(f"Never predicted positive on the test set: {', '.join(never)}.")
    if (final.get("across_sites") or {}).get("warning"):
        out.append(final["across_sites"]["warning"][0].upper() + final["across_sites"]["warning"][1:] + ".")
    return [f"- **{x}**" for x in out]


def privacy_lines(privacy: dict) -> list[str]:
    """The privacy ledger in words, one line per site."""
    out = []
    for site, t in privacy.items():
        scope = t.get("scope")
        eps = t.get("epsilon")
        guarantee = (
            "no formal differential-privacy guarantee (statistics left without noise)"
            if eps is None
            else f"differential privacy at epsilon {eps:.3g}" + (f", delta {t['delta']:g}" if t.get("delta") else "")
        )
        out.append(
            f"- {site}: {t.get('releases')} release(s) of per-class statistics; "
            + (f"privacy scope `{scope}`" if scope else "no privacy scope (the job's defaults)")
            + f"; counts below {t.get('min_count')} withheld; {guarantee}."
        )
    return out


def known_limits(meta: dict, final: dict) -> list[str]:
    train, thr = meta["training"], meta.get("thresholds") or {}
    out = []
    if str(train.get("dataset") or "").endswith("phantom"):
        out.append("Trained and tested on a synthetic phantom: the numbers say nothing about real scans.")
    test = final.get("test") or {}
    undefined = sorted({c for cs in (test.get("undefined_classes") or {}).values() for c in cs})
    if undefined:
        out.append(f"No test AUROC / AP for {', '.join(undefined)} (one outcome only, or kept at the sites).")
    if thr:
        unset = [c for c, v in (thr.get("chosen") or {}).items() if v is None]
        if unset:
            out.append(f"No validation threshold for {', '.join(unset)}: the bundle decides at 0.5 there.")
        small = [c for c, n in (thr.get("n_val") or {}).items() if n is not None and n < 50]
        if small:
            out.append(f"Thresholds of {', '.join(small)} rest on fewer than 50 validation images each.")
    annotators: dict[str, int] = {}
    for s in (train.get("sites") or {}).values():
        for c in s.get("annotated_classes") or []:
            annotators[c] = annotators.get(c, 0) + 1
    rare = (
        [c for c in meta["network_data_format"]["outputs"]["pred"]["channel_def"].values() if annotators.get(c, 0) <= 1]
        if annotators
        else []
    )
    if rare:
        out.append(
            f"Annotated at one site or none: {', '.join(rare)}; the other sites' images of these classes "
            "were unlabelled for them (partial labels)."
        )
    if train.get("global_model_note"):
        out.append(f"{'Model' if train.get('site') else 'Global model'}: {train['global_model_note']}.")
    if train.get("degraded"):
        out.append(f"The run was degraded: {train['degraded']}.")
    ci = ((test.get("ci") or {}).get("auc") or {}).get("macro")
    if ci and ci[1] - ci[0] > 0.1:
        out.append(f"Wide intervals (macro AUROC {100 * ci[0]:.1f} to {100 * ci[1]:.1f}): a small test set.")
    pre = meta["preprocessing"]
    out.append(
        f"Input: one 2-D image at a time, resized to {pre['image_size']} px; no volume, no view or "
        "acquisition check, no out-of-distribution detection. Not validated for clinical use."
    )
    return [f"- {x}" for x in out]


def write_model_card(bundle: Path, meta: dict, final: dict, results: dict) -> Path:
    """``bundle/docs/README.md`` and its figures ``bundle/docs/*.png``; returns the README's path."""
    docs = Path(bundle) / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    train, pre, thr = meta["training"], meta["preprocessing"], meta.get("thresholds") or {}
    classes = list(meta["network_data_format"]["outputs"]["pred"]["channel_def"].values())
    try:
        figs = write_final_figures(results, train["model_file"], docs) if results else {}
    except ImportError:  # matplotlib is in requirements.txt; a bare install may lack it
        figs = {}
    lines = [
        f"# {meta['name']}: {meta['task']}",
        "",
        f"{meta['description']} Intended use: {meta['intended_use']}.",
        "",
        "## Use",
        "",
        "```bash",
        "python -m monai.bundle run --config_file configs/inference.json --dataset_dir IMAGES --output_dir OUT",
        "```",
        "",
        "`OUT/predictions.csv`: `image`, `prob_<class>` per class, then "
        + (
            "`pred_<class>` (1 where the probability reaches the class's threshold)."
            if meta["task_type"] == "multilabel"
            else "`prediction` (the class of the highest probability)."
        ),
        "Needs torch, MONAI with pytorch-ignite and fire, numpy, Pillow and pydicom (`configs/metadata.json` "
        "lists the versions), not the training package: `scripts/image_io.py` decodes the images as training "
        "did.",
        "",
        "## Input",
        "",
        *[f"- {s}" for s in pre["steps"]],
        f"- tensor: {pre['channels']} x {pre['image_size']} x {pre['image_size']} float32 "
        f"({'; '.join(meta['network_data_format']['inputs']['image']['channel_def'].values())})",
        "",
        "## Output and thresholds",
        "",
    ]
    if thr:
        lines += ["| class | threshold | chosen on validation | validation images |", "|---|---|---|---|"]
        for c, v in zip(classes, thr["values"]):
            chosen = (thr.get("chosen") or {}).get(c)
            lines.append(
                f"| {c} | {v:.3f} | {'yes (' + str(thr.get('criterion')) + ')' if chosen is not None else 'no (0.5)'}"
                f" | {(thr.get('n_val') or {}).get(c, 'n/a')} |"
            )
    else:
        lines.append(f"Single-label: softmax over {', '.join(classes)}; the prediction is the argmax (no threshold).")
    lines += [
        "",
        "## Training",
        "",
        f"- job `{train['job']}`, method `{train['method']}`, {train['rounds']} rounds, exported "
        f"`{train['model_file']}`"
        + (
            f" (best on validation, after {train['best_round']} of them)"
            if train.get("best_round") is not None and train["model_file"].startswith("best")
            else ""
        ),
        f"- data: {train['dataset']} ({train.get('setting') or 'n/a'}); fingerprint `{train['data_fingerprint']}`",
        f"- architecture `{train['architecture']}`; exported {train['exported']}",
        "",
    ]
    if train["sites"]:
        lines += ["| site | train | val | test | annotated classes |", "|---|---|---|---|---|"]
        for s, i in train["sites"].items():
            lines.append(
                f"| {s} | {i['n_train']} | {i['n_val']} | {i['n_test']} | "
                f"{', '.join(i['annotated_classes']) or 'none'} |"
            )
        lines.append("")
    if train.get("privacy"):
        lines += ["Privacy (what left each site besides the model weights):", "", *privacy_lines(train["privacy"]), ""]
    warn = warnings_for(meta, final)
    lines += ["## Metrics", "", *(warn + [""] if warn else []), *metrics_table(final.get("test") or {}), ""]
    if final.get("across_sites"):  # each hospital's own test set: within each, their mean, and all pooled
        lines += [across_sites_line("the exported model", final["across_sites"], warning=False), ""]
    captions = {
        "auc_ci": "Per-class test AUROC with its 95 % bootstrap interval",
        "sites": "Test AUROC per site and class",
        "roc": "ROC curves (dot: the operating threshold)",
        "pr": "Precision-recall curves (dot: the operating threshold)",
    }
    for name in ("auc_ci", "sites", "roc", "pr"):
        if name in figs:
            lines += [f"![{captions[name]}]({Path(figs[name]).name})", ""]
    lines += ["## Known limits", "", *known_limits(meta, final), ""]
    path = docs / "README.md"
    path.write_text("\n".join(lines))
    return path
