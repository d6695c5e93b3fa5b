"""Best-model selection and early stopping on the server.

:class:`ModelSelector` is NVFlare's ``IntimeModelSelector`` over the validation metrics the sites report with
their updates (the received global model, scored before local training), with two additions:

- a site that did not score a validation set this round (evaluation once per image: another site scored the
  shared set) is simply not counted, instead of a warning per site and round;
- ``key_metric: site_bce`` selects the global model with the lowest mean local validation loss, as surgical
  aggregation does: for every site, the binary cross-entropy over ITS annotated classes on its validation set
  (the per-class BCE of the set it holds, scored by whichever site scored it), averaged over the sites
  (:func:`mean_site_loss`).

``patience`` > 0 stops the training workflow (:class:`ScatterAndGather` below) after that many rounds without a
new best; the cross-site evaluation of the last and best global models still runs. ``min_delta`` (default 0): a
round restarts the patience count only when it beats the metric of the last round that restarted it by more than
``min_delta`` (Keras ``EarlyStopping`` semantics; surgical aggregation's released ``federated.py`` stops on the mean
local validation loss with ``patience: 25, min_delta: 1e-4``); the best model is still the best by any margin.
"""

from __future__ import annotations

import math

import numpy as np
from nvflare.apis.controller_spec import ClientTask, Task, TaskCompletionStatus
from nvflare.apis.dxo import MetaKey, from_shareable
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector
from nvflare.app_common.workflows.cross_site_model_eval import CrossSiteModelEval
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather as _ScatterAndGather

from .checkpoint import (
    CHECKPOINT_FILE,
    check_resume,
    config_fingerprint,
    from_safe,
    read_file,
    resume_source,
    run_folder,
    server_checkpoint,
    write_private,
)
from .keys import META_RESULTS
from .scoring import scorer_of

SITE_LOSS = "site_bce"
SIMULATOR_JOB_ID = "simulate_job"  # the job id NVFlare's simulator runs every job under
SIMULATOR_WAIT = 120  # seconds a simulated round waits for its last sites after min_clients - max_missing answered


def mean_site_loss(val: dict[str, dict], sites: dict[str, dict], classes: list[str]) -> float | None:
    """Mean over sites of each site's validation BCE over its own annotated classes.

    Args:
        val: ``{site: validation result}`` of the sites that scored a set this round (``per_class[c]["bce"]``).
        sites: the data summary's ``{site: {"annotated": (C,) bool, "eval_sets": {"val": fingerprint}}}``.
        classes: the class names (column order of ``annotated``).

    A site's loss is the mean of ``bce`` over its annotated classes on its own set: its own result when it
    scored one, else the result of the site that scored the same (shared) set. Sites without a validation set,
    or whose set nobody scored, are left out; None when no site is left.
    """
    losses = []
    for site, info in sorted(sites.items()):
        fp = (info.get("eval_sets") or {}).get("val")
        res = val.get(site) or (val.get(scorer_of("val", fp, sites) or "") if fp else None)
        if not res:
            continue
        own = [res["per_class"][c].get("bce") for c, a in zip(classes, info.get("annotated", ())) if a]
        own = [v for v in own if v is not None and math.isfinite(v)]
        if own:
            losses.append(float(np.mean(own)))
    return float(np.mean(losses)) if losses else None


class ModelSelector(IntimeModelSelector):
    """``IntimeModelSelector`` (same arguments) plus ``key_metric: site_bce`` (lower is better), ``patience``
    (rounds without an improvement of more than ``min_delta`` before :class:`ScatterAndGather` stops; 0: never)
    and ``summary_id`` (the data summary component, for ``site_bce``)."""

    def __init__(
        self,
        key_metric: str = "auc",
        patience: int = 0,
        summary_id: str = "data_summary",
        min_delta: float = 0.0,
        **kwargs,
    ):
        kwargs.setdefault("negate_key_metric", key_metric == SITE_LOSS)
        super().__init__(key_metric=key_metric, **kwargs)
        if min_delta < 0:
            raise ValueError(f"model selector: min_delta must be >= 0, got {min_delta}")
        self.patience, self.summary_id, self.min_delta = int(patience), summary_id, float(min_delta)
        self.best_round: int | None = None
        self.last_round: int | None = None
        self.patience_round: int | None = None  # the last round that improved by more than min_delta
        self.patience_metric: float | None = None  # its metric (higher is better, as best_val_metric)
        self._val: dict[str, dict] = {}

    def _reset_stats(self):
        super()._reset_stats()
        self._val = {}

    def _before_accept(self, fl_ctx: FLContext):
        peer = fl_ctx.get_peer_context()
        try:
            meta = from_shareable(peer.get_prop(FLContextKey.SHAREABLE)).meta or {}
        except Exception:  # noqa: BLE001 - the parent reports a broken update
            return super()._before_accept(fl_ctx)
        if self.key_metric == SITE_LOSS:
            val = (meta.get(META_RESULTS) or {}).get("val")
            if val and fl_ctx.get_prop(AppConstants.CURRENT_ROUND):  # round 0 scores the initial model
                self._val[peer.get_identity_name()] = val
            return bool(val)
        if meta.get(self.validation_metric_name or MetaKey.INITIAL_METRICS) is None:
            return False
        return super()._before_accept(fl_ctx)

    def _before_aggregate(self, fl_ctx: FLContext):
        rnd = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0)
        if self.key_metric == SITE_LOSS and self._val:
            summary = getattr(fl_ctx.get_engine().get_component(self.summary_id), "summary", None) or {}
            loss = mean_site_loss(self._val, summary.get("sites") or {}, list(summary.get("classes") or []))
            if loss is not None:
                self.validation_metric_weighted_sum, self.raw_validation_metric_weighted_sum = -loss, loss
                self.validation_metric_sum_of_weights = 1.0
                self.log_info(fl_ctx, f"round {rnd}: mean local validation loss {loss:.5f}")
        before = self.best_val_metric
        done = super()._before_aggregate(fl_ctx)
        self.note_round(rnd, before)
        return done

    def note_round(self, rnd: int, best_before: float) -> None:
        """Book-keeping after the parent scored round ``rnd`` (``best_val_metric`` was ``best_before``): the best
        round (any improvement) and the round that restarts the patience count (an improvement > ``min_delta``)."""
        if self.best_val_metric > best_before:
            self.best_round = rnd
            if self.patience_metric is None or self.best_val_metric > self.patience_metric + self.min_delta:
                self.patience_round, self.patience_metric = rnd, float(self.best_val_metric)
        self.last_round = rnd

    def should_stop(self) -> bool:
        """True once ``patience`` rounds have passed since the last improvement by more than ``min_delta``."""
        return bool(
            self.patience
            and self.patience_round is not None
            and self.last_round is not None
            and self.last_round - self.patience_round >= self.patience
        )

    def checkpoint_state(self) -> dict:
        """What a resumed job needs to go on selecting (see :mod:`.checkpoint`)."""
        return {
            "best_val_metric": float(self.best_val_metric),
            "best_raw_val_metric": self.best_raw_val_metric,
            "best_round": self.best_round,
            "last_round": self.last_round,
            "patience_round": self.patience_round,
            "patience_metric": self.patience_metric,
        }

    def restore_checkpoint(self, state: dict) -> None:
        self.best_val_metric = float(state["best_val_metric"])
        self.best_raw_val_metric = state.get("best_raw_val_metric")
        self.best_round, self.last_round = state.get("best_round"), state.get("last_round")
        self.patience_round = state.get("patience_round", self.best_round)
        self.patience_metric = state.get(
            "patience_metric", self.best_val_metric if self.best_round is not None else None
        )


class ScatterAndGather(_ScatterAndGather):
    """NVFlare's ScatterAndGather (same arguments) that ends the training phase early when the model selector
    (component ``selector_id``) says so (:meth:`ModelSelector.should_stop`): after the round in which it does,
    no further round starts; the last global model is saved as every round.

    ``min_clients`` is the job's number of sites and ``max_missing`` how many of them may be missing from a round
    (dead, slow past ``train_timeout``, or failed): a round aggregates once ``min_clients - max_missing`` sites
    answered and ``wait_time_after_min_received`` seconds passed (or all answered); in the simulator (job id
    ``simulate_job``) the wait is up to ``SIMULATOR_WAIT`` (120 s) for the last sites, as they may train in turns
    (``-t`` < ``-n``) but cannot die. A deployed round does not wait for a site known to be gone
    (:meth:`gone_sites`): once ``min_clients - max_missing`` sites answered and every site still out is gone, the
    round closes at once instead of after ``wait_time_after_min_received``. ``num_rounds`` < 1 is an error when the
    job is loaded, before any data check or training.

    Checkpoints (:mod:`.checkpoint`): after every round the global model, the round, the best model and the
    state of the components with ``checkpoint_state()`` (aggregator, model selector, results) are written to
    ``<checkpoint_dir>/<run_name>/<job id>/server/checkpoint.pt`` (``checkpoint: false`` turns this off); with
    ``resume: "<job id>"`` the job continues that job's run from its file at the next round (``num_rounds``
    counts all rounds), if the file names that job and this job's configuration; ``resume: true`` continues the
    run of this job's own id (the simulator).
    """

    def __init__(
        self,
        *args,
        selector_id: str = "model_selector",
        max_missing: int = 0,
        checkpoint: bool = True,
        checkpoint_dir: str = "",
        run_name: str = "",
        resume: bool | str = False,
        results_id: str = "results",
        **kwargs,
    ):
        rounds = kwargs.get("num_rounds", 5)
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"num_rounds must be an integer >= 1, got {rounds!r}")
        max_missing = int(max_missing)
        if max_missing < 0:
            raise ValueError(f"max_missing must be >= 0, got {max_missing}")
        sites = kwargs.get("min_clients")
        if sites is not None:
            if max_missing >= int(sites):
                raise ValueError(
                    f"max_missing ({max_missing}) must be smaller than min_clients ({sites}, the job's number of sites)"
                )
            kwargs["min_clients"] = int(sites) - max_missing
        super().__init__(*args, **kwargs)
        # the argument as given (the job's number of sites): NVFlare's job export reads ``min_clients`` before
        # ``_min_clients`` (the answers a round waits for), so an exported and reloaded workflow is the same one
        if sites is not None:
            self.min_clients = int(sites)
        self.selector_id, self.max_missing = selector_id, max_missing
        self.checkpoint, self.checkpoint_dir, self.run_name = bool(checkpoint), checkpoint_dir, run_name
        self.resume, self.results_id = resume, results_id
        self.stopped_early_at: int | None = None
        self.resumed_from: int | None = None
        # the weights sent this round (the model the selector scores), copied when the round starts: NVFlare's
        # shareable generator puts the round's new weights into the same ModelLearnable, so a reference to it held
        # the aggregated model by the time the checkpoint was written (a best model one round too late)
        self._sent: dict | None = None
        self._best: dict | None = None
        self._best_round: int | None = None

    def _folder(self, fl_ctx: FLContext, job_id: str | None = None):
        """The server's checkpoint folder of job ``job_id`` (default: this job)."""
        method = getattr(self.aggregator, "method", "") or "job"
        root = fl_ctx.get_engine().get_workspace().get_root_dir()
        return run_folder(self.checkpoint_dir, root, self.run_name or method, job_id or fl_ctx.get_job_id(), "server")

    def _fingerprint(self, fl_ctx: FLContext) -> str:
        workspace = fl_ctx.get_engine().get_workspace()
        return config_fingerprint(workspace.get_app_config_dir(fl_ctx.get_job_id()))

    def _stateful(self) -> dict:
        ids = (self.aggregator_id, self.selector_id, self.results_id)
        comps = {i: self._engine.get_component(i) for i in ids}
        return {i: c for i, c in comps.items() if c is not None and hasattr(c, "checkpoint_state")}

    def start_controller(self, fl_ctx: FLContext) -> None:
        super().start_controller(fl_ctx)
        source = resume_source(self.resume, fl_ctx.get_job_id())
        if source:
            self._resume(fl_ctx, source)

    def _resume(self, fl_ctx: FLContext, source: str) -> None:
        weights = self._global_weights[ModelLearnableKey.WEIGHTS]
        try:
            folder = self._folder(fl_ctx, source)
            ckpt = read_file(folder / CHECKPOINT_FILE)
            why = check_resume(
                ckpt,
                folder,
                getattr(self.aggregator, "method", ""),
                self._start_round + self._num_rounds,
                weights,
                source,
                self._fingerprint(fl_ctx),
            )
        except ValueError as e:
            why = str(e)
        if why:
            self.system_panic(why, fl_ctx)
            return
        to_np = lambda w: {k: v.numpy() for k, v in w.items()}
        sent_meta = from_safe(ckpt.get("meta") or {})  # the method metadata, stored once: with the model
        self._global_weights = make_model_learnable(to_np(ckpt["weights"]), sent_meta)
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, self._global_weights, private=True, sticky=True)
        for cid, comp in self._stateful().items():
            if cid in ckpt["components"]:
                if cid == self.aggregator_id:
                    comp.restore_checkpoint(ckpt["components"][cid], sent_meta=dict(sent_meta))
                else:
                    comp.restore_checkpoint(ckpt["components"][cid])
        self._best, self._best_round = ckpt.get("best"), ckpt.get("best_round")
        if self._best is not None:  # the persistor writes the best model file of this run
            # the same mask as the property has (private, sticky): NVFlare refuses to change a property's mask,
            # and the persistor then wrote the resumed global model as the best one
            fl_ctx.set_prop(
                AppConstants.GLOBAL_MODEL, make_model_learnable(to_np(self._best), {}), private=True, sticky=True
            )
            self.fire_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, fl_ctx)
            fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, self._global_weights, private=True, sticky=True)
        self.resumed_from = int(ckpt["round"])
        self._current_round = self.resumed_from + 1
        self.log_info(
            fl_ctx,
            f"resuming from the checkpoint of round {self.resumed_from} of job {source} in {folder}: "
            f"training continues at round {self._current_round} of "
            f"{self._start_round + self._num_rounds}",
        )

    def _write_checkpoint(self, fl_ctx: FLContext) -> None:
        rnd = int(self._current_round)
        selector = self._engine.get_component(self.selector_id)
        if selector is not None and getattr(selector, "best_round", None) == rnd and self._sent is not None:
            self._best, self._best_round = self._sent, rnd
        ckpt = server_checkpoint(
            rnd,
            self._start_round + self._num_rounds,
            getattr(self.aggregator, "method", ""),
            self._global_weights[ModelLearnableKey.WEIGHTS],
            self._global_weights.get(ModelLearnableKey.META) or {},
            {i: c.checkpoint_state() for i, c in self._stateful().items()},
            self._best,
            self._best_round,
            fl_ctx.get_job_id(),
            self._fingerprint(fl_ctx),
        )
        folder = self._folder(fl_ctx)
        write_private(ckpt, folder / CHECKPOINT_FILE)
        self.log_info(fl_ctx, f"round {rnd}: checkpoint written to {folder / CHECKPOINT_FILE}")

    def gone_sites(self, task: Task, answered: set[str]) -> list[str] | None:
        """The sites ``task`` (this round's training task) still waits for, if every one of them is known to be
        gone, else None: a site is gone when it has not even fetched the round's task and either sent no update in
        the last round (the aggregator's ``last_missing``) or NVFlare deems it disconnected (a dead job reported
        and its grace period passed). A live site fetches the task within its polling interval, however slow its
        training, so a slow site is waited for as before; a site that dies mid-round (it fetched the task) costs
        that round the full wait, the rounds after it none."""
        rest = [t for t in (task.targets or []) if t not in answered]
        if not rest:
            return None
        fetched = {ct.client.name for ct in task.client_tasks}
        agg = self._engine.get_component(self.aggregator_id) if self._engine else None
        missed = set(getattr(agg, "last_missing", None) or [])
        gone = [t for t in rest if t not in fetched and (t in missed or self.get_client_disconnect_time(t))]
        return gone if len(gone) == len(rest) else None

    def _process_train_result(self, client_task: ClientTask, fl_ctx: FLContext) -> None:
        super()._process_train_result(client_task, fl_ctx)
        task = client_task.task
        if not self.max_missing or fl_ctx.get_job_id() == SIMULATOR_JOB_ID or task.completion_status is not None:
            return
        answered = {ct.client.name for ct in task.client_tasks if ct.result_received_time is not None}
        answered.add(client_task.client.name)
        if len(answered) < self._min_clients:
            return
        gone = self.gone_sites(task, answered)
        if gone:
            self.log_warning(
                fl_ctx,
                f"round {self._current_round}: closing with {len(answered)} update(s), "
                f"without waiting for site(s) {gone}: gone (no update last round or "
                "disconnected, and this round's task never fetched)",
            )
            self.cancel_task(task, completion_status=TaskCompletionStatus.OK, fl_ctx=fl_ctx)

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        super().handle_event(event_type, fl_ctx)
        if event_type == AppEventType.ROUND_STARTED:
            self._sent = dict(self._global_weights[ModelLearnableKey.WEIGHTS])
            if self.max_missing and fl_ctx.get_job_id() == SIMULATOR_JOB_ID:
                # simulated sites cannot die, they answer (an error too), but with -t < -n they train in turns:
                # after min_clients - max_missing answers the round waits for the rest (a failing site still costs
                # only its round), at most SIMULATOR_WAIT seconds: with -t < -n the simulator does not always see
                # "every site answered" (a 20-site run waited for train_timeout, 3600 s, with all 20 answers in)
                self._wait_time_after_min_received = min(self._train_timeout or SIMULATOR_WAIT, SIMULATOR_WAIT)
        if event_type != AppEventType.ROUND_DONE:
            return
        if self.checkpoint:
            try:
                self._write_checkpoint(fl_ctx)
            except Exception as e:  # noqa: BLE001 - a full disk must not stop training; it is logged
                self.log_error(fl_ctx, f"round {self._current_round}: checkpoint not written ({type(e).__name__}: {e})")
        if self.stopped_early_at is not None:
            return
        selector = fl_ctx.get_engine().get_component(self.selector_id)
        if selector is not None and getattr(selector, "should_stop", lambda: False)():
            self.stopped_early_at = self._current_round
            self._num_rounds = self._current_round - self._start_round + 1  # the loop ends after this round
            self.log_info(
                fl_ctx,
                f"early stopping after round {self._current_round}: no validation "
                f"{selector.key_metric} better by more than {getattr(selector, 'min_delta', 0.0)} "
                f"since round {getattr(selector, 'patience_round', selector.best_round)} "
                f"(patience {selector.patience})",
            )


class CrossSiteEval(CrossSiteModelEval):
    """NVFlare's ``CrossSiteModelEval`` (same arguments) that does not wait on a site the training already lost:
    unless ``participating_clients`` is given, the sites that sent nothing in the last training round (dead, slow
    or failed: the aggregator's ``last_missing``) are left out of the final evaluation, with a warning, instead of
    holding it until ``validation_timeout`` (and NVFlare's heartbeat timeout). In the simulator, where a site
    cannot die, such a site was slow and the evaluation waits for it."""

    def __init__(self, *args, aggregator_id: str = "aggregator", **kwargs):
        super().__init__(*args, **kwargs)
        self.aggregator_id = aggregator_id
        self.left_out: list[str] = []

    def start_controller(self, fl_ctx: FLContext):
        given = bool(self._participating_clients)
        super().start_controller(fl_ctx)
        agg = self._engine.get_component(self.aggregator_id)
        lost = set(getattr(agg, "last_missing", None) or [])
        if given or not lost:
            return
        if fl_ctx.get_job_id() == SIMULATOR_JOB_ID:  # simulated sites cannot die: one the last round missed was slow
            self.log_warning(
                fl_ctx,
                f"site(s) {sorted(lost)} sent no update in the last training round (slow: the "
                f"round closed after waiting {SIMULATOR_WAIT} s); the final evaluation waits for them",
            )
            return
        self.left_out = sorted(c for c in self._participating_clients if c in lost)
        self._participating_clients = [c for c in self._participating_clients if c not in lost]
        if self.left_out:
            self.log_warning(
                fl_ctx,
                f"final evaluation WITHOUT site(s) {self.left_out}: no update from them in the "
                "last training round (dead, slow or failed)",
            )
