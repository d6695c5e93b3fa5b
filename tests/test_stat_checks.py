"""A site's statistics are checked like its weights: in process, the server's own ``PartialLabelAggregator`` with
three sites, the third hostile in its metadata only (its weights an honest-looking small change).

For each method whose server rule reads statistics (the four papers' FedMLP, FedLSM, FedIRM and surgical
aggregation; the comparison methods CBAFed, FedNoRo and the class-masked rules), a third site sending NaN,
negative, huge or wrong-shaped statistics, or lacking a key the rule reads, is refused with its reason, and the
round's aggregate is exactly the one of the two honest sites alone. Counts above the site's data-check training
images are refused. A rule that still fails on one site's input aggregates the others and refuses that site
from the next round on (also after a checkpoint). Two honest sites of very different sizes are never refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants

from fedpartial.fl.aggregator import PartialLabelAggregator
from fedpartial.fl.keys import META_GROUPS, META_MISSING, META_N_TRAIN, META_REJECTED, META_RULE_ERROR, META_WEIGHT
from fedpartial.methods import ServerRule, get_method, register
from fedpartial.methods.baselines import SupervisedTrainer
from fedpartial.privacy import ClassStat
from fedpartial.stat_checks import JobSize, StatSpec, check_one, check_statistics, statistic_specs

C, D = 3, 4
CLASSES = ["a", "b", "c"]
ANNOTATED = {"site-1": [True, True, False], "site-2": [False, True, True], "site-3": [True, False, True]}
N_TRAIN = {"site-1": 20, "site-2": 30, "site-3": 40}
GROUPS = {"encoder": ["enc"], "norm": [], "head": [], "classifier": ["cls"]}


class _Engine:
    def __init__(self, components: dict, clients=()):
        self.components, self.clients = components, clients

    def get_component(self, cid):
        return self.components.get(cid)

    def get_clients(self):
        return [type("Client", (), {"name": c})() for c in self.clients]

    def fire_event(self, *args, **kwargs):  # error logs fire an event in NVFlare 2.9
        pass


def _aggregator(method: str, args: dict | None = None, n_train: dict | None = None, annotated: dict | None = None):
    agg = PartialLabelAggregator(method, args or {})
    assert agg.config_error is None, agg.config_error
    n_train, annotated = n_train or N_TRAIN, annotated or ANNOTATED
    summary = type(
        "Summary",
        (),
        {
            "summary": {
                "classes": CLASSES,
                "sites": {s: {"n_train": n_train[s], "annotated": annotated[s]} for s in n_train},
            }
        },
    )()
    model = type("Model", (), {"feature_dim": D})()
    return agg, _Engine({"data_summary": summary, "aggregator": agg, "model": model}, sorted(n_train))


def _ctx(engine, rnd: int, prev: dict, site: str | None = None) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, engine, private=True, sticky=False)
    ctx.set_prop(AppConstants.GLOBAL_MODEL, {ModelLearnableKey.WEIGHTS: prev}, private=True, sticky=False)
    ctx.set_prop(AppConstants.CURRENT_ROUND, rnd, private=True, sticky=False)
    if site:
        peer = FLContext()
        peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=True, sticky=False)
        ctx.set_peer_context(peer)
    return ctx


PREV = {"enc": np.ones(6, np.float32), "cls": np.ones((C, 2), np.float32)}


def _weights(k: int) -> dict:
    """An honest-looking small change of the global model, different per site."""
    rng = np.random.default_rng(k)
    return {key: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for key, v in PREV.items()}


def _honest(method: str, site: str, k: int) -> dict:
    """The statistics an honest site of ``method`` sends (shapes and ranges as its trainer's)."""
    rng = np.random.default_rng(100 + k)
    a = np.asarray(ANNOTATED[site])
    if method == "fedlsm":
        return {"fedlsm_q": np.array([5.0, 3.0, 2.0]) * (k + 1)}
    if method == "fedmlp":
        counts = np.where(a[:, None], [[6, 4]], 0).astype(np.int64)
        return {
            "fedmlp_p0": rng.standard_normal((C, D)).astype(np.float32) * a[:, None],
            "fedmlp_p1": rng.standard_normal((C, D)).astype(np.float32) * a[:, None],
            "fedmlp_proto_counts": counts,
            "fedmlp_degree": np.full(C, 0.25 * (k + 1)),
        }
    if method == "fedirm":
        m = rng.random((C, C)) + 0.1
        return {"fedirm_relation": m / m.sum(1, keepdims=True), "fedirm_relation_valid": a.astype(int).tolist()}
    if method == "surgical":
        return {"surgical_norm_from_warmup": False, "surgical_warmup": [2, 1]}
    if method == "cbafed":
        counts = np.array([4.0, 6.0, 2.0]) * (k + 1)
        return {"cbafed_counts": counts, "cbafed_pseudo_positives": counts / 2, "cbafed_trained": float(counts.sum())}
    if method == "fednoro":
        counts = np.where(a, 5, 0).astype(float)
        return {
            "fednoro_class_loss": np.where(a, 0.3 + 0.1 * k, np.nan).tolist(),
            "fednoro_class_count": counts.tolist(),
        }
    assert method in ("fedavg_masked", "fpsl", "fixmatch_masked"), method
    return {}


def _send(agg, engine, rnd: int, prev: dict, site: str, k: int, stats: dict, drop: tuple = ()) -> bool:
    meta = {META_N_TRAIN: N_TRAIN[site], META_WEIGHT: 1.0, META_GROUPS: GROUPS, "annotated": ANNOTATED[site], **stats}
    for key in drop:
        meta.pop(key, None)
    return agg.accept(DXO(DataKind.WEIGHTS, _weights(k), meta).to_shareable(), _ctx(engine, rnd, prev, site))


def _round(method: str, third: dict | None, drop: tuple = (), args: dict | None = None, rnd: int = 0):
    """One round: site-1 and site-2 honest, site-3 (if ``third``) sends ``third`` over its honest statistics."""
    agg, engine = _aggregator(method, args)
    sites = ["site-1", "site-2"] + (["site-3"] if third is not None else [])
    accepted = {}
    for k, site in enumerate(sites):
        stats = _honest(method, site, k)
        if site == "site-3":
            stats = {**stats, **third}
        accepted[site] = _send(agg, engine, rnd, PREV, site, k, stats, drop if site == "site-3" else ())
    out = from_shareable(agg.aggregate(_ctx(engine, rnd, PREV)))
    return accepted, out, agg


def _same_as_honest(method: str, out, args: dict | None = None):
    _, honest, _ = _round(method, None, args=args)
    for key in PREV:
        np.testing.assert_array_equal(out.data[key], honest.data[key], err_msg=key)
    for key, v in honest.meta.items():
        if key not in (META_REJECTED, META_MISSING):
            np.testing.assert_array_equal(
                np.asarray(out.meta[key], dtype=object), np.asarray(v, dtype=object), err_msg=key
            )


# the probes: (method, statistic, hostile values, words of the reason)
HOSTILE = [
    ("fedlsm", "fedlsm_q", np.full(C, 1e30), "above 40"),  # the takeover probe: AWPA weight ~1 for every row
    ("fedlsm", "fedlsm_q", np.full(C, np.nan), "non-finite"),
    ("fedlsm", "fedlsm_q", np.full(C, -1e9), "below 0"),
    ("fedlsm", "fedlsm_q", np.ones(C + 2), "shape (5,), expected (C=3,)"),
    ("fedlsm", "fedlsm_q", np.array([41.0, 0.0, 0.0]), "above 40"),  # more positives than its training images
    ("fedmlp", "fedmlp_p0", np.full((C, D), np.nan, np.float32), "non-finite"),
    ("fedmlp", "fedmlp_p1", np.full((C, D), 1e20, np.float32), "L2 norm above"),
    ("fedmlp", "fedmlp_p1", np.ones((C, D + 1), np.float32), "expected (C=3, D=4)"),
    ("fedmlp", "fedmlp_proto_counts", np.full((C, 2), -3), "below 0"),
    ("fedmlp", "fedmlp_proto_counts", np.full((C, 2), 41), "above 40"),
    ("fedmlp", "fedmlp_degree", np.full(C, 7.0), "above 1"),
    ("fedmlp", "fedmlp_degree", np.full(C, np.inf), "non-finite"),
    ("fedirm", "fedirm_relation", np.full((C, C), np.nan), "non-finite"),
    ("fedirm", "fedirm_relation", np.full((C, C), -1.0), "below 0"),
    ("fedirm", "fedirm_relation", np.full((C, C), 1e30), "above 1"),
    ("fedirm", "fedirm_relation", np.full((C + 1, C), 0.25), "shape (4, 3)"),
    ("fedirm", "fedirm_relation_valid", [1, 0, 7], "True / False"),
    ("surgical", "surgical_norm_from_warmup", float("nan"), "non-finite"),
    ("surgical", "surgical_norm_from_warmup", 1e30, "True / False"),
    ("surgical", "surgical_norm_from_warmup", [True, True], "shape (2,)"),
    ("surgical", "surgical_warmup", [-5, 1], "below 0"),
    ("cbafed", "cbafed_counts", np.full(C, np.nan), "non-finite"),
    ("cbafed", "cbafed_counts", np.full(C, -2.0), "below 0"),
    ("cbafed", "cbafed_counts", np.full(C, 1e30), "above 40"),
    ("cbafed", "cbafed_counts", np.ones((C, 2)), "shape (3, 2)"),
    ("cbafed", "cbafed_trained", 1e12, "above 120"),  # C x n_train: the aggregation weight
    ("fednoro", "fednoro_class_loss", [np.nan, 0.2, 0.3], "NaN only where 'fednoro_class_count' is 0"),
    ("fednoro", "fednoro_class_loss", [-1.0, 0.2, 0.3], "below 0"),
    ("fednoro", "fednoro_class_loss", [1e30, 0.2, 0.3], "above 1e+06"),
    ("fednoro", "fednoro_class_loss", [0.1, 0.2], "shape (2,)"),
    ("fednoro", "fednoro_class_count", [1e9, 5.0, 5.0], "above 40"),
    ("fedavg_masked", "annotated", [1, 1, 1, 1], "shape (4,)"),
    ("fpsl", "annotated", [True, True, True], "differ from its data-check answer"),  # claims a class it lacks
    ("fixmatch_masked", "annotated", "all", "not an array of numbers"),
]


@pytest.mark.parametrize("method, key, value, why", HOSTILE, ids=[f"{m}-{k}-{w.split()[0]}" for m, k, _, w in HOSTILE])
def test_hostile_statistics_are_refused_and_the_others_aggregate(method, key, value, why):
    accepted, out, _ = _round(method, {key: value})
    assert accepted == {"site-1": True, "site-2": True, "site-3": False}
    assert list(out.meta[META_REJECTED]) == ["site-3"] and why in out.meta[META_REJECTED]["site-3"], out.meta[
        META_REJECTED
    ]
    assert key in out.meta[META_REJECTED]["site-3"]
    assert META_RULE_ERROR not in out.meta
    _same_as_honest(method, out)


@pytest.mark.parametrize(
    "method, key",
    [
        ("fedmlp", "annotated"),
        ("fedlsm", "fedlsm_q"),
        ("fedlsm", "annotated"),
        ("fedirm", "annotated"),
        ("cbafed", "cbafed_counts"),
        ("surgical", "annotated"),
        ("fedmlp", "fedmlp_degree"),
        ("fedmlp", "fedmlp_proto_counts"),
        ("fednoro", "fednoro_class_count"),
        ("fedirm", "fedirm_relation_valid"),
    ],
)
def test_a_missing_statistic_the_rule_reads_is_refused(method, key):
    """FedMLP without the annotated vector failed the whole round ('operands could not be broadcast'); a
    statistic that comes without its companions (prototypes without counts, losses without counts) too."""
    accepted, out, _ = _round(method, {}, drop=(key,))
    assert accepted["site-3"] is False and accepted["site-1"] and accepted["site-2"]
    assert f"'{key}'" in out.meta[META_REJECTED]["site-3"], out.meta[META_REJECTED]
    _same_as_honest(method, out)


def test_fedlsm_takeover_probe_without_the_check():
    """Why the bound matters: the same 1e30 class counts, with the declarations emptied, take FedLSM's classifier
    over (AWPA gives site-3 weight ~1 for every row); with them, the classifier is the honest sites' alone."""
    agg, engine = _aggregator("fedlsm")
    agg.specs = {}
    for k, site in enumerate(["site-1", "site-2", "site-3"]):
        stats = _honest("fedlsm", site, k) if site != "site-3" else {"fedlsm_q": np.full(C, 1e30)}
        assert _send(agg, engine, 0, PREV, site, k, stats)
    out = from_shareable(agg.aggregate(_ctx(engine, 0, PREV)))
    np.testing.assert_allclose(out.data["cls"], _weights(2)["cls"], rtol=1e-6)  # site-3's rows
    accepted, checked, _ = _round("fedlsm", {"fedlsm_q": np.full(C, 1e30)})
    assert not np.allclose(checked.data["cls"], _weights(2)["cls"], rtol=1e-3)


def test_honest_sites_of_very_different_sizes_are_never_refused():
    """16 and 4000 training images; counts at the very edge of what each holds (q = n_train, degree 0 and 1)."""
    n_train = {"site-1": 16, "site-2": 4000}
    annotated = {"site-1": [True, True, True], "site-2": [True, True, True]}
    for method, stats in [
        ("fedlsm", lambda n: {"fedlsm_q": np.array([n, 0.0, 1.0])}),
        (
            "cbafed",
            lambda n: {
                "cbafed_counts": np.full(C, float(n)),
                "cbafed_pseudo_positives": np.zeros(C),
                "cbafed_trained": float(C * n),
            },
        ),
        (
            "fedmlp",
            lambda n: {
                "fedmlp_p0": np.full((C, D), 50.0, np.float32),
                "fedmlp_p1": np.zeros((C, D), np.float32),
                "fedmlp_proto_counts": np.array([[n, 0]] * C),
                "fedmlp_degree": np.array([0.0, 1.0, 0.5]),
            },
        ),
    ]:
        agg, engine = _aggregator(method, n_train=n_train, annotated=annotated)
        for k, site in enumerate(n_train):
            meta = {
                META_N_TRAIN: n_train[site],
                META_WEIGHT: 1.0,
                META_GROUPS: GROUPS,
                "annotated": annotated[site],
                **stats(n_train[site]),
            }
            assert agg.accept(DXO(DataKind.WEIGHTS, _weights(k), meta).to_shareable(), _ctx(engine, 0, PREV, site)), (
                method,
                agg.rejected,
            )
        out = from_shareable(agg.aggregate(_ctx(engine, 0, PREV)))
        assert out.meta[META_REJECTED] == {} and META_RULE_ERROR not in out.meta, method


# ------------------------------------------------------------------------------------------ a rule that still fails
class _FailsOnMarkedInput(ServerRule):
    """FedAvg that raises when a contribution's metadata says ``explode`` (an input no declaration covers)."""

    def aggregate(self, previous, contributions, groups, round_num, summary=None):
        bad = [c.site for c in contributions if c.meta.get("explode")]
        if bad:
            raise ValueError("cannot aggregate this input")
        weights, _ = super().aggregate(previous, contributions, groups, round_num)
        return weights, {"rounds_seen": round_num}


def test_a_rule_failing_on_one_sites_input_names_it_aggregates_the_others_and_refuses_it_from_then_on():
    register("fails_on_marked_input_test", SupervisedTrainer, _FailsOnMarkedInput)
    agg, engine = _aggregator("fails_on_marked_input_test")
    panics = []
    agg.system_panic = lambda reason, fl_ctx: panics.append(reason)
    for k, site in enumerate(["site-1", "site-2", "site-3"]):
        assert _send(agg, engine, 0, PREV, site, k, {"explode": site == "site-3"})
    out = from_shareable(agg.aggregate(_ctx(engine, 0, PREV)))
    assert META_RULE_ERROR not in out.meta and out.meta["rounds_seen"] == 0
    why = out.meta[META_REJECTED]["site-3"]
    assert "_FailsOnMarkedInput failed on this site's input (ValueError: cannot aggregate this input)" in why
    assert "refused from round 1 on" in why
    w1, w2 = _weights(0), _weights(1)
    expected = (N_TRAIN["site-1"] * w1["enc"] + N_TRAIN["site-2"] * w2["enc"]) / (N_TRAIN["site-1"] + N_TRAIN["site-2"])
    np.testing.assert_allclose(out.data["enc"], expected, rtol=1e-6)  # the two others' FedAvg
    # round 1: site-3 is refused when its update arrives, even an honest one; a resumed server remembers it
    for a in (agg, _resumed(agg)):
        prev = {k: np.asarray(v) for k, v in out.data.items()}
        assert not _send(a, engine, 1, prev, "site-3", 2, {"explode": False})
        assert "refused since round 1: in round 0 the server rule failed on its input" in a.rejected[-1][1]
        a.reset(None)
    assert panics == []


def _resumed(agg: PartialLabelAggregator) -> PartialLabelAggregator:
    again = PartialLabelAggregator(agg.method, agg.method_args)
    again.restore_checkpoint(agg.checkpoint_state(), {})
    return again


def test_a_failure_no_single_site_explains_keeps_the_previous_model():
    """Two sites whose input breaks the rule: no site is blamed, the previous model is kept (as before)."""
    register("fails_on_marked_input_test", SupervisedTrainer, _FailsOnMarkedInput)
    agg, engine = _aggregator("fails_on_marked_input_test")
    agg.system_panic = lambda reason, fl_ctx: None
    for k, site in enumerate(["site-1", "site-2", "site-3"]):
        assert _send(agg, engine, 0, PREV, site, k, {"explode": site != "site-1"})
    out = from_shareable(agg.aggregate(_ctx(engine, 0, PREV)))
    assert "cannot aggregate this input" in out.meta[META_RULE_ERROR] and out.meta[META_REJECTED] == {}
    np.testing.assert_array_equal(out.data["enc"], PREV["enc"])
    assert agg.refused == {}


# ------------------------------------------------------------------------------------------ the declarations
def test_check_one_by_hand():
    job = JobSize(C=3, D=2, K=4, n_train=10)
    assert job.value("C * n_train") == 30 and job.value(2.5) == 2.5 and JobSize().value("n_train") is None
    spec = StatSpec("q", ("C",), "float", 0.0, "n_train")
    assert check_one([0, 10, 3.5], spec, job) is None
    assert check_one([0, 10.5, 3], spec, job) == (
        "statistic 'q' has 1 value(s) above 10 (the site's training images in the data check), e.g. 10.5 at [1]"
    )
    assert "e.g. -1 at [2]" in check_one([0, 1, -1], spec, job)
    assert check_one([0, 1], spec, job) == "statistic 'q' has shape (2,), expected (C=3,)"
    assert check_one([1, 2], spec, JobSize()) is None  # C unknown: any length
    rows = StatSpec("p", ("C", "D"), max_row_norm=5.0)
    assert check_one([[3, 4], [0, 0], [1, 1]], rows, job) is None  # norms 5, 0, 1.4
    assert "row(s) of L2 norm above 5, e.g. 5.001 at row [0]" in check_one([[3, 4.0016], [0, 0], [1, 1]], rows, job)
    assert "whole numbers" in check_one([1.5], StatSpec("w", (1,), "int"), job)
    assert "True / False" in check_one(2, StatSpec("b", (), "bool"), job)
    nan = StatSpec("loss", ("C",), low=0.0, nan_where_zero="n")
    assert check_one([np.nan, 1, 2], nan, job, {"n": [0, 3, 3]}) is None
    assert "non-finite" in check_one([np.nan, 1, 2], nan, job, {"n": [1, 3, 3]})
    assert "not an array of numbers" in check_one([[1, 2], [3]], spec, job)


def test_defaults_from_the_privacy_declarations_and_required_keys():
    specs = statistic_specs(
        [
            ClassStat("n", "count"),
            ClassStat("p", "mean", "n", 1),
            ClassStat("l", "mean", "k", fill=float("nan")),
            ClassStat("k", "count"),
        ],
        [StatSpec("x", (), high=1.0)],
        required=("annotated", "x"),
    )
    assert specs["n"].shape == ("C", 2) and specs["n"].high == "n_train" and specs["k"].shape == ("C",)
    assert specs["p"].shape == ("C", "D") and specs["p"].needs == ("n",) and specs["l"].nan_where_zero == "k"
    assert specs["annotated"].required and specs["x"].required and specs["x"].high == 1.0
    job = JobSize(C=2, D=3, n_train=5)
    assert "statistic 'annotated' is missing" in check_statistics({}, specs, job)
    assert "statistic 'x' is missing" in check_statistics({"annotated": [1, 0]}, specs, job)
    assert "'p' came without 'n'" in check_statistics(
        {"annotated": [1, 0], "x": 0.5, "p": np.zeros((2, 3))}, specs, job
    )


def test_every_method_declares_what_its_rule_reads():
    """The keys each paper's rule reads are declared for it (so the server checks them)."""
    want = {
        "fedlsm": {"fedlsm_q", "annotated"},
        "fedmlp": {"fedmlp_p0", "fedmlp_p1", "fedmlp_proto_counts", "fedmlp_degree", "annotated"},
        "fedirm": {"fedirm_relation", "fedirm_relation_valid", "annotated"},
        "surgical": {"surgical_norm_from_warmup", "annotated"},
        "cbafed": {"cbafed_counts", "cbafed_trained"},
        "fednoro": {"fednoro_class_loss", "fednoro_class_count"},
        "fedavg_masked": {"annotated"},
    }
    for name, keys in want.items():
        specs = get_method(name).statistic_specs()
        assert keys <= set(specs), (name, keys - set(specs))
    assert get_method("fedmlp").statistic_specs()["annotated"].required
    assert not get_method("fedavg").statistic_specs()["annotated"].required  # FedAvg reads no statistic


def test_refusal_reasons_reach_results_admin_and_show_results(tmp_path, capsys, monkeypatch):
    """The reason lands in the round's ``rejected`` (results.json), in the run's ``degraded`` reasons that
    ``fedpartial-admin results`` prints, and in ``show_results``'s output."""
    import json

    from fedpartial.fl.report import degradation
    from fedpartial.tools import show_results
    from fedpartial.tools.show_results import degraded_lines

    _, first, _ = _round("fedlsm", {"fedlsm_q": np.full(C, 1e30)})
    _, second, _ = _round("fedlsm", {"fedlsm_q": np.full(C, np.nan)}, rnd=1)
    rounds = [{"round": r, "missing": [], "rejected": out.meta[META_REJECTED]} for r, out in enumerate((first, second))]
    results = {"rounds": rounds, "data": {"sites": {}}}
    results["degraded"] = degradation(results)
    line = degraded_lines(results)[0]
    assert line.startswith(
        "DEGRADED: site site-3's update was refused in round(s) 0-1: statistic 'fedlsm_q' has 3 "
        "value(s) above 40 (the site's training images in the data check), e.g. 1e+30 at [0]; "
        "statistic 'fedlsm_q' has 3 non-finite value(s)"
    ), line
    (tmp_path / "results.json").write_text(json.dumps(results))
    monkeypatch.setattr(show_results, "render_tables", lambda r: "(tables)")
    assert show_results.main([str(tmp_path / "results.json"), "--no-plot"]) == 0
    assert line in capsys.readouterr().out


def test_robust_options_apply_to_fedmlp_prototypes_and_degrees():
    """Within the declared bounds a site can still send a prototype far from the others (norm 9e3 < 1e4): the mean
    follows it, ``robust: median`` does not (the median of the three sites' values, by hand)."""
    annotated = {s: [True, True, False] for s in N_TRAIN}  # class c missing everywhere: its degree from all three
    outs = {}
    for robust in ("none", "median"):
        agg, engine = _aggregator("fedmlp", {"robust": robust}, annotated=annotated)
        for k, site in enumerate(N_TRAIN):
            p = np.full((C, D), float(k + 1), np.float32)  # 1, 2, 3 per coordinate ...
            if site == "site-3":
                p = np.full((C, D), 4500.0, np.float32)  # ... and a far one (row norm 9000)
            stats = {
                "fedmlp_p0": p,
                "fedmlp_p1": p,
                "fedmlp_proto_counts": np.full((C, 2), 5),
                "fedmlp_degree": np.full(C, [0.2, 0.4, 1.0][k]),
            }
            meta = {
                META_N_TRAIN: N_TRAIN[site],
                META_WEIGHT: 1.0,
                META_GROUPS: GROUPS,
                "annotated": annotated[site],
                **stats,
            }
            assert agg.accept(DXO(DataKind.WEIGHTS, _weights(k), meta).to_shareable(), _ctx(engine, 0, PREV, site))
        outs[robust] = from_shareable(agg.aggregate(_ctx(engine, 0, PREV))).meta
    np.testing.assert_allclose(outs["none"]["fedmlp_global_p0"][:2], np.full((2, D), (1 + 2 + 4500) / 3), rtol=1e-6)
    np.testing.assert_allclose(outs["median"]["fedmlp_global_p0"][:2], np.full((2, D), 2.0))
    np.testing.assert_allclose(outs["median"]["fedmlp_global_p1"][:2], np.full((2, D), 2.0))
    # degrees: classes a, b annotated everywhere keep the fallback 1; class c: n_k-weighted mean vs median
    assert outs["none"]["fedmlp_global_degree"] == pytest.approx([1.0, 1.0, (20 * 0.2 + 30 * 0.4 + 40 * 1.0) / 90])
    assert outs["median"]["fedmlp_global_degree"] == pytest.approx([1.0, 1.0, 0.4])


def test_robust_options_apply_to_fedirm_relation_rows():
    """Relation rows within [0, 1] but far from the others: the mean follows, the median does not (by hand)."""
    annotated = {s: [True, True, True] for s in N_TRAIN}
    outs = {}
    for robust in ("none", "median"):
        agg, engine = _aggregator("fedirm", {"robust": robust, "require_unlabelled": False}, annotated=annotated)
        for k, site in enumerate(N_TRAIN):
            m = np.full((C, C), [0.1, 0.2, 0.9][k])
            meta = {
                META_N_TRAIN: N_TRAIN[site],
                META_WEIGHT: 1.0,
                META_GROUPS: GROUPS,
                "annotated": annotated[site],
                "fedirm_relation": m,
                "fedirm_relation_valid": [1, 1, 1],
            }
            assert agg.accept(DXO(DataKind.WEIGHTS, _weights(k), meta).to_shareable(), _ctx(engine, 0, PREV, site))
        outs[robust] = from_shareable(agg.aggregate(_ctx(engine, 0, PREV))).meta["fedirm_global_relation"]
    np.testing.assert_allclose(outs["none"], np.full((C, C), 0.4))
    np.testing.assert_allclose(outs["median"], np.full((C, C), 0.2))


def test_parameter_groups_must_describe_the_update_and_the_server_uses_its_own():
    from fedpartial.fl.aggregator import groups_problem
    from fedpartial.models import PartialLabelNet

    w = {"a": 1, "b": 2}
    assert groups_problem(None, w) is None and groups_problem({"encoder": ["a"], "classifier": ["b"]}, w) is None
    assert "names tensors the update does not hold, e.g. ['z']" in groups_problem({"classifier": ["z"]}, w)
    assert "repeats tensors" in groups_problem({"encoder": ["a"], "classifier": ["a"]}, w)
    assert "not a mapping" in groups_problem(["a"], w)
    accepted, out, _ = _round("fedavg_masked", {"param_groups": {"classifier": ["nope"]}})
    assert accepted["site-3"] is False and "parameter group 'classifier'" in out.meta[META_REJECTED]["site-3"]
    # with the server's model, its groups are the rule's whatever the first site sent (site-1 claims no classifier)
    net = PartialLabelNet("small_cnn", C, 3, width=2)
    prev = {k: v.numpy() for k, v in net.state_dict().items()}
    agg, engine = _aggregator("fedavg_masked")
    engine.components["model"] = net
    seen = []
    rule_aggregate = agg.rule.aggregate
    agg.rule.aggregate = lambda previous, cs, groups, *a: (
        seen.append(groups),
        rule_aggregate(previous, cs, groups, *a),
    )[1]
    for k, site in enumerate(["site-1", "site-2"]):
        meta = {
            META_N_TRAIN: N_TRAIN[site],
            META_WEIGHT: 1.0,
            "annotated": ANNOTATED[site],
            META_GROUPS: {"classifier": []} if site == "site-1" else net.parameter_groups(),
        }
        w = {key: v + np.float32(0.01 * (k + 1)) if v.dtype.kind == "f" else v for key, v in prev.items()}
        assert agg.accept(DXO(DataKind.WEIGHTS, w, meta).to_shareable(), _ctx(engine, 0, prev, site)), agg.rejected
    agg.aggregate(_ctx(engine, 0, prev))
    assert seen == [net.parameter_groups()]


def test_declarations_follow_the_options():
    """FedLSM's q counted over the batches trained (``q_counts: seen``, the released code) may exceed the site's
    images: it is then bounded below only, and an honest site counting so is not refused."""
    assert get_method("fedlsm").statistic_specs()["fedlsm_q"].high == "n_train"
    assert get_method("fedlsm").statistic_specs(args={"q_counts": "seen"})["fedlsm_q"].high is None
    accepted, out, _ = _round("fedlsm", {"fedlsm_q": np.array([80.0, 0.0, 3.0])}, args={"q_counts": "seen"})
    assert all(accepted.values()) and out.meta[META_REJECTED] == {}
    accepted, out, _ = _round("fedlsm", {"fedlsm_q": np.array([-1.0, 0.0, 3.0])}, args={"q_counts": "seen"})
    assert not accepted["site-3"] and "below 0" in out.meta[META_REJECTED]["site-3"]
