"""What a CPU can afford: training and inference images per second of each backbone at the sizes a job may use.

    python benchmarks/model_speed.py --out benchmarks/results/model_speed

For each architecture (``--archs``: the small CNN, ResNet-18, EfficientNet-Lite0) and image size (``--sizes``:
64 / 96 / 128 px), one process times ``--steps`` Adam steps of cross-entropy on random batches of ``--batch``
images (channels-last, as the executor lays the model out, with ``--threads`` intra-op threads: a simulated site
uses 1, a real site its cores) after ``--warmup`` untimed steps, then the same number of inference batches
(``torch.no_grad``, eval mode). Lite0 is also timed with its stem and first stages frozen (``model.freeze``:
no gradient, their BatchNorm statistics kept), the option that trades the first layers' ImageNet features for
time. Reported: images / s, the ratio to the small CNN at the same size, and the seconds one epoch of a
HAM10000-sized site (``--site-images``, default 1,200: 6,000 training images over 5 sites) would take.

Timings depend on the machine and on what else runs: the load average before and after is written beside them,
and the ratios within one run are what carries over to another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "custom"))

from fedpartial.models import build_model  # noqa: E402

CONFIGS = {  # name -> (arch, frozen parts of the encoder)
    "small_cnn": ("small_cnn", ()),
    "resnet18": ("resnet18", ()),
    "efficientnet_lite0": ("efficientnet_lite0", ()),
    "efficientnet_lite0, stem + 3 stages frozen": ("efficientnet_lite0", ("stem", "stage1", "stage2", "stage3")),
}


def time_config(arch: str, freeze: tuple, size: int, batch: int, steps: int, warmup: int, channels: int) -> dict:
    torch.manual_seed(0)
    net = build_model({"arch": arch, "in_channels": channels, "freeze": list(freeze)}, 7)
    net = net.to(memory_format=torch.channels_last)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4)
    x = torch.rand(batch, channels, size, size).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 7, (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        net.train()  # the frozen parts' norm layers stay in eval mode (PartialLabelNet.train)
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    def infer() -> None:
        net.eval()
        with torch.no_grad():
            net(x)

    out = {"trainable_params": sum(p.numel() for p in params), "params": sum(p.numel() for p in net.parameters())}
    for what, fn in (("train", step), ("infer", infer)):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[f"{what}_images_per_s"] = batch / statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--sizes", nargs="+", type=int, default=[64, 96, 128])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--channels", type=int, default=3)
    ap.add_argument("--site-images", type=int, default=1200)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    rows = []
    total = len(a.configs) * len(a.sizes)
    for size in a.sizes:
        for name in a.configs:
            arch, freeze = CONFIGS[name]
            r = time_config(arch, freeze, size, a.batch, a.steps, a.warmup, a.channels)
            rows.append({"config": name, "size": size, **r})
            print(
                f"{len(rows)} / {total}: {name} at {size} px: {r['train_images_per_s']:.1f} train img/s, "
                f"{r['infer_images_per_s']:.1f} inference img/s",
                flush=True,
            )
    for r in rows:
        base = next(b for b in rows if b["config"] == "small_cnn" and b["size"] == r["size"])
        r["train_time_vs_small_cnn"] = base["train_images_per_s"] / r["train_images_per_s"]
        r["site_epoch_s"] = a.site_images / r["train_images_per_s"]
    summary = {
        "command": "python benchmarks/model_speed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "threads": a.threads,
        "batch": a.batch,
        "channels": a.channels,
        "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), ""),
        "cores": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "measurements": rows,
    }
    lines = [
        f"Training / inference images per second, batch {a.batch}, {a.threads} threads, channels-last "
        f"({summary['cpu']}, load average {load_before[0]:.1f} before, {summary['load_average_after'][0]:.1f} after)",
        "",
        "| model | px | trainable / all parameters | train img/s | time vs small CNN | inference img/s "
        f"| one epoch of {a.site_images:,} images |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['size']} | {r['trainable_params'] / 1e6:.2f} M / {r['params'] / 1e6:.2f} M "
            f"| {r['train_images_per_s']:.1f} | {r['train_time_vs_small_cnn']:.1f}x | {r['infer_images_per_s']:.1f} "
            f"| {r['site_epoch_s']:.0f} s |"
        )
    print("\n".join(lines))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{a.out}.json").write_text(json.dumps(summary, indent=1))
        Path(f"{a.out}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
