"""The client side: one NVFlare Executor for every method.

Tasks:
- ``data_summary``: validate the site's manifests (every error names the site, file and line) and report the
  per-class annotated counts; runs before any training.
- ``train``: evaluate the received global model on the site's validation (every round) and test data (every
  ``evaluation.test_every`` rounds), run the method's local trainer, send weights + the trainer's meta.
- ``validate``: metrics of a received model on the site's test and validation data (cross-site evaluation).
- ``submit_model``: the site's last local model.

Per-site state (the trainer's state and the last local weights) is saved under the site's run folder after
every round, so a fresh process (simulator ``-t < -n``) continues where the last one stopped.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.app_constant import AppConstants
from nvflare.apis.analytix import AnalyticsDataType

from ..data.manifest import Manifest, read_manifest
from ..data.presets import resolve_dataset
from ..data.site_config import SiteData, resolve_site_data
from ..data.sitedata import SiteDatasets
from ..evaluation import evaluate
from ..metrics import flatten_metrics, format_table
from ..methods import SiteContext, get_method
from ..models import build_model
from .keys import META_ANNOTATED, META_CLASSIFIER_KEYS, META_N_TRAIN, META_RESULTS, META_SUMMARY, META_TEST, STATE_FILE
from .results import method_stats

log = logging.getLogger("fedpartial")


def to_numpy_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (dropout, MixUp draws, ... in the trainers)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_numpy_state(model: torch.nn.Module, weights: dict) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    if missing:
        raise ValueError(f"received model lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict({k: torch.as_tensor(np.asarray(weights[k])).to(own[k].dtype) for k in own})


class PartialLabelExecutor(Executor):
    def __init__(self, dataset: dict | str, model: dict | None = None, method: str = "fedavg",
                 method_args: dict | None = None, train: dict | None = None, evaluation: dict | None = None,
                 seed: int = 0, device: str = "auto", stream_metrics: bool = True):
        super().__init__()
        # constructor args kept as attributes (NVFlare job export reads them back)
        self.dataset, self.model, self.method, self.method_args = dataset, model or {}, method, method_args or {}
        self.train, self.evaluation, self.seed, self.device = train or {}, evaluation or {}, seed, device
        self.stream_metrics = stream_metrics
        self._ready = False

    # ------------------------------------------------------------------------------------------ setup
    def _site_name(self, fl_ctx: FLContext) -> str:
        return fl_ctx.get_identity_name()

    def _setup(self, fl_ctx: FLContext) -> None:
        if self._ready:
            return
        site = self._site_name(fl_ctx)
        self.ds_cfg = resolve_dataset(self.dataset)
        self.task_type, self.classes = self.ds_cfg["task"], list(self.ds_cfg["classes"])
        workspace = fl_ctx.get_engine().get_workspace()
        local_dir = workspace.get_site_config_dir() if hasattr(workspace, "get_site_config_dir") else None
        simulated = bool(fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False))  # real sites need their own data
        self.site_data: SiteData = resolve_site_data(site, self.ds_cfg, local_dir, simulated=simulated)
        if self.site_data.synthetic:
            self.log_warning(fl_ctx, f"*** SYNTHETIC DATA *** site {site} trains on the generated "
                                     f"{self.site_data.dataset} phantom ({self.site_data.origin}), not on real scans")
        trainer_cls, _, defaults = get_method(self.method)
        semi = bool({**defaults, **self.method_args}.get("allow_unlabelled", False))
        read = dict(classes=self.classes, data_root=self.site_data.data_root, site=site, task=self.task_type)
        full = read_manifest(self.site_data.train, require_annotated=not semi, **read)
        self.manifests: dict[str, Manifest] = {"train": full.subset("train")}
        for split in ("val", "test"):
            path = getattr(self.site_data, split)
            if path is not None:
                self.manifests[split] = read_manifest(path, **read)
            elif split in full.splits:  # a hand-written manifest may carry its own val / test rows
                self.manifests[split] = full.subset(split)
        if len(self.manifests["train"]) == 0:
            raise ValueError(f"site '{site}': no training rows in {self.site_data.train}")

        seed_everything(self.seed)
        # MONAI's per-sample augmentations on small tensors are ~10x slower with >1 intra-op thread (measured:
        # 0.6 ms vs 35 ms per RandAffine at 64 px), and simulated sites share the cores: 1 thread by default.
        torch.set_num_threads(int(self.train.get("num_threads", 1)))
        dev = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.torch_device = torch.device(dev)
        self.net = build_model(self.model, len(self.classes)).to(self.torch_device)
        run_dir = Path(workspace.get_run_dir(fl_ctx.get_job_id()))
        self.state_dir = run_dir / "fedpartial_state"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # dataset "cache_dir": a folder shared by runs for "cache": "disk" (decoded images keyed by settings)
        cache = Path(self.ds_cfg["cache_dir"]) if self.ds_cfg.get("cache_dir") else self.state_dir.parent / "cache"
        self.data = SiteDatasets(self.manifests, self.ds_cfg, cache_dir=cache,
                                 num_workers=int(self.train.get("num_workers", 0)))
        site_seed = self.seed * 1000 + (int("".join(ch for ch in site if ch.isdigit()) or 0))
        self.ctx = SiteContext(site=site, task=self.task_type, classes=self.classes,
                               annotated=self.manifests["train"].annotated, model=self.net, data=self.data,
                               device=self.torch_device, state_dir=self.state_dir, train=self.train, seed=site_seed,
                               log=log)
        self.trainer = trainer_cls(self.ctx, **{**defaults, **self.method_args})
        state_file = self.state_dir / STATE_FILE
        if state_file.is_file():
            self.trainer.load_state_dict(torch.load(state_file, map_location="cpu", weights_only=False))
            self.log_info(fl_ctx, f"restored site state from {state_file}")
        self._ready = True

    def _save_state(self) -> None:
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        torch.save(self.trainer.state_dict(), tmp)
        os.replace(tmp, self.state_dir / STATE_FILE)
        torch.save(to_numpy_state(self.net), self.state_dir / "last_local_model.pt")

    # ------------------------------------------------------------------------------------------ tasks
    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        try:
            self._setup(fl_ctx)
            if task_name == "data_summary":
                return self._summary()
            if task_name == AppConstants.TASK_TRAIN:
                return self._train(shareable, fl_ctx, abort_signal)
            if task_name == AppConstants.TASK_VALIDATION:
                return self._validate(shareable, fl_ctx)
            if task_name == AppConstants.TASK_SUBMIT_MODEL:
                return self._submit()
            return make_reply(ReturnCode.TASK_UNKNOWN)
        except Exception as e:  # noqa: BLE001 - reported to the server with the site's name
            msg = f"site '{self._site_name(fl_ctx)}' failed task '{task_name}': {type(e).__name__}: {e}"
            self.log_exception(fl_ctx, msg)
            reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            reply.set_header("error", msg)
            return reply

    def _summary(self) -> Shareable:
        tr = self.manifests["train"]
        info = {"n_train": len(tr), "annotated": tr.annotated.tolist(), "positives": tr.positives().tolist(),
                "negatives": tr.negatives().tolist(), "n_val": len(self.manifests.get("val", ())),
                "n_test": len(self.manifests.get("test", ())), "origin": self.site_data.origin,
                "synthetic": self.site_data.synthetic, "classes": self.classes}
        return DXO(data_kind=DataKind.COLLECTION, data={"summary": info}, meta={META_SUMMARY: info}).to_shareable()

    def _evaluate_split(self, split: str) -> dict | None:
        if split not in self.manifests:
            return None
        loader = self.data.eval_loader(split, batch_size=int(self.evaluation.get("batch_size", 128)))
        return evaluate(self.net, loader, self.task_type, self.classes, self.torch_device)

    def _train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = from_shareable(shareable)
        load_numpy_state(self.net, dxo.data)
        global_meta = dict(dxo.meta or {})
        if META_SUMMARY in global_meta:
            self.ctx.summary = global_meta[META_SUMMARY]
        rnd = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        t0 = time.time()
        results, meta = {}, {}
        val = self._evaluate_split("val")
        if val is not None:
            results["val"] = val
            meta[MetaKey.INITIAL_METRICS] = flatten_metrics(val)
        test_every = int(self.evaluation.get("test_every", 0) or 0)
        if test_every and rnd % test_every == 0:
            test = self._evaluate_split("test")
            if test is not None:
                results["test"] = test
                meta[META_TEST] = flatten_metrics(test)
        self._stream(fl_ctx, results, rnd)
        t_eval = time.time() - t0
        if abort_signal.triggered:
            return make_reply(ReturnCode.TASK_ABORTED)
        seed_everything(self.ctx.seed * 100003 + rnd)  # same draws whichever process runs this round
        out = self.trainer.train_round(rnd, num_rounds, global_meta)
        self._save_state()
        meta.update(out.meta)
        meta.update({
            MetaKey.NUM_STEPS_CURRENT_ROUND: out.steps, META_N_TRAIN: len(self.manifests["train"]),
            META_ANNOTATED: self.ctx.annotated.tolist(), META_CLASSIFIER_KEYS: self.net.classifier_param_names(),
            META_RESULTS: results, "train_loss": out.loss, "eval_seconds": t_eval,
            "train_seconds": time.time() - t0 - t_eval,
        })
        counters = {k: v for k, v in method_stats(out.meta).items() if not isinstance(v, list)}
        self.log_info(fl_ctx, f"round {rnd}: loss {out.loss:.4f} over {out.steps} steps"
                              + (f", val auc (received model) {val['macro'].get('auc')}" if val else "")
                              + "".join(f", {k} {v}" for k, v in counters.items()))
        self._stream(fl_ctx, {}, rnd, {"train/loss": out.loss, **{f"train/{k}": v for k, v in counters.items()}})
        return DXO(data_kind=DataKind.WEIGHTS, data=to_numpy_state(self.net), meta=meta).to_shareable()

    def _validate(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        load_numpy_state(self.net, dxo.data)
        model_name = shareable.get_header(AppConstants.MODEL_OWNER, "?")
        flat, results = {}, {}
        for split in ("test", "val"):
            res = self._evaluate_split(split)
            if res is not None:
                results[split] = res
                flat.update(flatten_metrics(res, prefix=f"{split}_"))
                self.log_info(fl_ctx, "\n" + format_table(res, title=f"{self._site_name(fl_ctx)}: {model_name} on {split}"))
        return DXO(data_kind=DataKind.METRICS, data=flat, meta={META_RESULTS: results}).to_shareable()

    def _submit(self) -> Shareable:
        path = self.state_dir / "last_local_model.pt"
        weights = torch.load(path, weights_only=False) if path.is_file() else to_numpy_state(self.net)
        return DXO(data_kind=DataKind.WEIGHTS, data=weights).to_shareable()

    # ------------------------------------------------------------------------------------------ streaming
    def _stream(self, fl_ctx: FLContext, results: dict, rnd: int, scalars: dict | None = None) -> None:
        """TensorBoard scalars: the metrics of ``results`` (``split/metric``, per-class curves for AUC only) and
        ``scalars`` (``tag -> number``)."""
        if not self.stream_metrics:
            return
        values = dict(scalars or {})
        for split, res in results.items():
            for key, value in flatten_metrics(res).items():
                if "/" not in key or key.startswith("auc/"):
                    values[f"{split}/{key}"] = value
        for tag, value in values.items():
            dxo = create_analytic_dxo(tag=tag, value=float(value), data_type=AnalyticsDataType.SCALAR, global_step=rnd)
            send_analytic_dxo(self, dxo, fl_ctx)

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.END_RUN and self._ready:
            self._ready = False
