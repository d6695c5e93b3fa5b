"""Speed of one local round at a real HAM10000 site, as ratios against a bare PyTorch loop in the same run.

    python benchmarks/local_round_speed.py --out benchmarks/results/local_round_speed.json

What is timed (one process, ``torch.set_num_threads(1)`` like a simulated site, median of ``--repeats``):

- ``views``: the weak + strong views of one cached 64 px image (MONAI dictionary transforms), with MONAI's
  ``MetaTensor`` bookkeeping (its default) and inside :func:`fedpartial.data.transforms.plain_tensors` (what
  ``train.views: per_sample`` uses), and drawn per batch of 32 (:mod:`fedpartial.data.batch_views`, the
  default): ms per sample.
- ``bare``: the reference. ``--steps`` Adam steps of plain cross-entropy on batches of the site's cached
  tensors (no augmentation, no evaluation, no method): the least a local round of that size can cost.
- ``fedavg``, ``fedavg_masked``, ``fedlsm`` (and any ``--methods``): ``train_round`` of the method's
  :class:`~fedpartial.methods.base.LocalTrainer` with the same model, batch size and steps, with the views drawn
  per batch (default) and per sample (``--views``). FedLSM also scores
  every local image with the received model (uncertainty estimation), runs an EMA teacher on the weak views and
  mixes ``n_mix`` extra samples into each batch, which the ratio shows.

The data come from ``../shared/data/ham10000`` (``--root``); the script stops with a clear message when absent.
``--preset ich_phantom`` times a site of the generated ICH phantom instead (multi-label: the bare loop uses BCE),
where ``fedmlp`` runs: every timed round is a stage-2 round (received prototypes, tagging pass, consistency to
the received model, prototype pass).

Every model, the bare loop's included, is in channels-last layout as the executor lays it out
(``train.channels_last``); ``--no-channels-last`` times the contiguous layout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from fedpartial.data.batch_views import BatchAugment  # noqa: E402
from fedpartial.data.manifest import read_manifest  # noqa: E402
from fedpartial.data.presets import resolve_dataset  # noqa: E402
from fedpartial.data.site_config import resolve_site_data  # noqa: E402
from fedpartial.data.sitedata import SiteDatasets  # noqa: E402
from fedpartial.data.transforms import plain_tensors, view_transforms  # noqa: E402
from fedpartial.methods import get_method  # noqa: E402
from fedpartial.methods.base import SiteContext  # noqa: E402
from fedpartial.models import build_model  # noqa: E402

METHOD_ARGS = {
    "fedlsm": {"n_mix": 2, "n_uncertain": 0.035, "n_confident": 0.14},
    "fedmlp": {"warmup_rounds": 0},
}  # every timed round in stage 2 (tagging, CR, prototypes)


def method_meta(name: str, num_classes: int, feature_dim: int) -> dict:
    """What the server would send with the model: FedMLP's global prototypes and learning degrees (random
    prototypes, degree 1: every timed round runs its whole stage 2); nothing for the other methods."""
    if name != "fedmlp":
        return {}
    from fedpartial.methods.fedmlp import META_GLOBAL_DEGREE, META_GLOBAL_P0, META_GLOBAL_P1, META_GLOBAL_VALID

    g = torch.Generator().manual_seed(0)
    return {
        META_GLOBAL_P0: torch.rand(num_classes, feature_dim, generator=g).numpy(),
        META_GLOBAL_P1: torch.rand(num_classes, feature_dim, generator=g).numpy(),
        META_GLOBAL_VALID: [[True, True]] * num_classes,
        META_GLOBAL_DEGREE: [1.0] * num_classes,
    }


def time_views(image: torch.Tensor, cfg: dict, n: int) -> dict[str, float]:
    """ms per sample of the weak + strong views, with and without MetaTensor tracking."""
    tf = view_transforms(
        {"weak": "weak", "strong": "strong"},
        int(cfg["image_size"]),
        cfg["mean"],
        cfg["std"],
        channels=int(cfg["channels"]),
    )
    out = {}
    for name, ctx in (("meta_tensor", nullcontext), ("plain_tensors", plain_tensors)):
        with ctx():
            for _pass in range(2):  # the first pass warms up
                t = time.perf_counter()
                for _ in range(n):
                    tf({"image": image.clone()})
        out[name] = (time.perf_counter() - t) / n * 1000.0
    aug, batch = BatchAugment(cfg["mean"], cfg["std"]), image.expand(32, *image.shape).clone()
    gen = torch.Generator().manual_seed(0)
    for _pass in range(2):
        t = time.perf_counter()
        for _ in range(max(1, n // 32)):
            aug(batch, "weak", gen), aug(batch, "strong", gen)
    out["batched"] = (time.perf_counter() - t) / (max(1, n // 32) * 32) * 1000.0
    return out


def bare_round(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, steps: int, batch: int, gen: torch.Generator
) -> None:
    """The reference: ``steps`` Adam steps of cross-entropy (class indices) or BCE (multi-label ``(N, C)``
    targets) on random batches of cached tensors."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    loss_fn = (
        torch.nn.functional.cross_entropy if labels.dim() == 1 else torch.nn.functional.binary_cross_entropy_with_logits
    )
    for _ in range(steps):
        idx = torch.randint(0, len(images), (batch,), generator=gen)
        loss = loss_fn(model(images[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--preset",
        default="ham10000",
        choices=["ham10000", "ich_phantom"],
        help="the site's data: real HAM10000 (single-label) or the ICH phantom (multi-label, generated; "
        "FedMLP runs only there)",
    )
    ap.add_argument("--root", default=str(REPO.parent / "shared" / "data" / "ham10000"))
    ap.add_argument("--site", default="site-1")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--view-samples", type=int, default=200)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedavg_masked", "fedlsm"])
    ap.add_argument(
        "--views",
        nargs="+",
        default=["batched", "per_sample"],
        choices=["batched", "per_sample"],
        help="train.views settings to time each method with",
    )
    ap.add_argument(
        "--no-channels-last",
        dest="channels_last",
        action="store_false",
        help="every model (the bare loop's too) in the default contiguous layout",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.preset == "ham10000" and not any(Path(args.root).glob("*.csv")):
        sys.exit(f"no HAM10000 data under {args.root} (give --root)")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="fedpartial-speed-") as tmp:
        prepare = {"root": args.root} if args.preset == "ham10000" else {}
        cfg = resolve_dataset({"preset": args.preset, "cache": "memory", "prepare": prepare})
        sd = resolve_site_data(args.site, cfg)
        classes = list(cfg["classes"])
        train = read_manifest(
            sd.train, classes=classes, data_root=sd.data_root, site=args.site, task=cfg["task"]
        ).subset("train")
        data = SiteDatasets({"train": train}, cfg)
        base = data.dataset("train", {"image": "eval"})
        images = torch.stack([base[i]["image"] for i in range(len(base))])  # (N, 3, S, S), normalised
        labels = torch.as_tensor(train.labels)
        labels = labels.argmax(1) if cfg["task"] == "multiclass" else (labels * torch.as_tensor(train.mask)).float()
        result = {
            "preset": args.preset,
            "site": args.site,
            "n_train": len(train),
            "steps": args.steps,
            "batch_size": args.batch_size,
            "image_size": int(cfg["image_size"]),
            "repeats": args.repeats,
            "views_ms_per_sample": time_views(base.cached_image(0), cfg, args.view_samples),
        }

        def fresh_model():  # laid out as the executor lays it out (train.channels_last, the default)
            torch.manual_seed(0)
            net = build_model({"arch": "small_cnn", "in_channels": 3}, len(classes))
            return net.to(memory_format=torch.channels_last) if args.channels_last else net

        times: dict[str, list[float]] = {"bare": []}
        gen = torch.Generator().manual_seed(0)
        model = fresh_model()
        bare_round(model, images, labels, 2, args.batch_size, gen)  # warm-up
        for _ in range(args.repeats):
            t = time.perf_counter()
            bare_round(model, images, labels, args.steps, args.batch_size, gen)
            times["bare"].append(time.perf_counter() - t)
        for name in args.methods:
            for views in args.views:
                key = name if views == "batched" else f"{name} ({views} views)"
                ctx = SiteContext(
                    site=args.site,
                    task=cfg["task"],
                    classes=classes,
                    annotated=train.annotated,
                    model=fresh_model(),
                    data=data,
                    device=torch.device("cpu"),
                    state_dir=Path(tmp) / key,
                    train={
                        "batch_size": args.batch_size,
                        "local_steps": args.steps,
                        "lr": 1e-3,
                        "optimizer": "adam",
                        "views": views,
                    },
                    seed=1,
                )
                ctx.state_dir.mkdir()
                trainer = get_method(name).make_trainer(ctx, METHOD_ARGS.get(name, {}))
                meta = method_meta(name, len(classes), ctx.model.feature_dim)
                trainer.train_round(0, 10, meta)  # warm-up
                times[key] = []
                for r in range(args.repeats):
                    t = time.perf_counter()
                    trainer.train_round(r + 1, 10, meta)
                    times[key].append(time.perf_counter() - t)
        bare = statistics.median(times["bare"])
        result["round_s"] = {k: statistics.median(v) for k, v in times.items()}
        result["ratio_to_bare"] = {k: statistics.median(v) / bare for k, v in times.items()}

    v = result["views_ms_per_sample"]
    result["channels_last"] = args.channels_last
    layout = "channels-last" if args.channels_last else "contiguous"
    lines = [
        f"{args.preset} site {args.site}: {result['n_train']} training images, {args.steps} steps x batch "
        f"{args.batch_size}, {result['image_size']} px, 1 thread, {layout} model, median of {args.repeats}",
        "",
        "| what | seconds per round | x bare loop |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {result['round_s'][k]:.2f} | {result['ratio_to_bare'][k]:.1f} |" for k in times]
    lines += [
        "",
        f"weak + strong views: {v['meta_tensor']:.2f} ms per sample with MetaTensor tracking, "
        f"{v['plain_tensors']:.2f} ms with plain_tensors ({v['meta_tensor'] / v['plain_tensors']:.1f}x), "
        f"{v['batched']:.3f} ms drawn per batch of 32 (batch_views)",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
