"""Site privacy policies with NVFlare's mechanism (``local/privacy.json``), and what the site's policy does.

A site's ``local/privacy.json`` lists scopes; a job names one in ``meta.json`` (``"scope"``,
:func:`set_privacy_scope`), a job that names none gets the site's ``default_scope``, and a job naming a scope the
site does not define is refused at deployment ("privacy scope ... is not allowed"). NVFlare applies the scope's
task-result filters at the site before the job's own and hands the scope's ``properties`` to the job (FL
context ``SCOPE_PROPERTIES``). The sample policy (``provisioning/privacy.json``, docs/privacy.md) has:

- ``standard``: ``min_count`` 5, score histograms sent (the server chooses the operating thresholds on them).
- ``strict``: ``min_count`` 20, no score histograms (each site chooses its thresholds on its own validation
  data), and the Gaussian mechanism on every per-class statistic (``epsilon``, ``delta`` per job;
  ``feature_clip``: the per-image L2 bound before a per-class mean).

Properties (all optional): ``min_count`` (int), ``score_histograms`` (bool), ``epsilon`` / ``delta`` (the
per-job budget; no ``epsilon``: no noise), ``feature_clip`` (float).

Both sides of the site read the same properties: the executor (minimum count of what it reports, per-image
clipping in the trainer, histograms and local thresholds; a method whose statistics cannot be noised stops at
the data check) and :class:`SitePrivacyFilter`, the scope's task-result filter (minimum count again, the noise,
the privacy ledger entry of the round). The server composes the ledger into ``results.json``
(:func:`ledger_totals`). The filter and the provisioning builder are loaded by NVFlare when the site starts:
the site needs ``fedpartial`` (and ``dp-accounting``) installed, not only shipped with a job.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from ..privacy import DEFAULT_MIN_COUNT, epsilon_spent, from_dicts, noise_multiplier, release, suppress_small
from .keys import META_N_TRAIN, META_PRIVACY, META_RESULTS, META_SUMMARY

POLICY_FILE = Path(__file__).with_name("privacy_policy.json")  # the sample policy (provisioning/privacy.json)
PROPERTY_KEYS = ("min_count", "score_histograms", "epsilon", "delta", "feature_clip")


def scope_of(fl_ctx: FLContext) -> tuple[str, dict]:
    """``(effective scope name, its properties)`` of the running job at this site (``("", {})`` without a
    policy, e.g. in the simulator)."""
    props = fl_ctx.get_prop(FLContextKey.SCOPE_PROPERTIES) or {}
    name = fl_ctx.get_prop(FLContextKey.EFFECTIVE_JOB_SCOPE_NAME) or ""
    return str(name), check_properties(dict(props), name)


def job_or_site_policy(fl_ctx: FLContext, job_props: dict | None) -> tuple[str, dict, bool]:
    """``(scope name, properties, applied by the executor)``: the site's policy when it has one (NVFlare applies
    its filters), else the job's own ``privacy`` properties under the name ``"job"`` (the simulator, which loads
    no site policy: the executor applies them itself), else nothing."""
    scope, props = scope_of(fl_ctx)
    if scope or props or not job_props:
        return scope, props, False
    return "job", check_properties(dict(job_props), "job"), True


def check_properties(props: dict, scope: str = "") -> dict:
    """The privacy properties of a scope, checked (a bad value names the scope and the key)."""
    where = f"privacy scope '{scope}'" if scope else "privacy properties"
    mc = props.get("min_count", DEFAULT_MIN_COUNT)
    if not isinstance(mc, int) or mc < 1:
        raise ValueError(f"{where}: min_count must be an integer >= 1, got {mc!r}")
    if "epsilon" in props:
        eps, delta = props.get("epsilon"), props.get("delta")
        if not (isinstance(eps, (int, float)) and eps > 0 and isinstance(delta, (int, float)) and 0 < delta < 1):
            raise ValueError(f"{where}: epsilon must be > 0 and delta in (0, 1), got ({eps!r}, {delta!r})")
    fc = props.get("feature_clip")
    if fc is not None and not (isinstance(fc, (int, float)) and fc > 0):
        raise ValueError(f"{where}: feature_clip must be > 0, got {fc!r}")
    return props


def effective_min_count(job_min_count: int, props: dict) -> int:
    """The stricter of the job's and the site's minimum count."""
    return max(int(job_min_count), int(props.get("min_count", 1)))


def check_method_under_policy(stats, props: dict, method: str, site: str, scope: str) -> None:
    """Raise ``ValueError`` (a clear line for the data check) when the site's policy asks for noise and the
    method sends a per-class statistic that cannot be noised (not clipped per image), or needs a bound the
    policy does not give."""
    if "epsilon" not in props:
        return
    blocked = [s.key for s in stats if not s.dp]
    if blocked:
        raise ValueError(
            f"site '{site}': its privacy scope '{scope}' releases per-class statistics only with "
            f"differential privacy, and method '{method}' sends {blocked}, which it does not clip per "
            "image: this method cannot run under this site's policy (run it with another scope, or "
            "leave this site out)"
        )
    if any(s.kind == "mean" for s in stats) and not props.get("feature_clip"):
        raise ValueError(
            f"site '{site}': privacy scope '{scope}' sets epsilon but no feature_clip, which method "
            f"'{method}' needs for its per-class means"
        )


class SitePrivacyFilter(Filter):
    """The site's task-result filter (put it in every scope of ``local/privacy.json``): applies the scope's
    properties to everything the site sends.

    - ``data_summary`` answers: annotated positives / negatives below ``min_count`` become 0.
    - results of a model (``train`` / ``validate``): no score histograms when ``score_histograms`` is false.
    - ``train`` updates: the method's declared per-class statistics (the ledger entry the executor attaches)
      get the minimum count and, with ``epsilon``, the Gaussian mechanism with the job's noise multiplier; the
      round's ledger entry records what left, with what noise.

    Args:
        seed: seed of the noise (tests only; by default fresh entropy from the operating system).

    The same rules run in the executor when a job brings its own privacy properties and the site has no
    policy (the simulator: :func:`job_or_site_policy`).
    """

    def __init__(self, seed: int | None = None):
        super().__init__()
        self.seed = seed
        self._z: dict[tuple, float] = {}

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        """Every task result of the site (a reply without a DXO, e.g. an error, passes as it is)."""
        try:
            dxo = from_shareable(shareable)
        except Exception:  # noqa: BLE001 - not a DXO: nothing of ours in it
            return shareable
        return self.process_dxo(dxo, shareable, fl_ctx).update_shareable(shareable)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        scope, props = scope_of(fl_ctx)
        meta = dict(dxo.meta or {})
        new, dropped = apply_policy(meta, props, scope, fl_ctx.get_identity_name(), self._z, self.seed)
        for k, v in new.items():
            if k not in meta or v is not meta[k]:
                dxo.set_meta_prop(k, v)
        if dropped:
            self.log_info(
                fl_ctx,
                f"privacy scope '{scope}': min_count {props.get('min_count', DEFAULT_MIN_COUNT)}: "
                f"not sent: {', '.join(dropped)}",
            )
        return dxo


def apply_policy(
    meta: dict, props: dict, scope: str, site: str, z_cache: dict | None = None, seed: int | None = None
) -> tuple[dict, list[str]]:
    """What the privacy ``props`` let leave the site of one task result's metadata (see
    :class:`SitePrivacyFilter`). Returns ``(new meta, rows dropped for the minimum count)``; ``meta`` is not
    modified. ``z_cache`` keeps the calibrated noise multipliers; ``seed`` seeds the noise (tests only)."""
    z_cache = {} if z_cache is None else z_cache
    out = dict(meta)
    min_count = int(props.get("min_count", DEFAULT_MIN_COUNT))
    if META_SUMMARY in meta:
        out[META_SUMMARY] = suppress_summary(meta[META_SUMMARY], min_count)
    if META_RESULTS in meta and not props.get("score_histograms", True):
        out[META_RESULTS] = without_histograms(meta[META_RESULTS])
    entry = meta.get(META_PRIVACY)
    if not entry or entry.get("budget"):  # nothing declared, or released under this policy already
        return out, []
    stats = from_dicts(entry.get("declared"))
    # without noise the rows are thresholded on their counts; with noise only after it (on the noised counts),
    # so that the decision itself is covered by the mechanism
    new, dropped = suppress_small(out, stats, min_count) if "epsilon" not in props else (out, [])
    entry = copy.deepcopy(entry)
    entry["scope"], entry["min_count"] = scope, max(int(entry.get("min_count", 1)), min_count)
    if "epsilon" in props:
        rounds = int(entry.get("num_rounds") or 1)
        key = (float(props["epsilon"]), float(props["delta"]), rounds, len([s for s in stats if s.dp]))
        if key not in z_cache:
            z_cache[key] = noise_multiplier(*key)
        rng = np.random.default_rng(None if seed is None else [seed, int(entry.get("round", 0))])
        try:
            new, released = release(
                new,
                stats,
                z_cache[key],
                int(meta.get(META_N_TRAIN, 0)),
                entry["min_count"],
                props.get("feature_clip"),
                rng,
            )
        except ValueError as e:
            raise RuntimeError(f"site '{site}', privacy scope '{scope}': {e}") from None
        entry["released"] = released
        entry["budget"] = {"epsilon": float(props["epsilon"]), "delta": float(props["delta"]), "planned_rounds": rounds}
    else:
        entry["released"] = [{**item, "min_count": entry["min_count"]} for item in entry.get("released", [])]
    new[META_PRIVACY] = entry
    return new, dropped


def suppress_summary(info: dict, min_count: int) -> dict:
    """A site's data-check answer with annotated positives / negatives in ``(0, min_count)`` reported as 0."""
    out = dict(info)
    for key in ("positives", "negatives"):
        if key in info:
            v = np.asarray(info[key], dtype=np.int64)
            out[key] = np.where((v > 0) & (v < min_count), 0, v).tolist()
    out["min_count"] = max(int(info.get("min_count", 1)), int(min_count))
    return out


def without_histograms(results: dict) -> dict:
    """Model results (``{split: result}``) without score histograms."""
    return {
        split: ({k: v for k, v in r.items() if k != "score_hist"} if isinstance(r, dict) else r)
        for split, r in (results or {}).items()
    }


# ------------------------------------------------------------------------------------------ ledger
def ledger_totals(rounds: list[dict]) -> dict:
    """Per site: statistics released, rounds with a release, and the epsilon spent (at the site's delta),
    composed by the accountant over every noised release recorded in ``rounds[i].privacy[site]``; ``None``
    (no formal guarantee) when a statistic left without noise."""
    per_site: dict[str, dict] = {}
    for r in rounds:
        for site, entry in (r.get("privacy") or {}).items():
            t = per_site.setdefault(
                site,
                {
                    "releases": 0,
                    "rounds": 0,
                    "multipliers": [],
                    "delta": None,
                    "scope": entry.get("scope", ""),
                    "min_count": entry.get("min_count"),
                },
            )
            rel = entry.get("released") or []
            t["releases"] += len(rel)
            t["rounds"] += bool(rel)
            t["multipliers"] += [float(x.get("noise_multiplier", 0.0)) for x in rel]
            if entry.get("budget"):
                t["delta"], t["budget"] = entry["budget"]["delta"], entry["budget"]
    out = {}
    for site, t in sorted(per_site.items()):
        zs = t.pop("multipliers")
        eps = epsilon_spent(zs, t["delta"]) if t["delta"] else (0.0 if not zs else math.inf)
        out[site] = {**t, "epsilon": None if math.isinf(eps) else eps}
    return out


def add_cumulative_epsilon(rounds: list[dict]) -> None:
    """Set ``cumulative_epsilon`` in every ledger entry of ``rounds`` (in place): the epsilon the site has spent
    after that round (None: a statistic left without noise)."""
    released: dict[str, list[float]] = {}
    for r in rounds:
        for site, entry in (r.get("privacy") or {}).items():
            zs = released.setdefault(site, [])
            zs += [float(x.get("noise_multiplier", 0.0)) for x in entry.get("released") or []]
            delta = (entry.get("budget") or {}).get("delta")
            eps = epsilon_spent(zs, delta) if delta else (0.0 if not zs else math.inf)
            entry["cumulative_epsilon"] = None if math.isinf(eps) else eps


# ------------------------------------------------------------------------------------------ jobs and kits
def set_privacy_scope(job_or_recipe, scope: str) -> None:
    """Name the site privacy scope a job runs under: a job folder (its ``meta.json`` gets ``"scope"``) or an
    NVFlare recipe (``nvflare.recipe.utils.set_recipe_meta``)."""
    if not isinstance(scope, str) or not scope:
        raise ValueError(f"privacy scope must be a non-empty string, got {scope!r}")
    if isinstance(job_or_recipe, (str, Path)):
        meta_file = Path(job_or_recipe) / "meta.json"
        meta = json.loads(meta_file.read_text())
        meta["scope"] = scope
        meta_file.write_text(json.dumps(meta, indent=2) + "\n")
        return
    from nvflare.apis.job_def import JobMetaKey
    from nvflare.recipe.utils import set_recipe_meta

    set_recipe_meta(job_or_recipe, JobMetaKey.SCOPE, scope)


def site_policy(strict: bool = False, policy: dict | None = None) -> dict:
    """A site's ``privacy.json``: the sample policy, or (``strict``) every scope carrying the ``strict`` scope's
    properties and filters, so that whatever scope a job names, this site applies its strict policy."""
    pol = copy.deepcopy(policy or json.loads(POLICY_FILE.read_text()))
    if strict:
        strict_scope = next(s for s in pol["scopes"] if s["name"] == "strict")
        pol["scopes"] = [{**copy.deepcopy(strict_scope), "name": s["name"]} for s in pol["scopes"]]
    return pol


try:  # the provisioning builder (nvflare provision loads it from project.yml)
    from nvflare.lighter.spec import Builder
except ImportError:  # pragma: no cover
    Builder = object


class PrivacyPolicyBuilder(Builder):
    """Provisioning builder: writes ``local/privacy.json`` into every client kit (the sample policy, or the
    file ``policy_file``); the sites listed in ``strict_sites`` get every scope mapped to ``strict``
    (:func:`site_policy`).

    Args:
        policy_file: a privacy.json to use instead of the sample (path as given, relative to the working folder).
        strict_sites: client names that apply the strict policy to every job.
    """

    def __init__(self, policy_file: str | None = None, strict_sites: list[str] | None = None):
        self.policy_file = policy_file
        self.strict_sites = list(strict_sites or [])

    def build(self, project, ctx) -> None:
        policy = json.loads(Path(self.policy_file).read_text()) if self.policy_file else None
        names = [c.name for c in project.get_clients()]
        unknown = sorted(set(self.strict_sites) - set(names))
        if unknown:
            raise ValueError(f"PrivacyPolicyBuilder: strict_sites {unknown} are not clients of the project {names}")
        for client in project.get_clients():
            dest = Path(ctx.get_local_dir(client)) / "privacy.json"
            dest.write_text(json.dumps(site_policy(client.name in self.strict_sites, policy), indent=2) + "\n")
