"""What must be the same at the server and every site: the method, its resolved options and the model's
architecture. The server sends its spec with the data-check task; a site whose own job configuration differs
fails the data check with a message naming the difference (see ``DataSummaryProcessor``)."""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict

from ..methods import get_method
from ..models import ARCH_OPTIONS, PartialLabelNet
from ..options import build

_MODEL_DEFAULTS = {
    k: p.default
    for k, p in inspect.signature(PartialLabelNet).parameters.items()
    if p.default is not inspect.Parameter.empty
}


def resolved_options(method: str, method_args: dict | None) -> dict:
    """Every option of the method's trainer and rule with its value (defaults filled in)."""
    m = get_method(method)
    t, r = m.split_options(method_args)
    return {**asdict(build(m.trainer.Options, t, method)), **asdict(build(m.rule.Options, r, method))}


def model_arch(model: dict) -> dict:
    """The architecture-defining model options, defaults filled in."""
    return {k: model.get(k, _MODEL_DEFAULTS.get(k)) for k in ARCH_OPTIONS}


def job_spec(method: str, method_args: dict | None, model: dict) -> dict:
    return {
        "method": method,
        "options": json.loads(json.dumps(resolved_options(method, method_args))),
        "model": model_arch(model),
    }


def spec_mismatch(server: dict, site: dict) -> str | None:
    """How a site's spec differs from the server's, or None."""
    if server.get("method") != site.get("method"):
        return f"the server runs method {server.get('method')!r}, this site {site.get('method')!r}"
    for part in ("options", "model"):
        a, b = server.get(part) or {}, site.get(part) or {}
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if diff:
            return f"{'method options' if part == 'options' else 'model'} differ: " + ", ".join(
                f"{k} = {a.get(k)!r} at the server, {b.get(k)!r} here" for k in diff
            )
    return None


def local_parts(method: str, method_args: dict | None) -> list[str]:
    """Parameter groups each site keeps local under the method's options (``norm: local``, ``keep_local``)."""
    if get_method(method).trainer.keeps_all_local:
        return ["encoder", "norm", "head", "classifier"]
    o = resolved_options(method, method_args)
    return (["norm"] if o.get("norm") == "local" else []) + list(o.get("keep_local") or [])


def global_model_note(parts: list[str]) -> str | None:
    """What the global model holds when parts stay local (None when nothing does)."""
    if not parts:
        return None
    if {"encoder", "norm", "head", "classifier"} <= set(parts):
        return (
            "every site keeps its whole model (individually trained): the global model is only the sites' "
            "average, used by nobody during training; every site's validation and test metrics (per round and "
            "cross-site) are its own model's"
        )
    p = " and ".join(parts)
    return (
        f"the sites keep their own {p} layers: the global model holds the shared layers plus the sites' average "
        f"of the {p} layers; every site's validation and test metrics (per round and cross-site) use its own "
        f"{p} layers, while a prediction with the global model on data of no site uses the averaged ones"
    )
