"""The coordinator's data report: what each site holds, read from NVFlare's federated statistics
(:mod:`fedpartial.fl.fedstats`), with warnings about the shortcuts a model could learn before any training.

:func:`summarise` turns NVFlare's combined statistics (``{feature: {statistic: {site or "Global": {split:
value}}}}``) into per-site and pooled tables; :func:`warnings_of` checks them against :data:`THRESHOLDS`;
:func:`write_report` writes ``data_report.md``, ``data_report.json`` and ``data_intensity.png``.

Warnings (each threshold a key of :data:`THRESHOLDS`, overridable per job):

- ``unannotated_class``: a class no site annotates (a training job's data check stops on it).
- ``single_site_class``: a class annotated (training split) by one site only: the federation learns it from
  that site alone, with that site's images, scanner and population.
- ``few_positives``: a class with fewer than ``min_positives`` annotated positives in the federation's
  training splits (withheld counts are each below the minimum count; they are added as their upper bound).
- ``prevalence``: a class whose prevalence among the annotated training images differs by more than a factor
  ``prevalence_ratio`` between two sites that annotate it (a site with none of its positives counts as infinite).
- ``intensity``: a site whose intensity histogram (any channel, after the site's decoding) has a Jensen-Shannon
  divergence (base 2: 0 the same, 1 disjoint) above ``intensity_js`` from every other site's (from the most
  similar one's): the site can be told apart by brightness / contrast alone, and a model may learn the site (and
  with it the labels it annotates) from it. Honest splits of one dataset measure 0.01-0.06 with 20 images of
  32 x 32 px per site (less with more images); one site's images brightened by 40 grey levels, above 0.15.
- ``one_size``: a site whose training images all have one size (width and height standard deviation 0) while
  another site's do not, or have another size: resizing differs between sites.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

GLOBAL = "Global"
SPLITS = ("train", "val", "test")
INTENSITY = "intensity_"
"""The prefix of the per-channel pixel features (``intensity_c0`` ...)."""


def class_feature(kind: str, j: int) -> str:
    """The statistics feature of class ``j``'s annotated positives (``kind`` "pos") or negatives ("neg"): ``pos_3``.
    Feature names are keys of the job's histogram configuration, which ``nvflare job submit`` re-reads as HOCON,
    where a ``.`` or ``:`` nests a key: the class's index, not its name (any spelling), and no ``:``."""
    return f"{kind}_{j}"


def intensity_feature(k: int) -> str:
    """The statistics feature of every pixel of channel ``k`` (``intensity_c0``)."""
    return f"{INTENSITY}c{k}"


THRESHOLDS = {
    "min_positives": 20,  # a class with fewer annotated positives in the federation (training splits)
    "prevalence_ratio": 5.0,  # the largest / the smallest prevalence of a class among the sites annotating it
    "intensity_js": 0.1,  # Jensen-Shannon divergence (bits) of a site's histogram from the nearest other site's
}
REPORT_MD, REPORT_JSON, FIGURE = "data_report.md", "data_report.json", "data_intensity.png"


def _get(data: dict, feature: str, stat: str, site: str, split: str):
    return (((data.get(feature) or {}).get(stat) or {}).get(site) or {}).get(split)


def sites_of(data: dict) -> list[str]:
    """The sites that answered (those with a count of any feature)."""
    names = set()
    for feature in data.values():
        names.update(k for k in (feature.get("count") or {}) if k != GLOBAL)
    return sorted(names)


def channels_of(data: dict) -> list[str]:
    return sorted(f for f in data if f.startswith(INTENSITY))


def _bins(value) -> list[tuple[float, float, float]]:
    return [(float(b[0]), float(b[1]), float(b[2])) for b in (value or [])]


def class_entry(pos, neg, images) -> dict:
    """One site's and split's numbers for a class (None: withheld by the site's minimum count)."""
    if pos == 0 and neg == 0:
        status = "not annotated"
    elif pos is None and neg is None:
        status = "withheld"
    else:
        status = "annotated"
    annotated = None if pos is None or neg is None else pos + neg
    return {
        "status": status,
        "positives": pos,
        "negatives": neg,
        "annotated": annotated,
        "unlabelled": None if annotated is None or images is None else images - annotated,
        "prevalence": pos / annotated if annotated else None,
    }


def _mean_of(data: dict, feature: str, site: str) -> float | None:
    """A site's mean of a training-split feature: its sum over its count (None: withheld)."""
    n, total = _get(data, feature, "count", site, "train"), _get(data, feature, "sum", site, "train")
    return None if not n or total is None else float(total) / float(n)


def _int(v):
    return None if v is None else int(round(float(v)))


def summarise(data: dict, classes: list[str]) -> dict:
    """Per site, per split: images, patients and each class's counts; sizes and intensity histograms of the
    training images; the pooled counts (released ones summed, with the sites that withheld)."""
    sites = sites_of(data)
    per_site: dict = {}
    for site in sites:
        entry: dict = {"splits": {}}
        for split in SPLITS:
            images = _int(_get(data, "images", "count", site, split))
            patients = _int(_get(data, "patients", "count", site, split))
            cls = {
                c: class_entry(
                    _int(_get(data, class_feature("pos", j), "count", site, split)),
                    _int(_get(data, class_feature("neg", j), "count", site, split)),
                    images,
                )
                for j, c in enumerate(classes)
            }
            entry["splits"][split] = {"images": images, "patients": patients, "classes": cls}
        entry["size"] = {
            k: {"mean": _mean_of(data, k, site), "stddev": _get(data, k, "stddev", site, "train")}
            for k in ("width", "height", "aspect")
        }
        entry["intensity"] = {
            ch[len(INTENSITY) :]: {
                "mean": _mean_of(data, ch, site),
                "stddev": _get(data, ch, "stddev", site, "train"),
                "histogram": _bins(_get(data, ch, "histogram", site, "train")),
            }
            for ch in channels_of(data)
        }
        per_site[site] = entry
    pooled: dict = {}
    for split in SPLITS:
        row: dict = {"images": _pool([per_site[s]["splits"][split]["images"] for s in sites], sites)}
        row["patients"] = _pool([per_site[s]["splits"][split]["patients"] for s in sites], sites)
        row["classes"] = {
            c: {
                k: _pool([per_site[s]["splits"][split]["classes"][c][k] for s in sites], sites)
                for k in ("positives", "negatives")
            }
            for c in classes
        }
        pooled[split] = row
    pooled["intensity"] = {
        ch[len(INTENSITY) :]: _bins(_get(data, ch, "histogram", GLOBAL, "train")) for ch in channels_of(data)
    }
    return {"sites": sites, "classes": list(classes), "per_site": per_site, "pooled": pooled}


def _pool(values: list, sites: list[str]) -> dict:
    """``{"released": sum of the released values, "withheld": [sites that withheld theirs]}``."""
    return {
        "released": int(sum(v for v in values if v is not None)),
        "withheld": [s for s, v in zip(sites, values) if v is None],
    }


def withheld_counts(summary: dict) -> list[dict]:
    """Every count a site withheld: ``{"site", "split", "what"}`` (``images``, ``patients``, ``<class>
    positives`` / ``negatives``)."""
    out = []
    for site, entry in summary["per_site"].items():
        for split, row in entry["splits"].items():
            out += [{"site": site, "split": split, "what": k} for k in ("images", "patients") if row[k] is None]
            for c, e in row["classes"].items():
                out += [
                    {"site": site, "split": split, "what": f"{c} {k}"}
                    for k in ("positives", "negatives")
                    if e[k] is None
                ]
    return out


def js_divergence(p, q) -> float:
    """Jensen-Shannon divergence (base 2, in [0, 1]) of two histograms (normalised here): the square of SciPy's
    Jensen-Shannon distance."""
    from scipy.spatial.distance import jensenshannon

    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return float("nan")
    return float(jensenshannon(p, q, base=2) ** 2)


def intensity_divergences(summary: dict) -> dict[str, dict[str, float]]:
    """Per site and channel, the JS divergence of the site's training-image histogram from the most similar other
    site's (only sites whose histogram was released, on the bins NVFlare agreed for all): large when the site's
    intensities differ from every other site's; one deviant site does not make the others look deviant (as a
    comparison with the pool of the others, which holds the deviant site, would)."""
    out: dict = {}
    per_site = summary["per_site"]
    channels = sorted({ch for s in per_site.values() for ch in s["intensity"]})
    for ch in channels:
        hists = {
            s: np.array([b[2] for b in v["intensity"][ch]["histogram"]])
            for s, v in per_site.items()
            if ch in v["intensity"] and v["intensity"][ch]["histogram"]
        }
        if len(hists) < 2 or len({h.size for h in hists.values()}) != 1:
            continue
        for s, h in hists.items():
            nearest = min(js_divergence(h, o) for t, o in hists.items() if t != s)
            out.setdefault(s, {})[ch] = round(nearest, 4)
    return out


def warnings_of(summary: dict, thresholds: dict | None = None, min_count: int = 5) -> list[dict]:
    """The report's warnings (the module docstring), each ``{"kind", "message", ...}``."""
    t = {**THRESHOLDS, **(thresholds or {})}
    out: list[dict] = []
    sites, per_site = summary["sites"], summary["per_site"]
    for c in summary["classes"]:
        entries = {s: per_site[s]["splits"]["train"]["classes"][c] for s in sites}
        annotating = [s for s, e in entries.items() if e["status"] != "not annotated"]
        if not annotating and sites:
            out.append(
                {
                    "kind": "unannotated_class",
                    "class": c,
                    "message": f"class '{c}' is annotated by no site: a training job stops at its data check",
                }
            )
        if len(annotating) == 1 and len(sites) > 1:
            out.append(
                {
                    "kind": "single_site_class",
                    "class": c,
                    "site": annotating[0],
                    "message": f"class '{c}' is annotated by one site only ({annotating[0]})",
                }
            )
        known = sum(e["positives"] or 0 for e in entries.values())
        withheld = [s for s, e in entries.items() if e["status"] != "not annotated" and e["positives"] is None]
        upper = known + len(withheld) * (min_count - 1)
        if annotating and upper < t["min_positives"]:
            more = f" (+ fewer than {min_count} at each of {', '.join(withheld)})" if withheld else ""
            out.append(
                {
                    "kind": "few_positives",
                    "class": c,
                    "positives": known,
                    "message": f"class '{c}' has {known} annotated positive(s) in the federation{more}, "
                    f"fewer than {t['min_positives']}",
                }
            )
        prev = {s: e["prevalence"] for s, e in entries.items() if e["prevalence"] is not None}
        if len(prev) >= 2:
            hi_s, lo_s = max(prev, key=prev.get), min(prev, key=prev.get)
            hi, lo = prev[hi_s], prev[lo_s]
            ratio = math.inf if lo == 0 and hi > 0 else (hi / lo if lo > 0 else 1.0)
            if ratio > t["prevalence_ratio"]:
                out.append(
                    {
                        "kind": "prevalence",
                        "class": c,
                        "ratio": None if math.isinf(ratio) else round(ratio, 2),
                        "message": f"class '{c}': prevalence {hi:.1%} at {hi_s} vs {lo:.1%} at {lo_s} "
                        f"(factor {'inf' if math.isinf(ratio) else f'{ratio:.1f}'} > {t['prevalence_ratio']})",
                    }
                )
    for s, per_ch in intensity_divergences(summary).items():
        worst = max(per_ch, key=per_ch.get)
        if per_ch[worst] > t["intensity_js"]:
            out.append(
                {
                    "kind": "intensity",
                    "site": s,
                    "channel": worst,
                    "js": per_ch[worst],
                    "message": f"{s}'s intensities (channel {worst}) separate it from every other site: "
                    f"Jensen-Shannon divergence {per_ch[worst]:.3f} > {t['intensity_js']}",
                }
            )
    sizes = {
        s: per_site[s]["size"]
        for s in sites
        if per_site[s]["size"]["width"]["mean"] is not None and per_site[s]["size"]["width"]["stddev"] is not None
    }

    def fixed(sz):
        return sz["width"]["stddev"] == 0 and (sz["height"]["stddev"] or 0) == 0

    for s, sz in sizes.items():
        if not fixed(sz):
            continue
        dims = (sz["width"]["mean"], sz["height"]["mean"])
        others = [o for o in sizes if o != s]
        if any(not fixed(sizes[o]) or (sizes[o]["width"]["mean"], sizes[o]["height"]["mean"]) != dims for o in others):
            out.append(
                {
                    "kind": "one_size",
                    "site": s,
                    "size": [dims[0], dims[1]],
                    "message": f"every training image of {s} is {dims[0]:g} x {dims[1]:g} px, unlike the other sites'",
                }
            )
    return out


# ------------------------------------------------------------------------------------------------- writing


def _mean(v) -> str:
    return "withheld" if v is None else f"{v:.1f}"


def _n(v) -> str:
    return "withheld" if v is None else f"{v:,}"


def markdown(summary: dict, warnings: list[dict], thresholds: dict, min_count: int, divergences: dict) -> str:
    sites, classes, per_site, pooled = summary["sites"], summary["classes"], summary["per_site"], summary["pooled"]
    lines = [
        "# Data report: what each site holds",
        "",
        f"{len(sites)} site(s), {len(classes)} class(es); counts from NVFlare's federated statistics. A site "
        f"withholds any count from 1 to {min_count - 1} (its privacy policy's minimum count, at least the job's "
        f"{min_count}): shown as *withheld*.",
        "",
        "## Warnings",
        "",
    ]
    lines += [f"- **{w['kind']}**: {w['message']}" for w in warnings] or ["- none"]
    lines += [
        "",
        "Thresholds: "
        + ", ".join(f"`{k}` = {v}" for k, v in thresholds.items())
        + " (docs/deployment.md, `fedpartial.data_report`).",
        "",
        "## Label availability (training split: positives / negatives; `-` not annotated)",
        "",
        "| site | " + " | ".join(classes) + " |",
        "|---|" + "---|" * len(classes),
    ]
    for s in sites:
        cells = []
        for c in classes:
            e = per_site[s]["splits"]["train"]["classes"][c]
            if e["status"] == "not annotated":
                cells.append("-")
            else:
                cells.append(f"{_n(e['positives'])} / {_n(e['negatives'])}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    tr = pooled["train"]["classes"]
    lines.append(
        "| **pooled** | "
        + " | ".join(f"{tr[c]['positives']['released']:,} / {tr[c]['negatives']['released']:,}" for c in classes)
        + " |"
    )
    lines += ["", "## Prevalence among annotated training images", "", "| site | " + " | ".join(classes) + " |"]
    lines.append("|---|" + "---|" * len(classes))
    for s in sites:
        cells = []
        for c in classes:
            e = per_site[s]["splits"]["train"]["classes"][c]
            cells.append(
                "-"
                if e["status"] == "not annotated"
                else ("withheld" if e["prevalence"] is None else f"{e['prevalence']:.1%}")
            )
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "## Images, patients and unlabelled images per split", ""]
    lines += [
        "| site | " + " | ".join(f"{sp} images | {sp} patients" for sp in SPLITS) + " | train unlabelled (per class) |"
    ]
    lines.append("|---|" + "---|" * (2 * len(SPLITS) + 1))
    for s in sites:
        sp = per_site[s]["splits"]
        unl = ", ".join(
            f"{c}: {_n(sp['train']['classes'][c]['unlabelled'])}"
            for c in classes
            if sp["train"]["classes"][c]["status"] != "not annotated"
        )
        lines.append(
            f"| {s} | "
            + " | ".join(f"{_n(sp[x]['images'])} | {_n(sp[x]['patients'])}" for x in SPLITS)
            + f" | {unl or 'all (no class annotated)'} |"
        )
    lines.append(
        "| **pooled** | "
        + " | ".join(f"{pooled[x]['images']['released']:,} | {pooled[x]['patients']['released']:,}" for x in SPLITS)
        + " | |"
    )
    lines += [
        "",
        "The simulator's sites share one validation and one test set: their pooled val / test rows count it once "
        "per site.",
        "",
        "## Training images: size and intensity after decoding",
        "",
        "| site | width (mean, sd) | height (mean, sd) | aspect (mean) | intensity mean per channel | JS divergence "
        "from the nearest site |",
        "|---|---|---|---|---|---|",
    ]
    for s in sites:
        sz, it = per_site[s]["size"], per_site[s]["intensity"]

        def ms(d):
            return "withheld" if d["mean"] is None else f"{d['mean']:.0f}, {d['stddev'] or 0:.0f}"

        means = ", ".join(f"{ch}: {_mean(v['mean'])}" for ch, v in it.items())
        js = ", ".join(f"{ch}: {v:.3f}" for ch, v in divergences.get(s, {}).items()) or "-"
        aspect = sz["aspect"]["mean"]
        lines.append(
            f"| {s} | {ms(sz['width'])} | {ms(sz['height'])} | {'withheld' if aspect is None else f'{aspect:.2f}'} | "
            f"{means or '-'} | {js} |"
        )
    lines += ["", f"![intensity histograms per site]({FIGURE})", ""]
    withheld = withheld_counts(summary)
    lines += ["## Withheld by the sites' minimum count", ""]
    lines += [f"- {w['site']}, {w['split']}: {w['what']}" for w in withheld] or ["- nothing"]
    lines.append("")
    return "\n".join(lines)


def intensity_figure(summary: dict, path: Path) -> str | None:
    """Each site's training-image intensity histogram (normalised), overlaid, one panel per channel."""
    per_site = summary["per_site"]
    channels = sorted({ch for s in per_site.values() for ch in s["intensity"]})
    if not channels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .tables import save_figure  # imported where used: a figure loads matplotlib

    fig, axes = plt.subplots(1, len(channels), figsize=(4.2 * len(channels), 3.2), squeeze=False)
    for ax, ch in zip(axes[0], channels):
        for s, v in per_site.items():
            bins = v["intensity"].get(ch, {}).get("histogram") or []
            if not bins:
                continue
            counts = np.array([b[2] for b in bins], dtype=float)
            centres = np.array([(b[0] + b[1]) / 2 for b in bins])
            if counts.sum() > 0:
                ax.step(centres, counts / counts.sum(), where="mid", label=s)
        ax.set_title(f"channel {ch}")
        ax.set_xlim(0, 255)  # the agreed range is noised beyond the values
        ax.set_xlabel("intensity after decoding (0-255)")
        ax.set_ylabel("share of pixels")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out


def write_report(
    data: dict, classes: list[str], folder: Path, thresholds: dict | None = None, min_count: int = 5
) -> dict[str, str]:
    """Write ``data_report.md``, ``data_report.json`` and the intensity figure into ``folder``; their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    t = {**THRESHOLDS, **(thresholds or {})}
    summary = summarise(data, classes)
    warnings = warnings_of(summary, t, min_count)
    div = intensity_divergences(summary)
    result = {
        **summary,
        "warnings": warnings,
        "thresholds": t,
        "min_count": min_count,
        "intensity_js": div,
        "withheld": withheld_counts(summary),
    }
    (folder / REPORT_JSON).write_text(json.dumps(result, indent=1))
    (folder / REPORT_MD).write_text(markdown(summary, warnings, t, min_count, div))
    fig = intensity_figure(summary, folder / FIGURE)
    return {"md": str(folder / REPORT_MD), "json": str(folder / REPORT_JSON), "figure": fig or ""}
