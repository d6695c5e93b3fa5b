"""The project's GPU check: every method on the GPU, amp on and off, reproducibility, a paper-size model, CPU vs GPU
evaluation and speed, each with a PASS / FAIL line (run it through ``benchmarks/gpu_check.sh``, which picks a
Python whose torch sees CUDA).

    bash benchmarks/gpu_check.sh                          # on a GPU machine, from the checkout root
    bash benchmarks/gpu_check.sh --device cpu --quick --budget 1500   # the same checks on a CPU (a dry run)

Checks (each in its own process, so a CUDA error in one does not hide the others; ``--only NAME`` runs one; in
this order, within ``--budget`` seconds, the zoo last with the time left):

- ``zoo``: every registered method on every task it declares, three sites annotating different classes, two
  federated rounds in process (receive -> train_round -> export -> the method's server rule), small CNN at 16 px,
  strong views wherever the view is an option; amp off and on (bfloat16 autocast, as the executor's
  ``train.amp``). PASS: finite losses and global weights, the global model changed. With ``deterministic`` on,
  each case runs twice with amp off: ``repeat`` PASSES when both runs give bit-identical global weights.
- ``paper``: the ``fedmlp_ich_paper`` job's model (ResNet-18), method options and training options at 224 px on a
  few random images per site (3 sites, 2 rounds, the second in stage 2), amp off and on.
- ``eval``: the same ResNet-18 at 224 px evaluated (``fedpartial.evaluation.evaluate``) on the CPU and on the
  GPU (float32, TF32 off): probabilities within 1e-3 and the same macro AUROC (within 1e-4).
- ``step``: ResNet-18 at 224 px, batch 32, channels-last, Adam + BCE: ms per training step in float32 (torch's
  defaults: TF32 convolutions) and under bfloat16 autocast. PASS: amp <= 0.6 x float32 (also reported: float32
  with TF32 off).
- ``round``: one fedavg local round (``LocalTrainer.train_round`` with its loader, weak views drawn on the GPU,
  the site's images kept on the GPU: ``train.data_on_device`` auto) against a bare loop (the same model and
  optimiser, the same images already on the GPU, the same number of steps). PASS: round <= 1.2 x bare. Also
  timed: the images from the host, pinned and prefetched in a thread, and without the thread.
- ``store``: the input pipeline from the image store (``fedpartial.data.store``): grayscale PNGs stored as 1-channel
  uint8 at 224 px, read in shuffled batches of 32, sent to the device as uint8, repeated to the model's 3
  channels and given the weak views there (``train.data_on_device`` off: every batch from the host), in images/s,
  against ResNet-18's training step in images/s at the same size and batch (the faster of float32 and amp).
  PASS: input >= step. Then a fedavg local round reading the store (``data_on_device`` off) against a bare loop
  reading the same store batches (uint8 to the device, converted there, no views). PASS: round <= 1.2 x bare.
- ``syncs``: host synchronisations per training step, every method (``torch.cuda.set_sync_debug_mode``): the
  syncs 4 more local steps add to a round. PASS: none; the detail names the lines that wait on the GPU.
- ``job``: when NVFlare imports, a real simulator job (``fedavg_ich``, 3 sites, 2 rounds, ``device`` = the
  checked device, amp and ``deterministic`` on): PASS when it finishes and ``results.json`` records that device
  for every site. SKIP (with the reason) otherwise.

Output: ``<out>/gpu_check_<device>.md`` and ``.json`` (default ``--out benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKS = (
    "step",
    "round",
    "store",
    "syncs",
    "eval",
    "paper",
    "job",
    "zoo",
)  # the zoo last: it takes the time left (--budget)
TARGET_AMP, TARGET_ROUND = 0.6, 1.2


DEPS_ZIP = REPO / ".venv" / "gpu_deps.zip"  # --pack-deps writes it; a GPU machine without network reads it
DEPS_DIR = REPO / ".venv" / "gpu_deps"
PACKED = ("monai",)  # pure-Python packages a CUDA machine's own Python may lack (torch, numpy, scipy, PIL it has)


def pack_deps() -> None:
    """Zip the pure-Python packages of :data:`PACKED` from this Python into :data:`DEPS_ZIP` (a few MB: what to
    bring to a GPU machine that has a CUDA torch but no network; ``gpu_check.sh`` unpacks it there)."""
    import importlib
    import zipfile

    DEPS_ZIP.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(DEPS_ZIP, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in PACKED:
            root = Path(importlib.import_module(name).__file__).parent
            for f in sorted(root.rglob("*")):
                if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so"):
                    zf.write(f, f.relative_to(root.parent))
    print(f"wrote {DEPS_ZIP} ({DEPS_ZIP.stat().st_size / 1e6:.1f} MB: {', '.join(PACKED)})")


def setup_path() -> list[str]:
    """``custom/`` first on ``sys.path``; then, LAST (after this Python's own packages, so its CUDA torch and numpy
    win): the packages unpacked from :data:`DEPS_ZIP` and the checkout's ``.venv`` site-packages, for what this
    Python lacks (MONAI, NVFlare). Returns the borrowed folders."""
    sys.path.insert(0, str(REPO / "custom"))
    if DEPS_ZIP.is_file() and not DEPS_DIR.is_dir():
        import zipfile

        with zipfile.ZipFile(DEPS_ZIP) as zf:
            zf.extractall(DEPS_DIR)
    borrowed = []
    folders = [DEPS_DIR] if DEPS_DIR.is_dir() else []
    folders += sorted((REPO / ".venv" / "lib").glob("python3*/site-packages"))
    for site in folders:
        if str(site) not in sys.path and str(Path(sys.prefix)) not in str(site):
            sys.path.append(str(site))
            borrowed.append(str(site))
    return borrowed


# ------------------------------------------------------------------------------------------ shared pieces


def _images(root: Path, n: int, size: int, seed: int = 0) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / f"{i}.png")


def _site(
    root: Path, k: int, n: int, task: str, annotated, ds: dict, model, device, train: dict, state_dir: Path, n_val=4
):
    """The test suite's site over real PNG files (``tests/fake_sites.py``: :func:`manifest_site`) on ``device``."""
    sys.path.insert(0, str(REPO / "tests"))
    from fake_sites import manifest_site

    return manifest_site(root, k, n, task, annotated, ds, model, train, state_dir, n_val=n_val, device=device)


def _annotations(name: str, task: str, C: int, accepts_unlabelled: bool):
    import numpy as np

    if name in ("fedirm", "fed_consistency", "fed_selftraining", "fedavg_labelled"):
        return [np.ones(C, bool), np.zeros(C, bool), np.zeros(C, bool)]
    sets = (
        [[0, 1], [1, 2, 3], [] if accepts_unlabelled else [3, 4]]
        if task == "multilabel"
        else [[0, 1, 2], [2, 3, 4], [] if accepts_unlabelled else [4, 5, 6]]
    )
    return [np.isin(np.arange(C), s) for s in sets]


def _summary(ctxs) -> dict:
    sites = {}
    for ctx in ctxs:
        m = ctx.data.manifests["train"]
        sites[ctx.site] = {
            "n_train": len(m),
            "annotated": m.annotated.tolist(),
            "positives": m.positives().tolist(),
            "negatives": m.negatives().tolist(),
            "n_val": 4,
            "n_test": 0,
            "eval_sets": {},
        }
    return {"classes": ctxs[0].classes, "sites": sites}


def federate(
    name: str,
    task: str,
    root: Path,
    work: Path,
    device: str,
    amp: bool,
    model_cfg: dict,
    size: int,
    n: int,
    train: dict,
    method_args: dict | None = None,
    seed: int = 0,
    count_syncs: bool = False,
) -> dict:
    """Two federated rounds of method ``name`` in process with three sites on ``device``; returns ``{"ok",
    "why", "weights" (the final global state as numpy), "seconds"}``; with ``count_syncs`` also ``"syncs"``: per
    round, the host synchronisations CUDA reported during the sites' ``train_round`` calls (``(file, line)`` of
    each), and ``"steps"`` per round."""
    import numpy as np
    import torch

    from fedpartial.data.presets import resolve_dataset
    from fedpartial.device import mixed_precision
    from fedpartial.fl.keys import META_ANNOTATED, META_GROUPS, META_N_TRAIN, META_SUMMARY
    from fedpartial.methods import Contribution, get_method
    from fedpartial.models import build_model
    from fedpartial.seeding import round_seed, seed_everything

    t0 = time.perf_counter()
    method = get_method(name)
    ds = resolve_dataset({"preset": "ich_phantom" if task == "multilabel" else "ham10000", "image_size": size})
    C = len(ds["classes"])
    options = {k: 1 for k in ("warmup_rounds", "warm_rounds", "labelled_only_rounds") if k in method.option_names()}
    options.update({k: "strong" for k in ("view", "feature_view") if k in method.option_names()})
    options.update(method_args or {})
    annotated = _annotations(name, task, C, method.trainer.accepts_unlabelled)
    seed_everything(seed)
    init = build_model(dict(model_cfg, init_seed=seed), C)
    global_w = {k: v.numpy().copy() for k, v in init.state_dict().items()}
    groups = init.parameter_groups()
    ctxs, trainers = [], []
    for k, a in enumerate(annotated):
        net = build_model(dict(model_cfg, init_seed=seed), C).to(device).to(memory_format=torch.channels_last)
        ctx = _site(root, k, n, task, a, ds, net, device, dict(train, amp=amp), work / f"{name}-{task}-{amp}-{k}")
        ctxs.append(ctx)
    summary = _summary(ctxs)
    for ctx in ctxs:
        ctx.summary = summary
        trainers.append(method.make_trainer(ctx, dict(options), f"gpu check {name}"))
    rule = method.make_rule(dict(options), f"gpu check {name}")
    rule.check_federation(summary)
    meta_out: dict = {META_SUMMARY: summary}
    syncs: list[list] = [[], []]
    steps = [0, 0]
    for rnd in range(2):
        contributions = []
        for ctx, tr in zip(ctxs, trainers):
            tr.receive(global_w)
            seed_everything(round_seed(ctx.seed, rnd))
            with mixed_precision(torch.device(device).type, amp), _SyncCounter(count_syncs) as counter:
                out = tr.train_round(rnd, 2, dict(meta_out))
            syncs[rnd] += counter.where
            steps[rnd] += int(out.steps)
            if not np.isfinite(out.loss):
                return {
                    "ok": False,
                    "why": f"{ctx.site} round {rnd}: loss {out.loss}",
                    "seconds": time.perf_counter() - t0,
                }
            tr.has_local_state = True
            contributions.append(
                Contribution(
                    site=ctx.site,
                    weights=tr.export(),
                    n=len(ctx.data.manifests["train"]),
                    meta={**out.meta, META_N_TRAIN: 12, META_ANNOTATED: ctx.annotated.tolist(), META_GROUPS: groups},
                    weight=float(out.weight),
                )
            )
        used = [c for c in contributions if c.weight > 0]
        if not used:
            return {"ok": False, "why": f"every site sat round {rnd} out", "seconds": time.perf_counter() - t0}
        weights, meta = rule.aggregate(global_w, used, groups, rnd, summary)
        global_w = {k: np.asarray(v) for k, v in weights.items()}
        meta_out = {**meta, META_SUMMARY: summary}
        bad = [k for k, v in global_w.items() if not np.all(np.isfinite(np.asarray(v, dtype=np.float64)))]
        if bad:
            return {
                "ok": False,
                "why": f"round {rnd}: non-finite global {bad[:2]}",
                "seconds": time.perf_counter() - t0,
            }
    changed = any(
        v.is_floating_point() and not np.allclose(global_w[k], v.numpy()) for k, v in init.state_dict().items()
    )
    return {
        "ok": changed,
        "why": "" if changed else "the global model did not change",
        "weights": global_w,
        "seconds": time.perf_counter() - t0,
        "syncs": syncs,
        "steps": steps,
    }


class _SyncCounter:
    """Within the block, every operation that makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode``:
    ``.item()``, a blocking copy, a device mask's row count, ...) is recorded in ``where`` as ``file:line`` of the
    innermost project frame that asked for it. Off (``on`` False) or without CUDA: records nothing."""

    def __init__(self, on: bool):
        import torch

        self.on = bool(on) and torch.cuda.is_available()
        self.where: list[str] = []

    def _seen(self, message, category, filename, lineno, file=None, line=None):
        import traceback

        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "fedpartial" in f.filename]
        f = frames[-1] if frames else None
        self.where.append(f"{Path(f.filename).name}:{f.lineno}" if f else f"{Path(filename).name}:{lineno}")

    def __enter__(self):
        if self.on:
            import warnings

            import torch

            self._catch = warnings.catch_warnings()
            self._catch.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._seen
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.on:
            import torch

            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(*exc)
        return False


def _same(a: dict, b: dict) -> bool:
    import numpy as np

    return set(a) == set(b) and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def _sync(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ the checks


def check_zoo(args, work: Path, out: list) -> None:
    from fedpartial.methods import available_methods, get_method
    from fedpartial.seeding import set_deterministic

    set_deterministic(True)
    root = work / "img16"
    root.mkdir()
    _images(root, 3 * 16, 16)
    cases = [(m, t) for m in available_methods() for t in get_method(m).trainer.tasks]
    if args.quick:
        cases = [
            c
            for c in cases
            if c
            in (
                ("fedavg", "multilabel"),
                ("fixmatch", "multiclass"),
                ("fedlsr", "multilabel"),
                ("fedirm", "multilabel"),
            )
        ]
    model = {"arch": "small_cnn", "width": 4, "dropout": 0.2}
    train = {"lr": 1e-2, "batch_size": 4, "local_steps": 2, "inference_batch_size": 8, "pin_memory": True}
    for amp in (False, True):
        for name, task in cases:
            try:  # amp off: twice (the repeat); amp on: once
                runs = [
                    federate(name, task, root, work, args.device, amp, model, 16, 16, train)
                    for _ in range(1 if amp else 2)
                ]
            except ImportError as e:  # a package this Python lacks (e.g. NVFlare's runtime for FedProx's loss)
                out.append(
                    {
                        "check": "zoo",
                        "case": f"{name}/{task}/amp={'on' if amp else 'off'}",
                        "ok": None,
                        "detail": f"SKIP: {type(e).__name__}: {e}",
                    }
                )
                continue
            except Exception as e:  # noqa: BLE001 - one case's error is its FAIL line
                runs = [{"ok": False, "why": f"{type(e).__name__}: {e}"[:300]}]
            ok = all(r["ok"] for r in runs)
            why = "; ".join(r["why"] for r in runs if r["why"])
            out.append(
                {
                    "check": "zoo",
                    "case": f"{name}/{task}/amp={'on' if amp else 'off'}",
                    "ok": ok,
                    "detail": why or f"{runs[0]['seconds']:.2f} s",
                }
            )
            if ok and len(runs) == 2:
                same = _same(runs[0]["weights"], runs[1]["weights"])
                out.append(
                    {
                        "check": "repeat",
                        "case": f"{name}/{task}/amp={'on' if amp else 'off'}",
                        "ok": same,
                        "detail": "bit-identical global weights" if same else "the two runs differ",
                    }
                )


def check_syncs(args, work: Path, out: list) -> None:
    """Host synchronisations per training step: every method's local rounds (first task it declares, amp off,
    small CNN at 16 px, three sites) with 2 and with 6 local steps; the syncs the 4 extra steps add, per step.
    PASS: none (what a round reads back, it reads once). Detail: the syncs per round and where the per-step ones
    come from."""
    from collections import Counter

    from fedpartial.methods import available_methods, get_method

    root = work / "img16s"
    root.mkdir()
    _images(root, 3 * 24, 16)
    names = available_methods()
    if args.quick:
        names = [m for m in names if m in ("fedavg", "fixmatch", "fedirm", "fedmlp", "fedlsm")]
    model = {"arch": "small_cnn", "width": 4, "dropout": 0.2}
    for name in names:
        task = get_method(name).trainer.tasks[0]
        try:
            runs = [
                federate(
                    name,
                    task,
                    root,
                    work / f"s{k}",
                    args.device,
                    False,
                    model,
                    16,
                    24,
                    {"lr": 1e-2, "batch_size": 2, "local_steps": k, "inference_batch_size": 8, "pin_memory": True},
                    count_syncs=True,
                )
                for k in (2, 6)
            ]
        except ImportError as e:
            out.append({"check": "syncs", "case": f"{name}/{task}", "ok": None, "detail": f"SKIP: {e}"})
            continue
        except Exception as e:  # noqa: BLE001
            out.append(
                {"check": "syncs", "case": f"{name}/{task}", "ok": False, "detail": f"{type(e).__name__}: {e}"[:300]}
            )
            continue
        # round 1 (round 0 may differ: warm-up rounds, first-round set-ups)
        few, many = Counter(runs[0]["syncs"][1]), Counter(runs[1]["syncs"][1])
        extra_steps = runs[1]["steps"][1] - runs[0]["steps"][1]
        grown = many - few
        per_step = sum(grown.values()) / max(extra_steps, 1)
        gpu = torch_is_cuda(args.device)
        top = ", ".join(f"{w} x{c}" for w, c in grown.most_common(4))
        out.append(
            {
                "check": "syncs",
                "case": f"{name}/{task}",
                "ok": (per_step == 0) if gpu else None,
                "detail": f"{per_step:.2f} per step; per round of 3 sites: {sum(few.values())} with "
                f"{runs[0]['steps'][1]} steps, {sum(many.values())} with {runs[1]['steps'][1]}"
                + (f"; per step: {top}" if top else "")
                + ("" if gpu else " (SKIP: counted on CUDA only)"),
                "syncs": {"few": dict(few), "many": dict(many)},
            }
        )


def torch_is_cuda(device: str) -> bool:
    import torch

    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _paper_job() -> dict:
    cfg = json.loads((REPO / "jobs" / "fedmlp_ich_paper" / "app" / "config" / "config_fed_client.json").read_text())
    return cfg["executors"][0]["executor"]["args"]


def check_paper(args, work: Path, out: list) -> None:
    job = _paper_job()
    size = 224
    root = work / "img224"
    root.mkdir()
    n = 12 if args.quick else 40
    _images(root, 3 * n, size)
    model = {k: v for k, v in job["model"].items() if k != "init_seed"}
    train = {k: v for k, v in job["train"].items() if k not in ("num_workers",)}
    train.update(batch_size=8 if args.quick else 16, pin_memory=True)
    method_args = dict(job["method_args"], warmup_rounds=1)  # round 2 in stage 2 (tagging, prototypes)
    for amp in (False, True):
        try:
            r = federate(
                job["method"] if not job["method"].startswith("{") else "fedmlp",
                "multilabel",
                root,
                work,
                args.device,
                amp,
                model,
                size,
                n,
                train,
                method_args,
            )
        except Exception as e:  # noqa: BLE001
            r = {"ok": False, "why": f"{type(e).__name__}: {e}"[:300], "seconds": 0.0}
        out.append(
            {
                "check": "paper",
                "case": f"fedmlp_ich_paper {model['arch']} {size}px/amp={'on' if amp else 'off'}",
                "ok": r["ok"],
                "detail": r["why"] or f"2 rounds x 3 sites in {r['seconds']:.1f} s",
            }
        )


def check_eval(args, work: Path, out: list) -> None:
    import numpy as np
    import torch

    from fedpartial.data.manifest import read_manifest, write_manifest
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.data.sitedata import SiteDatasets
    from fedpartial.evaluation import evaluate
    from fedpartial.models import build_model
    from fedpartial.seeding import set_deterministic

    set_deterministic(True)  # float32 without TF32 on the GPU
    size, n = 224, (16 if args.quick else 64)
    root = work / "eval"
    root.mkdir()
    _images(root, n, size, seed=1)
    ds = resolve_dataset({"preset": "ich_phantom", "image_size": size})
    C = len(ds["classes"])
    rng = np.random.default_rng(0)
    labels = (rng.random((n, C)) < 0.5).astype(float)
    labels[:2], labels[2:4] = 1, 0  # both classes present in every column
    write_manifest(
        root / "m.csv", [f"{i}.png" for i in range(n)], labels, np.ones((n, C), bool), ds["classes"], splits=["val"] * n
    )
    data = SiteDatasets({"val": read_manifest(root / "m.csv", ds["classes"], data_root=root, task="multilabel")}, ds)
    net = build_model({"arch": _paper_job()["model"]["arch"], "init_seed": 0}, C)
    with torch.no_grad():  # a model that is not all 0.5: spread the classifier
        net.classifier.weight.mul_(20)
    res = {}
    for dev in ("cpu", args.device):
        model = net.to(dev).to(memory_format=torch.channels_last)
        loader = data.eval_loader("val", batch_size=16)
        from fedpartial.evaluation import predict

        res[dev] = (
            predict(model, loader, "multilabel", dev)["probs"],
            evaluate(model, loader, "multilabel", ds["classes"], dev)["macro"]["auc"],
        )
    (p_cpu, auc_cpu), (p_dev, auc_dev) = res["cpu"], res[args.device]
    diff = float(np.abs(p_cpu - p_dev).max())
    ok = diff < 1e-3 and abs(auc_cpu - auc_dev) < 1e-4
    out += [
        {
            "check": "eval",
            "case": f"cpu vs {args.device}, ResNet-18 {size}px, {n} images",
            "ok": ok,
            "detail": f"max |p_cpu - p_{args.device}| = {diff:.2e}, macro AUROC {auc_cpu:.6f} vs {auc_dev:.6f}",
        }
    ]


def _step_time(
    device: str,
    amp: bool,
    steps: int,
    bs: int,
    size: int,
    tf32: bool | None = None,
    optimizer: bool = True,
    compile_mode: str | None = None,
) -> float:
    """ms per training step of ResNet-18 (channels-last, Adam, BCE) on random data already on ``device``
    (``optimizer=False``: forward and backward only, to separate the optimiser's fixed cost)."""
    import torch

    from fedpartial.models import build_model

    if tf32 is not None:
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
    net = build_model({"arch": "resnet18", "init_seed": 0}, 5).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    if compile_mode:
        net = torch.compile(net, mode=compile_mode)
    x = torch.rand(bs, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = (torch.rand(bs, 5, device=device) < 0.5).float()

    def step():
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if optimizer:
            opt.step()

    for _ in range(5):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return 1000 * (time.perf_counter() - t0) / steps


def check_step(args, work: Path, out: list) -> None:
    """amp vs float32 step time at the jobs' batch (32) and at a larger batch (128), where the GPU is busier; plus
    forward + backward alone at batch 32 (what the optimiser's fixed per-step cost hides)."""
    import torch

    torch.backends.cudnn.benchmark = True  # the fastest kernels for a fixed shape (not a deterministic run)
    gpu = torch.device(args.device).type == "cuda"  # the speed targets are a GPU's (None: SKIP on a CPU)
    steps, size = (3, 64) if args.quick else (30, 224)
    for bs in (4,) if args.quick else (32, 128):
        fp32 = _step_time(args.device, False, steps, bs, size)
        amp = _step_time(args.device, True, steps, bs, size)
        fb32 = _step_time(args.device, False, steps, bs, size, optimizer=False)
        fbamp = _step_time(args.device, True, steps, bs, size, optimizer=False)
        ratio = amp / fp32
        out += [
            {
                "check": "step",
                "case": f"ResNet-18 {size}px batch {bs}: amp / fp32",
                "ok": (ratio <= TARGET_AMP) if gpu else None,
                "detail": f"fp32 (TF32 convs, torch default) {fp32:.1f} ms, amp {amp:.1f} ms: {ratio:.2f}x "
                f"(target <= {TARGET_AMP}); forward+backward alone {fb32:.1f} vs {fbamp:.1f} ms "
                f"({fbamp / fb32:.2f}x)",
                "ms": {"fp32": fp32, "amp": amp, "fwd_bwd_fp32": fb32, "fwd_bwd_amp": fbamp},
            }
        ]
    strict = _step_time(args.device, False, steps, 4 if args.quick else 32, size, tf32=False)
    torch.backends.cudnn.allow_tf32 = True
    out += [
        {
            "check": "step",
            "case": "ResNet-18 batch 32, float32 without TF32 (reference)",
            "ok": None,
            "detail": f"INFO: {strict:.1f} ms per step",
            "ms": {"fp32_no_tf32": strict},
        }
    ]
    if gpu:  # how much of a batch-32 step is the host launching kernels: the same step replayed as a CUDA graph
        try:
            cg = {
                amp: _step_time(args.device, amp, steps, 32, size, compile_mode="reduce-overhead")
                for amp in (False, True)
            }
            out += [
                {
                    "check": "step",
                    "case": "ResNet-18 batch 32 under torch.compile(mode='reduce-overhead')",
                    "ok": None,
                    "detail": f"INFO: fp32 {cg[False]:.1f} ms, amp {cg[True]:.1f} ms ({cg[True] / cg[False]:.2f}x)",
                    "ms": {"fp32_compiled": cg[False], "amp_compiled": cg[True]},
                }
            ]
        except Exception as e:  # noqa: BLE001 - an INFO line only
            out += [
                {
                    "check": "step",
                    "case": "ResNet-18 batch 32 under torch.compile",
                    "ok": None,
                    "detail": f"SKIP: {type(e).__name__}: {str(e)[:200]}",
                }
            ]


def check_round(args, work: Path, out: list) -> None:
    import torch

    from fedpartial.data import batch_views
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.device import mixed_precision
    from fedpartial.methods import get_method
    from fedpartial.models import build_model

    torch.backends.cudnn.benchmark = True
    prefetch_default = batch_views.PREFETCH_ON_GPU
    size, bs, steps = (64, 8, 4) if args.quick else (224, 32, 20)
    n = bs * steps + 4
    root = work / "round"
    root.mkdir()
    _images(root, n, size, seed=2)
    ds = resolve_dataset({"preset": "ich_phantom", "image_size": size})
    C = len(ds["classes"])
    import numpy as np

    for amp in (False, True):
        net = build_model({"arch": "resnet18", "init_seed": 0}, C).to(args.device).to(memory_format=torch.channels_last)
        train = {"lr": 1e-4, "batch_size": bs, "local_steps": steps, "pin_memory": True, "amp": amp}
        ctx = _site(root, 0, n, "multilabel", np.ones(C, bool), ds, net, args.device, train, work / f"r{amp}", n_val=4)
        trainer = get_method("fedavg").make_trainer(ctx, {"view": "weak"})
        ds_train = ctx.data.dataset("train", {"image": "eval"})
        xs = torch.stack([ds_train[i]["image"] for i in range(len(ds_train))]).to(args.device)
        ys = torch.as_tensor(np.asarray(ds_train.labels), dtype=torch.float32, device=args.device)
        xs = xs.contiguous(memory_format=torch.channels_last)
        dev_type = torch.device(args.device).type

        def local_round():
            with mixed_precision(dev_type, amp):
                trainer.train_round(0, 2, {})

        def bare():
            model = ctx.model.train()
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
            perm = torch.randperm(xs.shape[0], device=args.device)
            for s in range(steps):
                idx = perm[s * bs : (s + 1) * bs]
                with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=amp):
                    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xs[idx]), ys[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

        def from_host(prefetch: int):
            def run():
                batch_views.PREFETCH_ON_GPU = prefetch
                ctx.train.data_on_device = "off"
                try:
                    local_round()
                finally:
                    batch_views.PREFETCH_ON_GPU, ctx.train.data_on_device = prefetch_default, "auto"

            return run

        times = {"round": [], "bare": [], "host_prefetched": [], "host_unprefetched": []}
        for rep in range(3):  # the first of each is a warm-up
            for key, fn in (
                ("bare", bare),
                ("round", local_round),
                ("host_prefetched", from_host(prefetch_default)),
                ("host_unprefetched", from_host(0)),
            ):
                _sync(args.device)
                t0 = time.perf_counter()
                fn()
                _sync(args.device)
                if rep:
                    times[key].append(time.perf_counter() - t0)
        r, b = min(times["round"]), min(times["bare"])
        hp, hu = min(times["host_prefetched"]), min(times["host_unprefetched"])
        out.append(
            {
                "check": "round",
                "case": f"fedavg local round vs bare loop, ResNet-18 {size}px, {steps} steps of "
                f"{bs}, amp={'on' if amp else 'off'}",
                "ok": (r / b <= TARGET_ROUND) if torch.device(args.device).type == "cuda" else None,
                "detail": f"round {1000 * r:.0f} ms, bare {1000 * b:.0f} ms: {r / b:.2f}x (target <= {TARGET_ROUND}; "
                f"images kept on the device, train.data_on_device auto); images from the host "
                f"(data_on_device off): prefetched {1000 * hp:.0f} ms ({hp / b:.2f}x), without the "
                f"prefetching thread {1000 * hu:.0f} ms ({hu / b:.2f}x)",
                "seconds": {"round": r, "bare": b, "host_prefetched": hp, "host_unprefetched": hu},
            }
        )


def check_store(args, work: Path, out: list) -> None:
    """Input images/s from the image store vs ResNet-18 step images/s; fedavg round vs bare loop from the store."""
    import numpy as np
    import torch
    from PIL import Image

    from fedpartial.data.batch_views import as_float
    from fedpartial.data.presets import resolve_dataset
    from fedpartial.device import mixed_precision
    from fedpartial.methods import get_method
    from fedpartial.models import build_model

    torch.backends.cudnn.benchmark = True
    gpu = torch.device(args.device).type == "cuda"
    size, bs, steps = (32, 4, 2) if args.quick else (224, 32, 40)
    n = bs * steps + 4
    root = work / "store"
    root.mkdir()
    rng = np.random.default_rng(3)
    for i in range(n):  # grayscale, larger than the job's size: stored as 1 channel, resized once
        Image.fromarray(rng.integers(0, 255, (size + 32, size + 32), dtype=np.uint8)).save(root / f"{i}.png")
    ds = resolve_dataset({"preset": "ich_phantom", "image_size": size})  # a 3-channel model
    C = len(ds["classes"])
    net = build_model({"arch": "resnet18", "init_seed": 0}, C).to(args.device).to(memory_format=torch.channels_last)
    train = {
        "lr": 1e-4,
        "batch_size": bs,
        "local_steps": steps,
        "pin_memory": True,
        "amp": gpu,
        "data_on_device": "off",
    }
    ctx = _site(root, 0, n, "multilabel", np.ones(C, bool), ds, net, args.device, train, work / "st", n_val=4)
    store = ctx.data.store("train")
    dev_type = torch.device(args.device).type

    def input_pass() -> int:
        k = 0
        for batch in ctx.data.train_loader(
            {"image": "weak"}, bs, True, 0, True, batched=True, device=args.device, pin_memory=True, on_device="off"
        ):
            k += batch["image"].shape[0]
        _sync(args.device)
        return k

    input_pass()  # warm-up (kernels, page cache)
    t0 = time.perf_counter()
    k = input_pass() + input_pass()
    rate_in = k / (time.perf_counter() - t0)
    ms = min(
        _step_time(args.device, amp, 2 if args.quick else 20, bs, size) for amp in ((False, True) if gpu else (False,))
    )
    rate_step = bs / (ms / 1000)
    out.append(
        {
            "check": "store",
            "case": f"input from the image store vs ResNet-18 step, {size}px, batch {bs}",
            "ok": (rate_in >= rate_step) if gpu else None,
            "detail": f"input {rate_in:.0f} img/s (store {store.channels} channel uint8 -> device, 3 channels and "
            f"weak views there), step {rate_step:.0f} img/s ({ms:.1f} ms, the faster of fp32 / amp on a GPU) "
            "(target: input >= step)",
            "img_per_s": {"input": rate_in, "step": rate_step},
        }
    )

    trainer = get_method("fedavg").make_trainer(ctx, {"view": "weak"})
    model = ctx.model

    def local_round():
        with mixed_precision(dev_type, gpu):
            trainer.train_round(0, 2, {})

    def bare():
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        for s, batch in enumerate(ctx.data._batches("train", bs, True, 1, True)):
            if s >= steps:
                break
            x = as_float(
                batch["source"].pin_memory().to(args.device, non_blocking=True)
                if gpu
                else batch["source"].to(args.device),
                3,
            ).contiguous(memory_format=torch.channels_last)
            y = batch["label"].to(args.device, non_blocking=True)
            with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=gpu):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    times = {"round": [], "bare": []}
    for rep in range(3):  # the first of each is a warm-up
        for key, fn in (("bare", bare), ("round", local_round)):
            _sync(args.device)
            t0 = time.perf_counter()
            fn()
            _sync(args.device)
            if rep:
                times[key].append(time.perf_counter() - t0)
    r, b = min(times["round"]), min(times["bare"])
    out.append(
        {
            "check": "store",
            "case": f"fedavg local round vs bare loop, both from the image store, ResNet-18 "
            f"{size}px, {steps} steps of {bs}, amp={'on' if gpu else 'off'}",
            "ok": (r / b <= TARGET_ROUND) if gpu else None,
            "detail": f"round {1000 * r:.0f} ms, bare {1000 * b:.0f} ms: {r / b:.2f}x (target <= {TARGET_ROUND}; "
            "train.data_on_device off: every batch read from the store on the host)",
            "seconds": {"round": r, "bare": b},
        }
    )


def check_job(args, work: Path, out: list) -> None:
    try:
        import nvflare  # noqa: F401
        from nvflare.private.fed.app.simulator import simulator  # noqa: F401
    except Exception as e:  # noqa: BLE001
        out += [
            {
                "check": "job",
                "case": "fedavg_ich simulator job",
                "ok": None,
                "detail": f"SKIP: NVFlare does not import with this Python ({type(e).__name__}: {e})",
            }
        ]
        return
    from fedpartial.tools.build_jobs import customise_job

    job = customise_job(
        REPO / "jobs" / "fedavg_ich",
        work / "job" / "fedavg_ich",
        2,
        {
            "device": args.device,
            "deterministic": True,
            "train": {
                "optimizer": "adam",
                "lr": 0.001,
                "batch_size": 32,
                "local_epochs": 1,
                "amp": True,
                "pin_memory": True,
            },
            "dataset": {
                "preset": "ich_phantom",
                "image_size": 32,
                "prepare": {"num_sites": 3, "k": 1, "source_args": {"n_images": 300}},
            },
        },
        min_clients=3,
    )
    ws = work / "job" / "ws"
    env = {
        **os.environ,
        "FEDPARTIAL_DATA_DIR": str(work / "job"),
        "FEDPARTIAL_CACHE": str(work / "job" / "cache"),
        # the simulator and its site workers import exactly what this check imports: this interpreter and its
        # whole path (a GPU machine without the venv has the packages on PYTHONPATH or in a zip)
        "PYTHONPATH": os.pathsep.join(dict.fromkeys([str(REPO / "custom")] + [p for p in sys.path if p])),
    }
    cmd = [sys.executable, "-m", "fedpartial.fl.simulator", str(job), "-w", str(ws), "-n", "3", "-t", "3"]  # job.py's
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    results = ws / "server" / "simulate_job" / "results.json"
    if proc.returncode != 0 or not results.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        out += [
            {
                "check": "job",
                "case": "fedavg_ich simulator job",
                "ok": False,
                "detail": f"exit {proc.returncode}, no results.json: {' | '.join(tail)}",
            }
        ]
        return
    res = json.loads(results.read_text())
    devices = {s: (d or {}).get("device") for r in res["rounds"] for s, d in (r.get("site_devices") or {}).items()}
    want = "cuda:0" if args.device.startswith("cuda") else "cpu"
    ok = len(devices) == 3 and all(d == want for d in devices.values())
    out += [
        {
            "check": "job",
            "case": f"fedavg_ich simulator job, 3 sites, 2 rounds, device {args.device}, amp",
            "ok": ok,
            "detail": f"results.json site devices {sorted(set(devices.values()))} ({time.perf_counter() - t0:.0f} s)",
        }
    ]


# ------------------------------------------------------------------------------------------ driver


def run_one(args) -> None:
    borrowed = setup_path()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch ({torch.__version__}) sees no GPU")
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    fn = {
        "zoo": check_zoo,
        "paper": check_paper,
        "eval": check_eval,
        "step": check_step,
        "round": check_round,
        "store": check_store,
        "syncs": check_syncs,
        "job": check_job,
    }[args.only]
    print("BORROWED " + json.dumps(borrowed), flush=True)
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{args.only}_") as tmp:
        os.environ.setdefault("FEDPARTIAL_CACHE", str(Path(tmp) / "cache"))
        fn(args, Path(tmp), Lines())


class Lines(list):
    """The result lines of a check, each printed (``LINE <json>``) as soon as it is known, so that a check cut
    short by its time limit still reports what it finished."""

    def append(self, line: dict) -> None:
        super().append(line)
        print("LINE " + json.dumps(line, default=float), flush=True)

    def __iadd__(self, lines):
        for line in lines:
            self.append(line)
        return self


def environment(device: str) -> dict:
    setup_path()
    import torch

    env = {
        "python": sys.executable,
        "python_version": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    for mod in ("monai", "nvflare"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            env[mod] = f"absent ({type(e).__name__})"
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a dry run)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder of gpu_check_<device>.md/json")
    ap.add_argument("--quick", action="store_true", help="a few methods, small sizes (a dry run of the script)")
    ap.add_argument("--only", choices=CHECKS, help="run one check in this process (what the driver does)")
    ap.add_argument("--checks", default=",".join(CHECKS), help="comma-separated checks to run")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per check at most")
    ap.add_argument(
        "--budget",
        type=int,
        default=450,
        help="seconds for all checks: a check gets at most what is left (its finished lines are kept)",
    )
    ap.add_argument("--pack-deps", action="store_true", help=f"write {DEPS_ZIP.relative_to(REPO)} (MONAI) and stop")
    args = ap.parse_args()
    if args.pack_deps:
        return pack_deps()
    if args.only:
        return run_one(args)
    t_start = time.perf_counter()
    env = environment(args.device)
    print(f"gpu check: {json.dumps(env)}", flush=True)
    lines, borrowed = [], []
    names = [c for c in args.checks.split(",") if c]
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        left = args.budget - (t0 - t_start) - 20 * (len(names) - i - 1)  # keep 20 s for each later check
        limit = int(max(30, min(args.timeout, left)))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--only", name, "--device", args.device]
        cmd += ["--quick"] if args.quick else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=str(REPO))
            stdout, stderr, rc, late = proc.stdout, proc.stderr, proc.returncode, None
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc, late = None, f"stopped at its time limit ({limit} s of the --budget {args.budget} s)"
        new = [json.loads(ln[len("LINE ") :]) for ln in stdout.splitlines() if ln.startswith("LINE ")]
        for ln in stdout.splitlines():
            if ln.startswith("BORROWED "):
                borrowed = json.loads(ln[len("BORROWED ") :]) or borrowed
        if late or rc != 0:
            tail = " | ".join((stdout + stderr).strip().splitlines()[-4:])
            new.append(
                {"check": name, "case": "(the rest of the check)", "ok": False, "detail": late or f"exit {rc}: {tail}"}
            )
        for ln in new:
            status = "SKIP" if ln["ok"] is None else ("PASS" if ln["ok"] else "FAIL")
            ln["status"] = status
            print(f"{status} {ln['check']:7s} {ln['case']}: {ln['detail']}", flush=True)
        lines += new
        print(f"      ({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    total = time.perf_counter() - t_start
    failed = [ln for ln in lines if ln["status"] == "FAIL"]
    summary = {
        "environment": env,
        "borrowed_site_packages": borrowed,
        "quick": args.quick,
        "seconds": total,
        "passed": sum(ln["status"] == "PASS" for ln in lines),
        "failed": len(failed),
        "skipped": sum(ln["status"] == "SKIP" for ln in lines),
        "lines": lines,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.device.replace(":", "")
    (out / f"gpu_check_{tag}.json").write_text(json.dumps(summary, indent=1, default=float))
    md = [
        f"# GPU check on {env.get('gpu', args.device)}",
        "",
        f"`bash benchmarks/gpu_check.sh --device {args.device}{' --quick' if args.quick else ''}`: "
        f"{summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped in {total:.0f} s "
        f"(Python {env['python_version']}, torch {env['torch']}, CUDA {env['cuda']}, MONAI {env['monai']}, "
        f"NVFlare {env['nvflare']}).",
        "",
        "| status | check | case | detail |",
        "|---|---|---|---|",
    ]
    md += [f"| {ln['status']} | {ln['check']} | {ln['case']} | {ln['detail']} |" for ln in lines]
    (out / f"gpu_check_{tag}.md").write_text("\n".join(md) + "\n")
    print(
        f"{'FAIL' if failed else 'PASS'} gpu check: {summary['passed']} passed, {len(failed)} failed, "
        f"{summary['skipped']} skipped in {total:.0f} s; wrote {out / f'gpu_check_{tag}.md'} and .json"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
