"""The client side: one NVFlare Executor for every method.

Tasks:
- ``data_summary``: validate the site's configuration and manifests (every error names the site, file and line),
  check that the site runs the job the server runs (method, method options, model: the server sends its spec),
  and report the per-class annotated counts; runs before any training.
- ``train``: the method's :meth:`~fedpartial.methods.LocalTrainer.receive` loads the global model, which is
  evaluated on the site's validation (every round) and test data (every ``evaluation.test_every`` rounds);
  then the local trainer runs and :meth:`~fedpartial.methods.LocalTrainer.export` gives what is sent, with the
  trainer's meta and its participation weight.
- ``validate``: metrics of a received model (loaded through the same ``receive`` hook, so parts a method keeps
  local, e.g. FedBN's norm layers, are the site's own) on the site's test and validation data.
- ``submit_model``: the site's last local model.

Evaluation once per image: each site reports a fingerprint of its validation and test sets in the data summary;
when several sites hold the same set (the simulator's shared splits) only the first of them by name scores it,
so the server's pooled numbers count each image once. A site with its own evaluation data always scores it, and
when the method keeps parts of the model local (FedBN, PFL) every site scores its own model on its own sets.

Per-site state (the trainer's state and the last local weights) is saved atomically under the site's run
folder after every round and loaded with ``weights_only=True``, so a fresh process (simulator ``-t < -n``)
continues where the last one stopped.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from nvflare.apis.analytix import AnalyticsDataType
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.apis.utils.analytix_utils import create_analytic_dxo, send_analytic_dxo
from nvflare.app_common.app_constant import AppConstants

from ..data.manifest import Manifest, read_manifest
from ..data.presets import resolve_dataset
from ..data.site_config import SiteData, SiteDataError, resolve_site_data
from ..data.sitedata import SiteDatasets
from ..data.store import StoreError
from ..device import describe, device_record, mixed_precision, resolve_device
from ..evaluation import evaluate, evaluate_features
from ..job_layout import DATA_CHECK_TIMEOUT
from ..methods import SiteContext, TrainOptions, get_method
from ..methods.base import local_work
from ..metrics import apply_validation_thresholds, flatten_metrics, format_table
from ..models import build_model, default_inference_batch_size, numpy_state, start_normalisation
from ..options import build, opt
from ..privacy import DEFAULT_MIN_COUNT, as_dicts, strip_paths, suppress_metrics, suppress_small
from ..seeding import round_seed, seed_everything, set_deterministic, site_seed
from .checkpoint import read_file, resume_source, run_folder, site_state_file, write_private
from .keys import (
    LOCAL_MODEL_FILE,
    META_ANNOTATED,
    META_GROUPS,
    META_N_TRAIN,
    META_PRIVACY,
    META_RESULTS,
    META_SPEC,
    META_SUMMARY,
    META_TEST,
    META_WEIGHT,
    STATE_DIR,
    STATE_FILE,
)
from .privacy import apply_policy, check_method_under_policy, effective_min_count, job_or_site_policy, suppress_summary
from .results import method_stats
from .scoring import scorer_of
from .spec import job_spec, spec_mismatch

log = logging.getLogger("fedpartial")
SUMMARY_FILE = "data_summary.json"  # the summary the server sent this site (with every task; kept for a new process)


@dataclass
class EvalOptions:
    """The ``evaluation`` section of a job."""

    test_every: int = opt(0, "score the received model on the site's test data every N rounds (0: never)")
    batch_size: int | None = opt(
        None,
        "evaluation batch size (default: the training batch size on a CPU, 4 x it on "
        "a GPU: models.default_inference_batch_size)",
    )


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file, then rename: a crash never leaves a half-written state file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class PartialLabelExecutor(Executor):
    def __init__(
        self,
        dataset: dict | str,
        model: dict | None = None,
        method: str = "fedavg",
        method_args: dict | None = None,
        train: dict | None = None,
        evaluation: dict | None = None,
        seed: int = 0,
        device: str = "auto",
        stream_metrics: bool = True,
        checkpoint: bool = True,
        checkpoint_dir: str = "",
        run_name: str = "",
        resume: bool | str = False,
        min_count: int = DEFAULT_MIN_COUNT,
        privacy: dict | None = None,
        deterministic: bool = False,
    ):
        super().__init__()
        # constructor args kept as attributes (NVFlare job export reads them back)
        self.dataset, self.model, self.method, self.method_args = dataset, model or {}, method, method_args or {}
        self.train, self.evaluation, self.seed, self.device = train or {}, evaluation or {}, seed, device
        self.stream_metrics = stream_metrics
        self.checkpoint, self.checkpoint_dir, self.run_name, self.resume = checkpoint, checkpoint_dir, run_name, resume
        self.min_count = int(min_count)  # the job's minimum count; a site's privacy scope may raise it
        self.privacy = privacy or {}  # the job's privacy properties, used where the site has no policy (simulator)
        self.deterministic = deterministic  # reproducible CUDA kernels (fedpartial.seeding.set_deterministic)
        self.resume_folder: Path | None = None
        self._ready = False

    # ------------------------------------------------------------------------------------------ setup
    def _site_name(self, fl_ctx: FLContext) -> str:
        return fl_ctx.get_identity_name()

    def _setup(self, fl_ctx: FLContext) -> None:
        if self._ready:
            return
        site = self._site_name(fl_ctx)
        where = f"job '{self._job_name(fl_ctx)}', site '{site}', executor"
        self._check_options(where)
        # the site's privacy policy for this job (NVFlare scope), or the job's own properties where it has none
        self.scope, self.site_privacy, self._apply_policy = job_or_site_policy(fl_ctx, self.privacy)
        self.min_count_eff = effective_min_count(self.min_count, self.site_privacy)
        self._z_cache: dict = {}
        started = time.monotonic()
        self._resolve_data(fl_ctx, site)
        self._read_manifests(site)
        self._open_data(fl_ctx, site, started)
        self._select_device(fl_ctx, site)
        self._build_model()
        self._build_trainer(fl_ctx, site, where)
        self._restore_state(fl_ctx)
        if (self.state_dir / SUMMARY_FILE).is_file():
            self.ctx.summary = json.loads((self.state_dir / SUMMARY_FILE).read_text())
        self._ready = True

    @staticmethod
    def _job_name(fl_ctx: FLContext) -> str:
        meta = fl_ctx.get_prop(FLContextKey.JOB_META) or {}
        return str(meta.get("name") or fl_ctx.get_job_id() or "?")

    def _check_options(self, where: str) -> None:
        """Typed ``train`` / ``evaluation`` options and the method's options (unknown keys are errors)."""
        self.method_spec = get_method(self.method)
        self.train_opts = build(TrainOptions, self.train, f"{where} 'train'")
        self.eval_opts = build(EvalOptions, self.evaluation, f"{where} 'evaluation'")
        self.trainer_args, _ = self.method_spec.split_options(self.method_args, where)

    def _resolve_data(self, fl_ctx: FLContext, site: str) -> None:
        ds = resolve_dataset(self.dataset, f"job '{self._job_name(fl_ctx)}', site '{site}' 'dataset'")
        self.ds_cfg = start_normalisation(ds, self.model, int(ds["channels"]))  # as the model's start expects
        self.task_type, self.classes = self.ds_cfg["task"], list(self.ds_cfg["classes"])
        workspace = fl_ctx.get_engine().get_workspace()
        local_dir = workspace.get_site_config_dir() if hasattr(workspace, "get_site_config_dir") else None
        simulated = bool(fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False))  # real sites need their own data
        self.site_data: SiteData = resolve_site_data(site, self.ds_cfg, local_dir, simulated=simulated)
        if self.site_data.synthetic:
            self.log_warning(
                fl_ctx,
                f"*** SYNTHETIC DATA *** site {site} trains on the generated "
                f"{self.site_data.dataset} phantom ({self.site_data.origin}), not on real scans",
            )
        self.state_dir = Path(workspace.get_run_dir(fl_ctx.get_job_id())) / STATE_DIR
        self.state_dir.mkdir(parents=True, exist_ok=True)
        run = (self.checkpoint_dir, workspace.get_root_dir(), self.run_name or self.method)
        self.checkpoint_folder = run_folder(*run, fl_ctx.get_job_id(), site)  # this job's states (fl/checkpoint.py)
        source = resume_source(self.resume, fl_ctx.get_job_id())
        self.resume_folder = run_folder(*run, source, site) if source else None  # the states of the run it continues

    def _read_manifests(self, site: str) -> None:
        """Train / val / test manifests; a site without any annotation only where the method accepts it."""
        unlabelled_ok = self.method_spec.trainer.accepts_unlabelled
        read = dict(
            classes=self.classes,
            data_root=self.site_data.data_root,
            site=site,
            task=self.task_type,
            duplicates="error",  # one row per image; decoded once, into the image store (_open_data)
            **self.site_data.vocabulary,
        )  # the site's own column names mapped to the job's classes
        full = read_manifest(self.site_data.train, require_annotated=not unlabelled_ok, **read)
        self.manifests: dict[str, Manifest] = {"train": full.subset("train")}
        for split in ("val", "test"):
            path = getattr(self.site_data, split)
            if path is not None:
                self.manifests[split] = read_manifest(path, require_annotated=not unlabelled_ok, **read)
            elif split in full.splits:  # a hand-written manifest may carry its own val / test rows
                self.manifests[split] = full.subset(split)
        if len(self.manifests["train"]) == 0:
            raise ValueError(f"site '{site}': no training rows in {self.site_data.train}")

    def _open_data(self, fl_ctx: FLContext, site: str, started: float) -> None:
        """The site's datasets over its image stores (``dataset.cache``, :mod:`fedpartial.data.sitedata`): opened
        when current (no image decoded: sizes and mtimes against the index), else built (every core, ``k / N``
        lines in the site's log) when that fits in what is left of the data check's time, else one line naming
        the command that builds them before the job (``fedpartial-store``). A bad image is an error at its line."""

        self.data = SiteDatasets(
            self.manifests,
            self.ds_cfg,
            num_workers=self.train_opts.num_workers,
            log_fn=lambda m: self.log_info(fl_ctx, f"site {site}: {m}"),
        )
        budget = 0.8 * DATA_CHECK_TIMEOUT - (time.monotonic() - started)
        try:
            self.data.open_stores(budget_s=budget)
        except StoreError as e:
            raise SiteDataError(f"site '{site}': {e}") from None

    def _select_device(self, fl_ctx: FLContext, site: str) -> None:
        """The training device (``device``: auto / cpu / cuda[:N]; cuda without a GPU is an error naming the
        site), the ``deterministic`` settings, one log line naming both; the record goes to ``results.json``."""
        self.torch_device, fallback = resolve_device(self.device, f"site '{site}'")
        if fallback:
            self.log_warning(fl_ctx, fallback)
        set_deterministic(bool(self.deterministic))
        self.device_info = device_record(self.torch_device, self.train_opts.amp, bool(self.deterministic))
        self.log_info(fl_ctx, f"site {site}: {describe(self.device_info)}")

    def _build_model(self) -> None:
        # MONAI's per-sample augmentations on small tensors are much slower with >1 intra-op thread
        # (benchmarks/local_round_speed.py --views per_sample), and simulated sites share the cores: 1 thread by default.
        torch.set_num_threads(self.train_opts.num_threads)
        seed_everything(self.seed)
        # model.pretrained (a warm-start encoder, ImageNet weights) fills the server's initial global model, which
        # every site receives before it trains: a site does not read the file (a hospital need not hold it)
        cfg = {k: v for k, v in self.model.items() if k != "pretrained"}
        self.net = build_model(cfg, len(self.classes), where="executor 'model'").to(self.torch_device)
        self.net.pretrained = self.model.get("pretrained")  # what methods read (surgical: keep its norm statistics)
        if self.train_opts.channels_last:  # conv weights (and so activations) channels-last: faster convs and pooling
            self.net = self.net.to(memory_format=torch.channels_last)

    def _train_round(self, rnd: int, num_rounds: int, global_meta: dict):
        """The method's local round, under bfloat16 autocast with ``train.amp`` (a GPU's mixed precision; bfloat16
        needs no loss scaling, and the same call runs on a CPU)."""
        with mixed_precision(self.torch_device.type, self.train_opts.amp):
            return self.trainer.train_round(rnd, num_rounds, global_meta)

    def _build_trainer(self, fl_ctx: FLContext, site: str, where: str) -> None:
        self.train_opts, note = local_work(self.train_opts, len(self.manifests["train"]))
        if note:
            self.log_warning(fl_ctx, f"site {site}: {note}")
        self.ctx = SiteContext(
            site=site,
            task=self.task_type,
            classes=self.classes,
            annotated=self.manifests["train"].annotated,
            model=self.net,
            data=self.data,
            device=self.torch_device,
            state_dir=self.state_dir,
            train=self.train_opts,
            seed=site_seed(self.seed, site),
            log=log,
            privacy={k: v for k, v in self.site_privacy.items() if k == "feature_clip"},
        )
        self.trainer = self.method_spec.make_trainer(self.ctx, self.method_args, where)
        self._fingerprints: dict[str, str] = {}

    def _restore_state(self, fl_ctx: FLContext) -> None:
        """The trainer's state and the site's last local model (its local parts, e.g. FedBN's norm layers), when
        an earlier process of this run saved them; a corrupt or mismatched file gives a warning and a fresh start."""
        for name, restore in ((STATE_FILE, self.trainer.load_state_dict), (LOCAL_MODEL_FILE, self._load_local)):
            path = self.state_dir / name
            if not path.is_file():
                continue
            try:
                restore(torch.load(path, map_location="cpu", weights_only=True))
                self.log_info(fl_ctx, f"restored site state from {path.name}")
            except Exception as e:  # noqa: BLE001 - a bad file must not stop the site
                self.log_warning(
                    fl_ctx,
                    f"ignoring unusable state file {path.name} ({type(e).__name__}: {e}); "
                    "starting this part of the site state afresh",
                )

    def _load_local(self, state: dict) -> None:
        self.net.load_state_dict({k: v.to(self.net.state_dict()[k].dtype) for k, v in state.items()})
        self.trainer.has_local_state = True

    def _save_state(self, rnd: int) -> None:
        trainer, local = self.trainer.state_dict(), self.net.state_dict()
        save_atomic(trainer, self.state_dir / STATE_FILE)
        save_atomic(local, self.state_dir / LOCAL_MODEL_FILE)
        if self.checkpoint:  # outlives the job, for a resumed one (see fl/checkpoint.py)
            write_private(
                {"round": rnd, "method": self.method, "trainer": trainer, "local": local},
                self.checkpoint_folder / site_state_file(rnd),
            )
            for old in self.checkpoint_folder.glob(site_state_file("*")):  # keep this round's and the one before:
                if old.name not in (site_state_file(rnd), site_state_file(rnd - 1)):  # the server may have died
                    old.unlink(missing_ok=True)  # before aggregating this one

    def _adopt_checkpoint(self, fl_ctx: FLContext, rnd: int) -> None:
        """In a resumed job, a site whose run has no state yet takes the state it saved after round ``rnd - 1``
        (the last round the server's checkpoint holds); a state of another round or method gives a warning and a
        fresh state."""
        if (self.state_dir / STATE_FILE).is_file() or rnd == 0:
            return
        name = site_state_file(rnd - 1)
        try:
            saved = read_file(self.resume_folder / name)
        except ValueError as e:
            self.log_warning(fl_ctx, f"resume: {self._relative(str(e))}; this site starts with a fresh state")
            return
        if saved is None or saved.get("round") != rnd - 1 or saved.get("method") != self.method:
            found = "no such file" if saved is None else f"round {saved.get('round')}, method {saved.get('method')!r}"
            have = sorted(f.name for f in self.resume_folder.glob(site_state_file("*")))
            self.log_warning(
                fl_ctx,
                f"resume: the job continues at round {rnd} and needs this site's {name} "
                f"({found}; the folder holds {have or 'nothing'}); this site starts with a "
                "fresh state",
            )
            return
        save_atomic(saved["trainer"], self.state_dir / STATE_FILE)
        save_atomic(saved["local"], self.state_dir / LOCAL_MODEL_FILE)
        self._restore_state(fl_ctx)
        self.log_info(fl_ctx, f"resume: adopted this site's state saved after round {rnd - 1}")

    # ------------------------------------------------------------------------------------------ tasks
    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        try:
            self._ws_root = fl_ctx.get_engine().get_workspace().get_root_dir()
        except Exception:  # noqa: BLE001
            self._ws_root = None
        try:
            self._setup(fl_ctx)
            if task_name == "data_summary":
                return self._summary(shareable, fl_ctx)
            if task_name == AppConstants.TASK_TRAIN:
                return self._train(shareable, fl_ctx, abort_signal)
            if task_name == AppConstants.TASK_VALIDATION:
                return self._validate(shareable, fl_ctx)
            if task_name == AppConstants.TASK_SUBMIT_MODEL:
                return self._submit()
            return make_reply(ReturnCode.TASK_UNKNOWN)
        except Exception as e:  # noqa: BLE001 - reported to the server with the site's name
            msg = self._relative(f"site '{self._site_name(fl_ctx)}' failed task '{task_name}': {type(e).__name__}: {e}")
            log.info("site traceback (kept local)", exc_info=True)  # error_log.txt reaches the server: no paths there
            self.log_error(fl_ctx, msg)
            reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            reply.set_header("error", msg)
            return reply

    def _relative(self, text: str) -> str:
        """``text`` with paths under the site's data root, its site-config folder and its kit made relative to
        them (``<site>/local/...``), and any other absolute path cut to its file name: what leaves the site
        names files, never where they live (:func:`fedpartial.privacy.strip_paths`)."""
        roots: set[str] = set()
        sd = getattr(self, "site_data", None)
        if sd is not None:
            roots |= {str(sd.data_root), str(Path(sd.data_root).resolve())}
            cfg = str(sd.origin).split(":", 1)[-1]
            roots |= {str(Path(cfg).parent), str(Path(cfg).resolve().parent)} if cfg else set()
        ws = getattr(self, "_ws_root", None)
        if ws:  # the folder holding the site's kit: "hospital-2/local/fedpartial_data.json"
            roots |= {str(Path(ws).parent), str(Path(ws).resolve().parent)}
        return strip_paths(text, sorted(roots))

    @staticmethod
    def _check_received(weights) -> None:
        """Refuse a global model with non-finite values before it touches the local model."""
        bad = [
            k
            for k, v in (weights or {}).items()
            if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.all(np.isfinite(np.asarray(v)))
        ]
        if bad:
            raise ValueError(
                f"refusing the received global model: non-finite values in {len(bad)} tensor(s), e.g. "
                f"{bad[:3]}; the local model and state are kept"
            )

    def _summary(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        server_spec = shareable.get(META_SPEC)
        if server_spec is not None:
            mine = job_spec(self.method, self.method_args, self.model)
            why = spec_mismatch(server_spec, mine)
            if why:
                raise ValueError(
                    f"this site's job configuration differs from the server's: {why}. Both come from "
                    "the same job folder; rebuild or resubmit the job instead of editing one side"
                )
        check_method_under_policy(
            self.trainer.per_class_metadata, self.site_privacy, self.method, self.ctx.site, self.scope
        )
        tr = self.manifests["train"]
        info = {
            "n_train": len(tr),
            "annotated": tr.annotated.tolist(),
            "positives": tr.positives().tolist(),
            "negatives": tr.negatives().tolist(),
            "n_val": len(self.manifests.get("val", ())),
            "n_test": len(self.manifests.get("test", ())),
            "origin": self.site_data.origin.split(":", 1)[0],  # the kind only, no path
            "synthetic": self.site_data.synthetic,
            "classes": self.classes,
            "eval_sets": {s: m.fingerprint() for s, m in self.manifests.items() if s != "train"},
            "train_set": tr.fingerprint(),  # the server warns when two sites train on the same rows
            "source": self.site_data.source,  # the source's name, the export's file name, its fingerprint
            "vocabulary": self.site_data.vocabulary,
        }
        info = suppress_summary(info, self.min_count_eff)  # small counts stay here (also in the server's table)
        return DXO(data_kind=DataKind.COLLECTION, data={"summary": info}, meta={META_SUMMARY: info}).to_shareable()

    def _job_policy(self, meta: dict, fl_ctx: FLContext) -> dict:
        """The job's own privacy properties applied here, where the site has no policy (the simulator)."""
        if not self._apply_policy:
            return meta
        return apply_policy(meta, self.site_privacy, self.scope, self.ctx.site, self._z_cache)[0]

    def scores(self, split: str) -> bool:
        """Whether this site scores ``split`` (see the module docstring: evaluation once per image)."""
        m = self.manifests.get(split)
        if m is None or not m.annotated.any():  # nothing to score on an unlabelled split
            return False
        summary = self.ctx.summary or {}
        if self.trainer.local_keys or not summary:  # each site's own model, or no summary (yet): score it here
            return True
        if "scores" in summary:  # the server tells each site which of its sets it scores (fl/data_check.py)
            return bool(summary["scores"].get(split, True))
        sites = summary.get("sites") or {}
        if not sites:
            return True
        if split not in self._fingerprints:
            self._fingerprints[split] = m.fingerprint()
        return scorer_of(split, self._fingerprints[split], sites) in (None, self.ctx.site)

    def _evaluate_split(self, split: str) -> dict | None:
        if not self.scores(split):
            return None
        bs = self.eval_opts.batch_size or default_inference_batch_size(self.train_opts.batch_size, self.torch_device)
        loader = self.data.eval_loader(split, batch_size=bs, device=self.torch_device)
        score = getattr(getattr(self, "trainer", None), "score_probabilities", None)  # no trainer yet: classifier
        if score is not None:  # scored from the features (the trainer's vote)
            res = evaluate_features(self.net, loader, self.task_type, self.classes, score, self.torch_device)
        else:
            res = evaluate(self.net, loader, self.task_type, self.classes, self.torch_device)
        m = self.manifests[split]  # per-class metrics from fewer than min_count positives / negatives stay here
        res, _ = suppress_metrics(res, m.positives(), m.negatives(), self.min_count_eff)
        return res

    def _site_thresholds(self, results: dict) -> dict:
        """Without score histograms (``score_histograms: false`` in the site's privacy scope): the site chooses
        its per-class thresholds on its own validation result and scores its sets at them
        (``*_val_thr`` metrics); the histograms stay here."""
        if self.site_privacy.get("score_histograms", True) or not results:
            return results
        return apply_validation_thresholds({self.ctx.site: results})[0][self.ctx.site]

    def _privacy_entry(self, meta: dict, rnd: int, num_rounds: int) -> tuple[dict, dict | None]:
        """The method's declared per-class statistics with the minimum count applied (before any noise: the
        site's privacy filter adds it, and thresholds after it), and the round's privacy ledger entry."""
        stats = self.trainer.per_class_metadata
        if not stats:
            return meta, None
        mc = self.min_count_eff
        if "epsilon" not in self.site_privacy:
            meta, _ = suppress_small(meta, stats, mc, support=self.manifests["train"].positives())
        released = [
            {
                "name": s.key,
                "shape": list(np.shape(meta[s.key])),
                "min_count": mc,
                "noise_std": 0.0,
                "noise_multiplier": 0.0,
                "sensitivity": None,
            }
            for s in stats
            if s.key in meta
        ]
        return meta, {
            "round": rnd,
            "num_rounds": num_rounds,
            "scope": self.scope,
            "min_count": mc,
            "declared": as_dicts(stats),
            "released": released,
        }

    def _train(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        dxo = from_shareable(shareable)
        self._check_received(dxo.data)
        rnd = int(shareable.get_header(AppConstants.CURRENT_ROUND, 0))
        if self.resume_folder is not None:
            self._adopt_checkpoint(fl_ctx, rnd)
        self.trainer.receive(dxo.data)
        global_meta = dict(dxo.meta or {})
        if META_SUMMARY in global_meta and global_meta[META_SUMMARY] != self.ctx.summary:
            self.ctx.summary = global_meta[META_SUMMARY]
            (self.state_dir / SUMMARY_FILE).write_text(json.dumps(self.ctx.summary))
        num_rounds = int(shareable.get_header(AppConstants.NUM_ROUNDS, 1))
        t0 = time.time()
        results, meta = {}, {}
        val = self._evaluate_split("val")
        if val is not None:
            results["val"] = val
            meta[MetaKey.INITIAL_METRICS] = flatten_metrics(val)
        test_every = self.eval_opts.test_every
        if test_every and rnd % test_every == 0:
            test = self._evaluate_split("test")
            if test is not None:
                results["test"] = test
                meta[META_TEST] = flatten_metrics(test)
        self._stream(fl_ctx, results, rnd)
        results = self._site_thresholds(results)
        t_eval = time.time() - t0
        if abort_signal.triggered:
            return make_reply(ReturnCode.TASK_ABORTED)
        seed_everything(round_seed(self.ctx.seed, rnd))  # same draws whichever process runs this round
        out = self._train_round(rnd, num_rounds, global_meta)
        self.trainer.has_local_state = True
        self._save_state(rnd)
        out_meta, entry = self._privacy_entry(dict(out.meta), rnd, num_rounds)
        meta.update(out_meta)
        if entry is not None:
            meta[META_PRIVACY] = entry
        meta.update(
            {
                MetaKey.NUM_STEPS_CURRENT_ROUND: out.steps,
                META_N_TRAIN: len(self.manifests["train"]),
                META_ANNOTATED: self.ctx.annotated.tolist(),
                META_GROUPS: self.net.parameter_groups(),
                META_WEIGHT: float(out.weight),
                META_RESULTS: results,
                "train_loss": out.loss,
                "eval_seconds": t_eval,
                "device": self.device_info,
                "train_seconds": time.time() - t0 - t_eval,
            }
        )
        counters = {k: v for k, v in method_stats(out.meta).items() if not isinstance(v, list)}
        knn = ", kNN on its features" if self.trainer.score_probabilities is not None else ""
        self.log_info(
            fl_ctx,
            f"round {rnd}: loss {out.loss:.4f} over {out.steps} steps"
            + (" (sits this round out)" if out.weight == 0 else "")
            + (f", val auc (received model{knn}) {val['macro'].get('auc')}" if val else "")
            + "".join(f", {k} {v}" for k, v in counters.items()),
        )
        self._stream(fl_ctx, {}, rnd, {"train/loss": out.loss, **{f"train/{k}": v for k, v in counters.items()}})
        return DXO(
            data_kind=DataKind.WEIGHTS, data=self.trainer.export(), meta=self._job_policy(meta, fl_ctx)
        ).to_shareable()

    def _validate(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        self._check_received(dxo.data)
        self.trainer.receive(dxo.data)
        if META_SUMMARY in (dxo.meta or {}):
            self.ctx.summary = dxo.meta[META_SUMMARY]
        model_name = shareable.get_header(AppConstants.MODEL_OWNER, "?")
        flat, results = {}, {}
        for split in ("test", "val"):
            res = self._evaluate_split(split)
            if res is not None:
                results[split] = res
                flat.update(flatten_metrics(res, prefix=f"{split}_"))
                self.log_info(
                    fl_ctx, "\n" + format_table(res, title=f"{self._site_name(fl_ctx)}: {model_name} on {split}")
                )
        results = self._site_thresholds(results)
        return DXO(
            data_kind=DataKind.METRICS, data=flat, meta=self._job_policy({META_RESULTS: results}, fl_ctx)
        ).to_shareable()

    def _submit(self) -> Shareable:
        path = self.state_dir / LOCAL_MODEL_FILE
        state = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else self.net.state_dict()
        return DXO(data_kind=DataKind.WEIGHTS, data=numpy_state(state)).to_shareable()

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
