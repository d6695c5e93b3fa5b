"""The server side of every method as one NVFlare ``Aggregator``: collect the sites' updates, refuse broken
ones, and hand the rest to the method's :class:`~fedpartial.methods.ServerRule`.

An update is refused (and the round goes on without it) when it is from another round, is not full weights,
or has missing / extra tensors, wrong shapes or dtypes or non-finite values, or when its sample count is not a
positive integer no larger than the training-set size the site reported in the data check (a site absent from
the data check is refused too). Before the rule sees them, each update is checked against the global model; the other updates
of the round only ever keep an update the direction check would refuse (so the checks mean the same with 2, 3 or 50
contributors):

- size: a site whose change of some tensor exceeds ``max_change_ratio`` times that tensor's last global step
  (in the first round of a run: its own norm in the global model; with floors for tensors that barely move, see
  :func:`fedpartial.aggregation.change_scale`) is refused (``on_large_change: reject``) or has that change
  scaled down to the bound (``clip``);
- direction: from the second round of a run on, a site whose whole change points against the model's last
  global step (cosine below ``min_cosine``, default -0.5; :func:`fedpartial.aggregation.change_cosine`) and
  against the sum of the round's other changes (:func:`fedpartial.aggregation.peer_cosines`, the same bound; not
  compared when it is the only one) is refused: this catches a reversed update ``2 * global - local`` of the same
  size as an honest one, and keeps honest sites that all turn back together when training oscillates. The first
  round of a run (and of a resumed run whose checkpoint predates this check) has no step to compare with.

The metadata beside the weights (class counts, prototypes, per-class losses, ... and the classes the site
annotates) is checked when it arrives against what the method declares it may be (``LocalTrainer.statistics`` and
``per_class_metadata``, :mod:`fedpartial.stat_checks`: shape in the job's classes C and feature dimension D, finite
values, ranges such as counts within ``[0, n_train]`` of the site's data-check answer, bounded row norms, the keys
the rule reads from every site); the classes a site says it annotates must be those of its data-check answer, and
its parameter groups must name tensors of its update. An update that breaks them is refused with the reason. The
rule gets the parameter groups of the server's own model (the first contribution's where the server has no model
component).

Sites that sent nothing usable this round (dead, slow, failed or
refused) are recorded per round (``missing`` / ``rejected`` in ``results.json``). An update with participation
weight 0 is accepted but not averaged (the site sat the round out). When the rule raises, it is run again without
each contributor in turn: when leaving out exactly one site makes it succeed, that aggregate is the round's, and
the site is refused for this round and every later one (``rejected``, with the rule's error). Otherwise (or when
nothing usable arrives) the previous global model and the previous method metadata are kept, the round and the
error are logged and recorded in ``results.json``, and the job goes on; after ``max_rule_failures`` consecutive
rule failures the job stops cleanly (its last good model kept). The rule's returned meta (prototypes, learning
degrees, ...) travels to the sites with the next round's model.

Cost: the checks read each update once, block by block, and a rule that averages plainly (FedAvg and every rule
whose :meth:`~fedpartial.methods.ServerRule.plain_weights` says so) gets its weighted mean summed on that same
read, so an honest round reads each update once (``python benchmarks/aggregation_speed.py``).
"""

from __future__ import annotations

import copy
import traceback

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from ..aggregation import (
    BOUND_MODES,
    averaging_weights,
    bound_changes,
    change_measures,
    check_update,
    cosines_from,
    non_finite,
    norms_of,
    one_blas_thread,
    peer_cosines,
    step_of,
)
from ..methods import Contribution, PlainSums, ServerRule, get_method
from ..stat_checks import JobSize, StatSpec, check_statistics
from .keys import (
    META_ANNOTATED,
    META_CLIPPED,
    META_GROUPS,
    META_MISSING,
    META_N_TRAIN,
    META_REJECTED,
    META_RULE_ERROR,
    META_SKIPPED,
    META_WEIGHT,
)


def to_builtin(value):
    """numpy arrays / scalars inside the rule's meta -> lists / python numbers: the persistor stores the meta
    inside the model file, which NVFlare reloads with ``torch.load(weights_only=True)`` (no numpy allowed)."""
    if isinstance(value, dict):
        return {k: to_builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_builtin(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def groups_problem(groups, weights: dict) -> str | None:
    """Why a site's parameter groups (``{group: [tensor names]}``) do not describe its update, or None (also when
    it sent none)."""
    if groups is None:
        return None
    if not isinstance(groups, dict) or not all(isinstance(v, (list, tuple)) for v in groups.values()):
        return f"parameter groups '{META_GROUPS}' are not a mapping of group names to tensor-name lists"
    seen: set = set()
    for name, keys in groups.items():
        unknown = [k for k in keys if not isinstance(k, str) or k not in weights]
        if unknown:
            return f"parameter group '{name}' names tensors the update does not hold, e.g. {unknown[:3]}"
        twice = seen.intersection(keys)
        if twice:
            return f"parameter group '{name}' repeats tensors of another group, e.g. {sorted(twice)[:3]}"
        seen.update(keys)
    return None


class PartialLabelAggregator(Aggregator):
    """Args:
    method: the registered method whose server rule aggregates (e.g. ``fedavg_masked``).
    method_args: the method's options (the rule takes its own; every key must belong to the method).
    summary_id: id of the :class:`~fedpartial.fl.data_check.DataSummaryProcessor` component (optional).
    max_rule_failures: consecutive rounds in which the rule may raise before the job is stopped.
    max_change_ratio: bound on each tensor's change relative to its last global step (first round: its own
        norm) (0: no bound).
    on_large_change: ``reject`` the site's update or ``clip`` the offending tensors' changes to the bound.
    min_cosine: an update whose change has a cosine below this with the last global step is refused
        (None: no direction check).
    model_id: the server's model component (its ``feature_dim`` is the D of the statistics' declarations).
    """

    def __init__(
        self,
        method: str = "fedavg",
        method_args: dict | None = None,
        summary_id: str = "data_summary",
        max_rule_failures: int = 3,
        max_change_ratio: float = 25.0,
        on_large_change: str = "reject",
        min_cosine: float | None = -0.5,
        model_id: str = "model",
    ):
        super().__init__()
        self.method, self.method_args, self.summary_id = method, method_args or {}, summary_id
        self.model_id = model_id
        self.max_rule_failures = int(max_rule_failures)
        self.max_change_ratio, self.on_large_change = float(max_change_ratio), on_large_change
        self.min_cosine = None if min_cosine is None else float(min_cosine)
        self.config_error: str | None = None
        if on_large_change not in BOUND_MODES or not self.max_change_ratio >= 0:
            self.config_error = (
                f"aggregator: on_large_change must be one of {BOUND_MODES} and max_change_ratio >= 0, "
                f"got {on_large_change!r} and {max_change_ratio!r}"
            )
        if self.min_cosine is not None and not -1.0 <= self.min_cosine <= 1.0:
            self.config_error = f"aggregator: min_cosine must be in [-1, 1] or null, got {min_cosine!r}"
        self.specs: dict[str, StatSpec] = {}  # what each contribution's metadata may be (the method's declarations)
        try:
            self.rule: ServerRule | None = get_method(method).make_rule(self.method_args, "server aggregator")
            self.specs = get_method(method).statistic_specs(self.rule, self.method_args)
        except ValueError as e:  # reported with the job's name when the job starts (no context here)
            self.rule, self.config_error = None, str(e)
        self.refused: dict[str, str] = {}  # site -> why its updates are refused for the rest of the job (rule failures)
        self._contributions: list[Contribution] = []
        self.rejected: list[tuple[str, str]] = []
        self._clipped: list[str] = []
        self._last_meta: dict = {}
        self._failures = 0
        self._step: dict[str, np.ndarray] | None = None  # the last global step (new - previous global model)
        self._step_norms: dict[str, float] | None = None  # its norm per tensor (made when first needed)
        self._spare: dict[str, np.ndarray] | None = None  # the step before it: the arrays the next step is written to
        self._sums: PlainSums | None = None  # the round's plain mean, summed while its updates were checked
        self.last_missing: list[
            str
        ] = []  # the sites that sent nothing in the last round (the final evaluation skips them)

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            self._last_meta, self._failures, self._step, self._step_norms = {}, 0, None, None
            if self.config_error:
                job = (fl_ctx.get_prop(FLContextKey.JOB_META) or {}).get("name") or fl_ctx.get_job_id()
                self.system_panic(f"job '{job}': {self.config_error}", fl_ctx)

    def reset(self, fl_ctx: FLContext):
        self._contributions, self.rejected = [], []

    def checkpoint_state(self) -> dict:
        """The rule's state (e.g. FedIRM's global relation matrix), for a resumed job (:mod:`.checkpoint`). The
        metadata the sites received last is not repeated here: the checkpoint stores it once, with the model."""
        return {
            "rule": self.rule.state_dict() if self.rule is not None else {},
            "failures": self._failures,
            "step": self._step,
            "refused": dict(self.refused),
        }

    def restore_checkpoint(self, state: dict, sent_meta: dict | None = None) -> None:
        """``state`` from :meth:`checkpoint_state`; ``sent_meta``: the checkpointed model's metadata (the rule's
        last meta plus this aggregator's per-round records, which are dropped)."""
        own = (META_SKIPPED, META_MISSING, META_REJECTED, META_CLIPPED, META_RULE_ERROR)
        sent = state.get("last_meta")  # checkpoints that stored it separately
        sent = dict(sent if sent is not None else {k: v for k, v in (sent_meta or {}).items() if k not in own})
        if self.rule is not None:
            self.rule.load_state_dict(state.get("rule") or {})
            self.rule.load_sent_meta(sent)
        self._last_meta, self._failures = sent, int(state.get("failures", 0))
        self.refused = {str(k): str(v) for k, v in (state.get("refused") or {}).items()}
        step = state.get("step")
        self._step_norms = None
        self._step = (
            None
            if not step
            else {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v, np.float32) for k, v in step.items()}
        )

    def _previous(self, fl_ctx: FLContext) -> dict[str, np.ndarray] | None:
        model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        if model is None:
            return None
        return {k: np.asarray(v) for k, v in model[ModelLearnableKey.WEIGHTS].items()}

    def _reject(self, fl_ctx: FLContext, site: str, why: str) -> bool:
        self.rejected.append((site, why))
        self.log_error(fl_ctx, f"update from site '{site}' REJECTED: {why}; the global model is not touched by it")
        return False

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        with one_blas_thread():
            return self._accept(shareable, fl_ctx)

    def _accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = fl_ctx.get_peer_context().get_identity_name() if fl_ctx.get_peer_context() else "?"
        try:
            dxo = from_shareable(shareable)
        except Exception as e:  # noqa: BLE001
            return self._reject(fl_ctx, site, f"not a DXO ({e})")
        rnd = shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND)
        current = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if rnd is not None and current is not None and rnd != current:
            return self._reject(fl_ctx, site, f"contribution for round {rnd} arrived in round {current}")
        if dxo.data_kind != DataKind.WEIGHTS:
            return self._reject(fl_ctx, site, f"data kind {dxo.data_kind}, expected {DataKind.WEIGHTS}")
        if any(c.site == site for c in self._contributions):
            return self._reject(fl_ctx, site, "second contribution in the same round")
        if site in self.refused:
            return self._reject(fl_ctx, site, self.refused[site])
        weights = {k: np.asarray(v) for k, v in (dxo.data or {}).items()}
        previous = self._previous(fl_ctx)
        # the structure now; the values with the round's changes (_bound, change_measures): one read of each update
        # before the rule's average, the only other one
        why = check_update(weights, previous, values=False) if previous is not None else None
        if why:
            return self._reject(fl_ctx, site, why)
        meta = dict(dxo.meta or {})
        try:
            n, w = float(meta.get(META_N_TRAIN, 1.0)), float(meta.get(META_WEIGHT, 1.0))
        except (TypeError, ValueError, OverflowError):
            return self._reject(
                fl_ctx,
                site,
                f"sample count {meta.get(META_N_TRAIN)!r} or participation weight "
                f"{meta.get(META_WEIGHT)!r} is not a number",
            )
        if not np.isfinite(n) or n <= 0 or n != int(n):
            return self._reject(
                fl_ctx, site, f"invalid sample count {meta.get(META_N_TRAIN)!r} (not a positive integer)"
            )
        summary = self._summary(fl_ctx) or {}
        sites = summary.get("sites")
        reported = None
        if sites is not None:
            if site not in sites:
                return self._reject(fl_ctx, site, "the site did not pass the data check of this job")
            reported = sites[site].get("n_train")
            if reported is not None and n > float(reported):
                return self._reject(
                    fl_ctx,
                    site,
                    f"sample count {int(n)} exceeds the {reported} training images the site reported in the data check",
                )
        if not np.isfinite(w) or w < 0:
            return self._reject(fl_ctx, site, f"invalid participation weight {w}")
        why = self._check_statistics(fl_ctx, meta, summary, site, n if reported is None else float(reported))
        if why:
            return self._reject(fl_ctx, site, why)
        why = groups_problem(meta.get(META_GROUPS), weights)
        if why:
            return self._reject(fl_ctx, site, why)
        self._contributions.append(Contribution(site=site, weights=weights, n=n, meta=meta, weight=w))
        return True

    def _check_statistics(self, fl_ctx: FLContext, meta: dict, summary: dict, site: str, n_train: float) -> str | None:
        """Why the update's metadata breaks the method's declarations (:func:`fedpartial.stat_checks.check_statistics`
        with the job's C, D, K and the site's data-check training images), or the classes it says it annotates
        differ from its data-check answer; None when neither."""
        classes, sites = summary.get("classes"), summary.get("sites") or {}
        model = fl_ctx.get_engine().get_component(self.model_id) if self.model_id else None
        dim = getattr(model, "feature_dim", None)
        job = JobSize(
            C=len(classes) if classes is not None else None,
            D=int(dim) if dim is not None else None,
            K=len(sites) if sites else None,
            n_train=n_train,
        )
        why = check_statistics(meta, self.specs, job)
        if why:
            return why
        known = (sites.get(site) or {}).get("annotated")
        if known is not None and META_ANNOTATED in meta:
            sent = np.asarray(meta[META_ANNOTATED], dtype=bool)
            if sent.shape != np.shape(known) or np.any(sent != np.asarray(known, dtype=bool)):
                return (
                    f"statistic '{META_ANNOTATED}': the classes it says it annotates {sent.astype(int).tolist()} "
                    f"differ from its data-check answer {np.asarray(known, dtype=bool).astype(int).tolist()}"
                )
        return None

    def _summary(self, fl_ctx: FLContext) -> dict | None:
        comp = fl_ctx.get_engine().get_component(self.summary_id) if self.summary_id else None
        return getattr(comp, "summary", None)

    def _expected_sites(self, fl_ctx: FLContext) -> list[str]:
        """The sites that should contribute each round: those of the data check, else the connected clients."""
        sites = (self._summary(fl_ctx) or {}).get("sites")
        if sites:
            return sorted(sites)
        try:
            return sorted(c.name for c in fl_ctx.get_engine().get_clients())
        except Exception:  # noqa: BLE001
            return []

    def _bound(self, fl_ctx: FLContext, rnd: int, previous, contributions: list[Contribution]) -> list[Contribution]:
        """The round's updates (participation weight > 0) read once together (:func:`change_measures`): those with
        a NaN / inf value are refused, then the direction check (:func:`change_cosine`, against the last global
        step and the round's other changes) and the size bound (:func:`bound_changes`), each update against the
        global model and its last step. On the same read the rule's plain mean is summed (``self._sums``, when
        :meth:`ServerRule.plain_weights` gives weights): when every update stays, unclipped, the rule does not read
        them again."""
        self._sums = None
        if previous is None or not contributions:
            return contributions
        step = self._step if self.min_cosine is not None else None
        weights = self._plain_weights(contributions)
        states = [c.weights for c in contributions]
        measured = change_measures(states, previous, step, weights)
        if weights is not None:  # the rule's plain mean, summed on this read; used only if every update stays
            self._sums = PlainSums(tuple(states), np.asarray(weights, np.float64), measured.sums)
        squares = measured.squares
        if self._step is not None and self._step_norms is None:  # a step restored from a checkpoint
            self._step_norms = norms_of(self._step)
        cosines = cosines_from(measured.dots, squares, self._step_norms) if step is not None else None
        kept = []
        for k, c in enumerate(contributions):
            why = non_finite(c.weights, {key: v[k] for key, v in squares.items()})
            if why:
                self._reject(fl_ctx, c.site, why)
            else:
                kept.append(k)
        contributions = [contributions[k] for k in kept]
        squares = {key: v[kept] for key, v in squares.items()}
        if cosines is not None and contributions:
            alive = self._check_direction(fl_ctx, rnd, previous, contributions, cosines[kept])
            contributions = [contributions[k] for k in alive]
            squares = {key: v[alive] for key, v in squares.items()}
        if self.max_change_ratio <= 0 or not contributions:
            return contributions
        states, why = bound_changes(
            [c.weights for c in contributions],
            previous,
            self.max_change_ratio,
            self.on_large_change,
            steps=self._step_norms,
            norms={key: np.sqrt(v) for key, v in squares.items()},
            reference_norms=measured.reference_norms,
        )
        if why:
            self._sums = None  # an update left out or clipped: the rule averages what remains itself
        if self.on_large_change == "reject":
            for k, reason in sorted(why.items()):
                self._reject(fl_ctx, contributions[k].site, f"round {rnd}: {reason}")
            return [c for k, c in enumerate(contributions) if k not in why]
        for k, reason in sorted(why.items()):
            self._clipped.append(contributions[k].site)
            self.log_warning(fl_ctx, f"round {rnd}: update from site '{contributions[k].site}' CLIPPED: {reason}")
        return [
            Contribution(site=c.site, weights=s, n=c.n, meta=c.meta, weight=c.weight)
            for c, s in zip(contributions, states)
        ]

    def _plain_weights(self, contributions: list[Contribution]) -> np.ndarray | None:
        """The rule's plain-mean site weights (:meth:`ServerRule.plain_weights`) if usable, else None (the rule
        then averages on its own reading of the updates, and a failure there is the rule's, reported as such)."""
        try:
            w = self.rule.plain_weights(contributions)
            if w is None:
                return None
            w = np.asarray(w, np.float64)
            averaging_weights(w)  # raises unless finite, non-negative and not all zero
            return w
        except Exception:  # noqa: BLE001 - the fused sum is an optimisation only
            return None

    def _check_direction(
        self, fl_ctx: FLContext, rnd: int, previous, contributions: list[Contribution], cosines: np.ndarray
    ) -> list[int]:
        """The indices of the updates kept by the direction check: refused are those whose change points against
        the last global step (``cosines``, NaN where there is none: kept) and against the other sites' changes of
        the round (:func:`peer_cosines`, computed only for those below ``min_cosine``, so an honest round reads no
        update again; not compared when there are none): honest sites all turn against the last step together
        when training oscillates, a reversed update turns against them too."""
        low = [k for k, cos in enumerate(cosines) if cos < self.min_cosine]  # NaN: no direction, kept
        peers = (
            peer_cosines([c.weights for c in contributions], previous, list(self._step), which=low)
            if low
            else [None] * len(contributions)
        )
        kept = []
        for k, c in enumerate(contributions):
            peer = peers[k]
            if k in low and (peer is None or peer < self.min_cosine):
                others = (
                    "no other site's change to compare with"
                    if peer is None
                    else f"and against the other sites' changes, cosine {peer:.3f}"
                )
                self._reject(
                    fl_ctx,
                    c.site,
                    f"round {rnd}: the update points against the model's last step (cosine "
                    f"{cosines[k]:.3f} < min_cosine {self.min_cosine:g}; {others}; a reversed update?)",
                )
            else:
                kept.append(k)
        line = ", ".join(f"{c.site} {'-' if np.isnan(cos) else f'{cos:.3f}'}" for c, cos in zip(contributions, cosines))
        if low:
            line += "; below min_cosine, with the other sites' changes: " + ", ".join(
                f"{contributions[k].site} {'-' if peers[k] is None else f'{peers[k]:.3f}'}" for k in low
            )
        self.log_info(fl_ctx, f"round {rnd}: cosine of each change with the last global step: {line}")
        return kept

    def _run_rule(
        self,
        rule: ServerRule,
        previous,
        contributions: list[Contribution],
        groups: dict,
        rnd: int,
        summary: dict | None,
        out: dict | None = None,
        sums: PlainSums | None = None,
    ) -> tuple[dict, dict, dict | None, dict | None]:
        """``(weights, meta in builtin types, the step from previous, its norm per tensor)``; the step is written
        into ``out``'s arrays where they fit (:func:`step_of`). Raises when the rule does or its model is unusable:
        the structure is checked against the previous model, the values by the step's norms (NaN / inf in the
        model, confirmed value by value), one read of the model. ``sums``: the rule's plain mean, summed while the
        updates were checked (:meth:`_bound`), lent to the rule for this call (:attr:`ServerRule.presummed`)."""
        rule.presummed = sums
        try:
            weights, meta = rule.aggregate(previous, contributions, groups, rnd, summary)
        finally:
            rule.presummed = None
        meta = to_builtin(meta)
        if previous is None:
            return weights, meta, None, None
        bad = check_update(weights, previous, values=False)
        norms: dict[str, float] = {}
        step = step_of(weights, previous, out, norms) if not bad else None
        bad = bad or non_finite(weights, {k: v * v for k, v in norms.items()})
        if bad:  # a rule must never produce a broken model
            raise ValueError(f"the aggregated model is unusable ({bad})")
        return weights, meta, step, norms

    def _snapshot(self) -> ServerRule | None:
        """A copy of the rule before the round (a failing ``aggregate`` may leave its state half updated)."""
        try:
            return copy.deepcopy(self.rule)
        except Exception:  # noqa: BLE001 - a rule that cannot be copied: failures are not attributed
            return None

    def _culprit(
        self,
        fl_ctx: FLContext,
        before: ServerRule | None,
        previous,
        contributions: list[Contribution],
        groups: dict,
        rnd: int,
        summary: dict | None,
    ) -> tuple[str, ServerRule, dict, dict, dict | None, dict | None] | None:
        """After the rule failed on the round's contributions: run a copy of the rule as it was before the round
        without each contributor in turn. When exactly one left-out site makes it succeed, ``(that site, the rule
        copy that succeeded, its weights, its meta, its step and the step's norms)``; None when no single site
        explains the failure (or there is no copy of the rule, or a single contributor)."""
        if before is None or len(contributions) < 2:
            return None
        found = []
        for c in contributions:
            rule = copy.deepcopy(before)
            try:
                out = self._run_rule(rule, previous, [o for o in contributions if o is not c], groups, rnd, summary)
            except Exception:  # noqa: BLE001
                continue
            found.append((c.site, rule, *out))
        if len(found) != 1:
            self.log_warning(
                fl_ctx,
                f"round {rnd}: the rule's failure is not explained by a single site (it "
                + (
                    f"succeeds without any one of {[f[0] for f in found]})"
                    if found
                    else "fails without any one site too)"
                ),
            )
            return None
        return found[0]

    def _keep_previous(self, previous, extra: dict | None = None) -> Shareable:
        """The previous global model with the previous method metadata (sites keep e.g. their prototypes)."""
        return DXO(
            data_kind=DataKind.WEIGHTS, data=previous or {}, meta={**self._last_meta, **(extra or {})}
        ).to_shareable()

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        with one_blas_thread():
            return self._aggregate(fl_ctx)

    def _aggregate(self, fl_ctx: FLContext) -> Shareable:
        previous = self._previous(fl_ctx)
        rnd = int(fl_ctx.get_prop(AppConstants.CURRENT_ROUND) or 0)
        received = sorted(self._contributions, key=lambda c: c.site)
        self._contributions, self._clipped = [], []
        contributions = self._bound(fl_ctx, rnd, previous, [c for c in received if c.weight > 0])
        sums, self._sums = self._sums, None  # this round's only: no update outlives the round in them
        rejected = sorted({s for s, _ in self.rejected})
        answered = {c.site for c in received} | set(rejected)
        sat_out = {
            META_SKIPPED: [c.site for c in received if c.weight <= 0],
            META_MISSING: [s for s in self._expected_sites(fl_ctx) if s not in answered],
            META_REJECTED: {s: why for s, why in self.rejected},
            META_CLIPPED: list(self._clipped),
        }
        self.rejected = []
        self.last_missing = list(sat_out[META_MISSING])
        if sat_out[META_SKIPPED]:
            self.log_info(fl_ctx, f"round {rnd}: site(s) {sat_out[META_SKIPPED]} sat this round out (weight 0)")
        if sat_out[META_MISSING]:
            self.log_warning(
                fl_ctx,
                f"round {rnd}: no update from site(s) {sat_out[META_MISSING]} (dead, slow or "
                "failed); the round goes on without them",
            )
        if not contributions:
            self.log_error(fl_ctx, f"round {rnd}: no usable update; keeping the previous global model")
            return self._keep_previous(previous, sat_out)
        model = fl_ctx.get_engine().get_component(self.model_id) if self.model_id else None
        if callable(getattr(model, "parameter_groups", None)):  # the server's own model: no site's word needed
            groups = model.parameter_groups()
        else:
            groups = contributions[0].meta.get(META_GROUPS) or {}
        summary = self._summary(fl_ctx)
        before = self._snapshot() if len(contributions) > 1 else None
        try:
            weights, meta, step, step_norms = self._run_rule(
                self.rule, previous, contributions, groups, rnd, summary, self._spare, sums
            )
        except Exception as e:  # noqa: BLE001 - the federation outlives a failing rule
            msg = f"rule {type(self.rule).__name__} failed in round {rnd}: {type(e).__name__}: {e}"
            found = self._culprit(fl_ctx, before, previous, contributions, groups, rnd, summary)
            if found is None:
                self._failures += 1
                self.log_error(
                    fl_ctx,
                    f"{msg}; keeping the previous global model "
                    f"({self._failures} consecutive failure(s))\n{traceback.format_exc()}",
                )
                if self._failures >= self.max_rule_failures:
                    self.system_panic(
                        f"stopping: the server rule failed {self._failures} rounds in a row ({msg}); "
                        "the last good global model is kept",
                        fl_ctx,
                    )
                return self._keep_previous(previous, {META_RULE_ERROR: msg, **sat_out})
            site, self.rule, weights, meta, step, step_norms = found
            why = (
                f"round {rnd}: the server rule {type(self.rule).__name__} failed on this site's input "
                f"({type(e).__name__}: {e}); the round aggregated the others"
            )
            self.refused[site] = (
                f"refused since round {rnd + 1}: in round {rnd} the server rule failed on its input ({type(e).__name__}: {e})"
            )
            sat_out[META_REJECTED][site] = f"{why}; refused from round {rnd + 1} on"
            self.log_error(
                fl_ctx,
                f"update from site '{site}' REJECTED: {why}; the site is refused from round "
                f"{rnd + 1} on\n{traceback.format_exc()}",
            )
            contributions = [c for c in contributions if c.site != site]
        self._failures = 0
        self._last_meta = meta
        if step is not None and any(v > 0 for v in step_norms.values()):
            # a round that kept the model keeps the last real step; the step before it lends its arrays to the next
            self._spare, self._step, self._step_norms = self._step, step, step_norms
        self.log_info(
            fl_ctx,
            f"round {rnd}: aggregated {len(contributions)} site(s) "
            f"{[c.site for c in contributions]} with rule {type(self.rule).__name__}",
        )
        return DXO(data_kind=DataKind.WEIGHTS, data=weights, meta={**meta, **sat_out}).to_shareable()
