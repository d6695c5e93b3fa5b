"""Is the ICH phantom learnable, but not trivially? A central, fully labelled baseline.

Generates the phantom (RSNA layout, real DICOM), reads every slice through the same DICOM -> HU -> 3 CT windows
path as the data pipeline, downsizes to ``--input-size``, splits by patient 70/10/20 and trains
``PartialLabelNet("small_cnn", 5, 3)`` with BCE on all labels. Prints the test per-class and macro ROC AUC
(checkpoint of the best validation macro AUC) and a final JSON line. Target: macro AUC about 0.87-0.95.

    python benchmarks/phantom_learnability.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from fedpartial.data.catalog.ich.phantom import load_ich_phantom
from fedpartial.data.dicom import apply_windows, read_dicom_hu
from fedpartial.models import PartialLabelNet


def load_images(table, input_size: int) -> np.ndarray:
    """All slices as ``(N, 3, input_size, input_size)`` float32 windows in [0, 1]."""
    out = []
    for rel in table.frame["image"]:
        x = torch.from_numpy(apply_windows(read_dicom_hu(table.root / rel)))[None]
        out.append(F.interpolate(x, size=(input_size, input_size), mode="area")[0].numpy())
    return np.stack(out).astype(np.float32)


def patient_split(patients: np.ndarray, seed: int, fractions=(0.7, 0.1, 0.2)) -> list[np.ndarray]:
    """Row indices of train / val / test, no patient in two splits."""
    uniq = np.random.default_rng(seed).permutation(np.unique(patients))
    cuts = np.round(np.cumsum(fractions)[:-1] * len(uniq)).astype(int)
    groups = np.split(uniq, cuts)
    return [np.flatnonzero(np.isin(patients, g)) for g in groups]


@torch.no_grad()
def predict(model: torch.nn.Module, x: np.ndarray, batch: int = 256) -> np.ndarray:
    model.eval()
    return np.concatenate(
        [torch.sigmoid(model(torch.from_numpy(x[i : i + batch]))).numpy() for i in range(0, len(x), batch)]
    )


def aucs(y: np.ndarray, p: np.ndarray, classes: list[str]) -> dict[str, float]:
    out = {
        c: float(roc_auc_score(y[:, j], p[:, j])) if 0 < y[:, j].sum() < len(y) else float("nan")
        for j, c in enumerate(classes)
    }
    out["macro"] = float(np.nanmean([out[c] for c in classes]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-images", type=int, default=3000)
    ap.add_argument("--size", type=int, default=128, help="phantom DICOM size (pixels)")
    ap.add_argument("--seed", type=int, default=0, help="phantom seed")
    ap.add_argument("--data-dir", default=None, help="where the phantom goes (default: a folder in the temp dir)")
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results JSON here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.train_seed)
    t0 = time.time()
    data_dir = Path(
        args.data_dir
        or Path(tempfile.gettempdir()) / "fedpartial_phantom_bench" / f"n{args.n_images}_s{args.size}_seed{args.seed}"
    )
    table = load_ich_phantom(data_dir, n_images=args.n_images, size=args.size, seed=args.seed)
    t_gen = time.time() - t0
    x = load_images(table, args.input_size)
    y = table.frame[table.classes].to_numpy(np.float32)
    t_data = time.time() - t0
    tr, va, te = patient_split(table.frame["patient_id"].to_numpy(), args.train_seed)
    print(
        f"data: {len(x)} slices, {table.frame['patient_id'].nunique()} patients, train/val/test "
        f"{len(tr)}/{len(va)}/{len(te)}; prevalence {dict(zip(table.classes, y.mean(0).round(3)))}; "
        f"phantom {t_gen:.1f}s, windows {t_data - t_gen:.1f}s",
        flush=True,
    )

    model = PartialLabelNet("small_cnn", len(table.classes), 3)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.train_seed)
    xt, yt = torch.from_numpy(x[tr]), torch.from_numpy(y[tr])
    best, best_state, best_epoch = -1.0, None, 0
    for epoch in range(1, args.epochs + 1):
        model.train()
        perm, losses = torch.randperm(len(tr), generator=gen), []
        for i in range(0, len(tr), args.batch_size):
            idx = perm[i : i + args.batch_size]
            xb = xt[idx]
            flip = torch.rand(len(idx), generator=gen) < 0.5  # left-right flip: anatomy is symmetric
            xb = torch.where(flip[:, None, None, None], xb.flip(-1), xb)
            loss = F.binary_cross_entropy_with_logits(model(xb), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        val = aucs(y[va], predict(model, x[va]), table.classes)
        if val["macro"] > best:
            best, best_epoch = val["macro"], epoch
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        print(
            f"epoch {epoch:2d}  loss {np.mean(losses):.4f}  val macro AUC {val['macro']:.4f}  "
            f"({time.time() - t0:.0f}s)",
            flush=True,
        )
    last = aucs(y[te], predict(model, x[te]), table.classes)
    model.load_state_dict(best_state)
    test = aucs(y[te], predict(model, x[te]), table.classes)
    wall = time.time() - t0
    print(f"\ntest AUC (best val epoch {best_epoch}):")
    for c in table.classes:
        print(f"  {c:18s} {test[c]:.4f}  (positives {int(y[te][:, table.classes.index(c)].sum())})")
    print(f"  {'macro':18s} {test['macro']:.4f}   (last epoch: {last['macro']:.4f}); wall {wall:.0f}s")
    result = {
        "test_auc": test,
        "test_auc_last_epoch": last,
        "val_macro_auc": best,
        "best_epoch": best_epoch,
        "n_train": len(tr),
        "n_val": len(va),
        "n_test": len(te),
        "phantom_s": round(t_gen, 1),
        "wall_s": round(wall, 1),
        "args": vars(args),
    }
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
