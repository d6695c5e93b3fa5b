"""Server-side cost of one round: the NVFlare aggregator against a plain in-memory weighted mean, same tensors.

    python benchmarks/aggregation_speed.py --out benchmarks/results/aggregation_speed.json

``--sites`` (default 8) updates of a ResNet-18 (MONAI, stride-2 stem, 5 classes, about 11.2 M parameters) are made
once as numpy arrays, as the server receives them (the previous global model plus small random changes). Timed,
median of ``--repeats``:

- ``plain``: the least a weighted mean of those arrays can cost: ``sum_k n_k w_k / sum_k n_k`` per tensor, numpy,
  float32.
- ``aggregator <method>``: :class:`fedpartial.fl.aggregator.PartialLabelAggregator` as NVFlare drives it: one
  ``accept`` per update (DXO unpacking, the round / kind / structure checks, the sample-count checks) and one
  ``aggregate`` (one blocked read of the round's updates for their values, change norms and direction, the bound,
  the method's rule, the step and the check of the result, the outgoing DXO), for ``fedavg``, ``fedavg_masked`` and
  ``surgical``. One aggregator object serves all the rounds of a row, as in a job (from the second round on it
  holds a last global step, so the direction check runs).

Also reported: the same aggregator with the change bound off (``max_change_ratio: 0``), which isolates the cost
of that robustness check. Target: the aggregator within 2x of the plain mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from nvflare.apis.dxo import DXO, DataKind  # noqa: E402
from nvflare.apis.fl_constant import ReservedKey  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.app_common.abstract.model import ModelLearnableKey  # noqa: E402
from nvflare.app_common.app_constant import AppConstants  # noqa: E402

from fedpartial.fl.aggregator import PartialLabelAggregator  # noqa: E402
from fedpartial.fl.keys import META_GROUPS, META_N_TRAIN, META_WEIGHT  # noqa: E402
from fedpartial.models import build_model  # noqa: E402


class _Engine:
    """The two engine calls the aggregator makes (no data summary: the sample-count check against it is skipped)."""

    def get_component(self, _cid):
        return None

    def get_clients(self):
        return []


def make_updates(num_sites: int, num_classes: int, seed: int = 0):
    """``(previous, updates, groups, annotated)``: float32 numpy state dicts of a ResNet-18."""
    net = build_model({"arch": "resnet18", "in_channels": 3}, num_classes)
    previous = {k: v.detach().cpu().numpy().copy() for k, v in net.state_dict().items()}
    rng = np.random.default_rng(seed)
    updates = []
    for _ in range(num_sites):
        upd = {}
        for k, v in previous.items():
            if np.issubdtype(v.dtype, np.floating):
                upd[k] = v + rng.normal(0, 1e-3, v.shape).astype(v.dtype)
            else:
                upd[k] = v.copy()
        updates.append(upd)
    annotated = [[(c + k) % 2 == 0 or c == k % num_classes for c in range(num_classes)] for k in range(num_sites)]
    return previous, updates, net.parameter_groups(), annotated


def plain_mean(updates: list[dict], n: list[float]) -> dict:
    total = float(sum(n))
    out = {}
    for key in updates[0]:
        acc = np.zeros_like(updates[0][key], dtype=np.float32)
        for u, nk in zip(updates, n):
            acc += u[key] * np.float32(nk / total)
        out[key] = acc
    return out


def one_round(agg: PartialLabelAggregator, previous, updates, groups, annotated, n) -> None:
    """One round through ``agg``: the same aggregator object serves every round, as in an NVFlare job."""
    fl_ctx = FLContext()
    fl_ctx.set_prop(ReservedKey.ENGINE, _Engine(), private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, {ModelLearnableKey.WEIGHTS: previous}, private=True, sticky=False)
    fl_ctx.set_prop(AppConstants.CURRENT_ROUND, 3, private=True, sticky=False)
    for k, (upd, nk) in enumerate(zip(updates, n)):
        peer = FLContext()
        peer.set_prop(ReservedKey.IDENTITY_NAME, f"site-{k + 1}", private=True, sticky=False)
        fl_ctx.set_peer_context(peer)
        meta = {META_N_TRAIN: nk, META_WEIGHT: 1.0, META_GROUPS: groups, "annotated": annotated[k]}
        if not agg.accept(DXO(DataKind.WEIGHTS, upd, meta).to_shareable(), fl_ctx):
            raise RuntimeError(f"{agg.method}: update {k} refused: {agg.rejected}")
    agg.aggregate(fl_ctx)


def timed(fns: dict, repeats: int) -> tuple[dict, dict]:
    """``({name: median wall seconds}, {name: median CPU seconds of this process})`` of each function, run in turns
    (one call of each per repeat, after one warm-up call each), so that whatever else the machine does at the time
    weighs on every row alike and the ratios hold on a busy machine too."""
    for fn in fns.values():
        fn()
    wall: dict = {k: [] for k in fns}
    cpu: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return {k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sites", type=int, default=8)
    ap.add_argument("--classes", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    previous, updates, groups, annotated = make_updates(args.sites, args.classes)
    n = [float(100 + 10 * k) for k in range(args.sites)]
    params = int(sum(v.size for v in previous.values()))
    fns = {"plain weighted mean (numpy)": lambda: plain_mean(updates, n)}
    aggregators = {f"aggregator {m}": PartialLabelAggregator(m) for m in ("fedavg", "fedavg_masked", "surgical")}
    aggregators["aggregator fedavg, change bound off"] = PartialLabelAggregator("fedavg", max_change_ratio=0.0)
    for name, agg in aggregators.items():
        fns[name] = lambda a=agg: one_round(a, previous, updates, groups, annotated, n)
    rows, cpu = timed(fns, args.repeats)
    base, cpu_base = rows["plain weighted mean (numpy)"], cpu["plain weighted mean (numpy)"]
    result = {
        "sites": args.sites,
        "parameters": params,
        "tensors": len(previous),
        "repeats": args.repeats,
        "seconds": rows,
        "ratio": {k: v / base for k, v in rows.items()},
        "cpu_seconds": cpu,
        "cpu_ratio": {k: v / cpu_base for k, v in cpu.items()},
    }
    lines = [
        f"{args.sites} ResNet-18 updates ({params / 1e6:.1f} M values in {len(previous)} tensors), median of "
        f"{args.repeats} taken in turns; wall and CPU time of this process",
        "",
        "| what | s / round | x plain mean | CPU s / round | x plain mean (CPU) |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {k} | {v:.3f} | {v / base:.2f} | {cpu[k]:.3f} | {cpu[k] / cpu_base:.2f} |" for k, v in rows.items()]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
