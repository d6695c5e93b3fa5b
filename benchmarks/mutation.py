"""Mutation run of FedIRM and surgical aggregation: does a test fail when a behaviour is removed?

    python benchmarks/mutation.py --out benchmarks/results/mutation

For every mutation below, a temporary copy of ``custom/`` gets one source patch (an exact text replacement that
must match once, so a mutation that no longer applies is an error, not a silent pass), and the method's targeted
test file (``tests/test_fedirm.py`` or ``tests/test_surgical.py``, without the simulator tests) runs against the
copy (``PYTHONPATH`` puts it before the installed package; the run checks that the copy is the one imported).
A mutation is caught when at least one test fails; the table names the first failing test (pytest ``-x``, in
file order: the hand-computed tests come first; ``--all-tests`` runs the whole file and names every failing test).
The unmutated copy runs first and must pass every test. Left out of every run: the simulator tests and
``DESELECT`` (a model-architecture test that no mutation touches and that costs a DenseNet-121 build). Writes
``<out>.md`` and ``<out>.json``; ``--only NAME`` runs some mutations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FEDIRM = "custom/fedpartial/methods/fedirm"
SURGICAL = "custom/fedpartial/methods/surgical"


@dataclass
class Mutation:
    name: str
    what: str  # the behaviour removed, in words
    path: str  # file, relative to the checkout root
    patches: list[tuple[str, str]]  # (old, new): each old must occur exactly once
    tests: str  # the test file run
    origin: str = "issue"  # issue: listed as uncaught; caught: listed as caught before; option: a new option
    extra: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)  # patches of further files


T_FEDIRM, T_SURGICAL = "tests/test_fedirm.py", "tests/test_surgical.py"
DESELECT = ["tests/test_surgical.py::test_paper_head_for_every_backbone_and_only_the_last_dense_is_the_task_block[densenet121]"]

MUTATIONS = [
    # ---------------------------------------------------------------- FedIRM, listed as not caught
    Mutation("irm_sign", "IRM term's sign flipped", f"{FEDIRM}/trainer.py",
             [("loss = loss + i_loss", "loss = loss - i_loss")], T_FEDIRM),
    Mutation("consistency_sign", "consistency term's sign flipped", f"{FEDIRM}/trainer.py",
             [("loss = loss + c_loss", "loss = loss - c_loss")], T_FEDIRM),
    Mutation("ramp_not_applied", "ramp-up weight never applied", f"{FEDIRM}/trainer.py",
             [("            loss = w * loss\n", "            loss = loss\n")], T_FEDIRM),
    Mutation("teacher_is_student", "teacher replaced by the student", f"{FEDIRM}/trainer.py",
             [('t_out = teacher_forward(teacher, b["image_2"])', 't_out = teacher_forward(model, b["image_2"])')], T_FEDIRM),
    Mutation("views_swapped", "teacher and student views swapped", f"{FEDIRM}/trainer.py",
             [('out = model(b["image"])', 'out = model(b["image_2"])'),
              ('t_out = teacher_forward(teacher, b["image_2"])', 't_out = teacher_forward(teacher, b["image"])'),
              ('self.unlabelled_relation(b["image"], out)', 'self.unlabelled_relation(b["image_2"], out)')], T_FEDIRM),
    Mutation("irm_row_mask_ignored", "IRM row mask ignored", f"{FEDIRM}/trainer.py",
             [("i_loss = symmetric_kl(received[0], m, rows, self.kind, self.opts.kl)",
               "i_loss = symmetric_kl(received[0], m, None, self.kind, self.opts.kl)")], T_FEDIRM),
    Mutation("filter_on_teacher", "uncertainty filter run on the teacher", f"{FEDIRM}/trainer.py",
             [("passes = mc_dropout_probs(self.ctx.model, x,", "passes = mc_dropout_probs(self.teacher, x,")], T_FEDIRM),
    Mutation("labelled_ce_one_view", "labelled CE on one view only", f"{FEDIRM}/trainer.py",
             [("+ supervised_loss(o2, t, known, self.kind, self.opts.label_smoothing))",
               "+ 0.0 * supervised_loss(o2, t, known, self.kind, self.opts.label_smoothing))")], T_FEDIRM),
    Mutation("labelled_matrix_from_probs", "labelled relation matrix from probabilities", f"{FEDIRM}/trainer.py",
             [("m, n = relation_matrix(o1.detach().float(), t.float(),",
               "m, n = relation_matrix(torch.softmax(o1.detach().float(), 1), t.float(),")], T_FEDIRM),
    Mutation("labelled_loss_ramped", "labelled loss scaled by the ramp", f"{FEDIRM}/trainer.py",
             [("            self.step(loss)\n            with torch.no_grad():\n                m, n = relation_matrix(",
               "            self.step(self.loss_weight(round_num) * loss)\n            with torch.no_grad():\n"
               "                m, n = relation_matrix(")], T_FEDIRM),
    # ---------------------------------------------------------------- FedIRM, listed as caught
    Mutation("matrix_detached", "unlabelled relation matrix detached (no IRM gradient)", f"{FEDIRM}/trainer.py",
             [('rows = outputs if self.opts.unlabelled_rows == "logits"',
               'rows = outputs.detach() if self.opts.unlabelled_rows == "logits"')], T_FEDIRM, "caught"),
    Mutation("softmax_axis", "relation rows: softmax over the wrong axis", f"{FEDIRM}/maths.py",
             [("m = torch.softmax(v / tau, dim=1) if kind", "m = torch.softmax(v / tau, dim=0) if kind")], T_FEDIRM, "caught"),
    Mutation("consistency_on_logits", "consistency on logits instead of probabilities", f"{FEDIRM}/maths.py",
             [("diff = act(student_logits) - act(teacher_logits.detach())",
               "diff = student_logits - teacher_logits.detach()")], T_FEDIRM, "caught"),
    Mutation("pseudo_label", "pseudo label: arg-min instead of arg-max", f"{FEDIRM}/maths.py",
             [("targets = F.one_hot(source.argmax(1),", "targets = F.one_hot(source.argmin(1),")], T_FEDIRM, "caught"),
    Mutation("ema_removed", "mean teacher never updated (EMA removed)", f"{FEDIRM}/trainer.py",
             [("            self.mean_teacher.update(model, self.opts.ema_max_decay)\n", "            pass\n")],
             T_FEDIRM, "caught"),
    Mutation("unlabelled_matrices_averaged", "server averages the unlabelled sites' matrices too", f"{FEDIRM}/rule.py",
             [("with_m = [c for c in contributions if c.annotated.any() and META_RELATION in c.meta]",
               "with_m = [c for c in contributions if META_RELATION in c.meta]")], T_FEDIRM, "caught"),
    # ---------------------------------------------------------------- FedIRM, options (ignored)
    Mutation("pseudo_label_option_ignored", "option pseudo_label ignored (always the forward pass)", f"{FEDIRM}/trainer.py",
             [('source = conf if self.opts.pseudo_label == "forward" else None', "source = conf")], T_FEDIRM, "option"),
    Mutation("pseudo_label_from_mc_mean", "default pseudo label from the MC mean (the previous reading)",
             f"{FEDIRM}/trainer.py",
             [('source = conf if self.opts.pseudo_label == "forward" else None', "source = None")], T_FEDIRM, "option"),
    Mutation("role_lr_ignored", "per-role learning rates ignored (train.lr everywhere)", f"{FEDIRM}/trainer.py",
             [('            group["lr"] = self.learning_rate(round_num)\n', "            pass\n")], T_FEDIRM, "option"),
    Mutation("lr_switch_at_warm_ignored", "labelled_lr_after_warm applied from round 0", f"{FEDIRM}/trainer.py",
             [("if round_num >= self.opts.warm_rounds and self.opts.labelled_lr_after_warm is not None:",
               "if self.opts.labelled_lr_after_warm is not None:")], T_FEDIRM, "option"),
    Mutation("optimizer_state_ignored", "train.keep_optimizer_state ignored (always a fresh optimiser)",
             "custom/fedpartial/methods/base.py",
             [("        if self.keeps_optimizer_state:\n            # the previous round's optimiser",
               "        if False:\n            # the previous round's optimiser")], T_FEDIRM, "option"),
    Mutation("warm_rounds_off_by_one", "warm rounds end one round late (round == warm_rounds sits out)",
             f"{FEDIRM}/trainer.py",
             [('if self.opts.unlabelled == "skip" or round_num < self.opts.warm_rounds:',
               'if self.opts.unlabelled == "skip" or round_num <= self.opts.warm_rounds:')], T_FEDIRM, "option"),
    # ---------------------------------------------------------------- surgical aggregation
    Mutation("warmup_best_epoch_removed", "warm-up best-epoch selection removed (last epoch's weights kept)",
             f"{SURGICAL}/trainer.py",
             [("                model.load_state_dict({**model.state_dict(), **best_state})\n", "                pass\n")],
             T_SURGICAL),
    Mutation("surgical_rows_over_all_sites", "task block rows averaged over all sites", f"{SURGICAL}/rule.py",
             [('if self.opts.task_block == "masked":', "if False:")], T_SURGICAL, "caught"),
    Mutation("pfl_head_shared", "PFL: the task block shared (not kept local)", f"{SURGICAL}/__init__.py",
             [('**PAPER, keep_local=["classifier"])', "**PAPER)")], T_SURGICAL, "caught"),
    Mutation("norm_frozen_ignored", "norm: frozen ignored (BatchNorm trains; the individual baseline's code option)",
             "custom/fedpartial/methods/base.py",
             [('        if self.opts.norm == "frozen":\n            for m in model.modules():',
               '        if False:\n            for m in model.modules():')], T_SURGICAL, "option"),
    Mutation("min_delta_ignored", "early stopping min_delta ignored", "custom/fedpartial/fl/selection.py",
             [("if self.patience_metric is None or self.best_val_metric > self.patience_metric + self.min_delta:",
               "if True:")], T_SURGICAL, "option"),
]


def _apply(root: Path, path: str, patches: list[tuple[str, str]]) -> None:
    f = root / path
    text = f.read_text()
    for old, new in patches:
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutation patch for {path} matches {n} times (needs exactly 1): {old[:80]!r}")
        text = text.replace(old, new)
    f.write_text(text)


def _run_tests(copy_root: Path, test_file: str, xml: Path, first_failure: bool = False
               ) -> tuple[int, list[str], int, float]:
    """Run one test file against ``copy_root/custom``; returns (rc, failing test ids, tests run, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy_root / "custom")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not integration", test_file,
           f"--junitxml={xml}", *(f"--deselect={d}" for d in DESELECT if d.startswith(test_file))]
    if first_failure:
        cmd.append("-x")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if not xml.exists():
        raise SystemExit(f"pytest wrote no report ({test_file}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    failed, total = [], 0
    for case in ET.parse(xml).getroot().iter("testcase"):
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(case.get("name"))
    return proc.returncode, failed, total, seconds


def _check_import(copy_root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(copy_root / "custom")}
    out = subprocess.run([sys.executable, "-c", "import fedpartial; print(fedpartial.__file__)"], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    if not out.startswith(str(copy_root)):
        raise SystemExit(f"the mutated copy is not the imported package ({out})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/mutation", help="output prefix (.md and .json)")
    ap.add_argument("--only", nargs="*", help="run only these mutations (by name)")
    ap.add_argument("--all-tests", action="store_true", help="run the whole test file for each mutation (default: "
                                                                "stop at the first failing test)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        raise SystemExit(f"unknown mutation(s): {sorted(set(args.only) - {m.name for m in MUTATIONS})}")
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedpartial-mutation-") as tmp:
        tmp = Path(tmp)
        pristine = tmp / "pristine"
        shutil.copytree(REPO / "custom", pristine / "custom", ignore=shutil.ignore_patterns("__pycache__"))
        _check_import(pristine)
        baseline = {}
        for test_file in sorted({m.tests for m in chosen}):
            rc, failed, total, sec = _run_tests(pristine, test_file, tmp / "baseline.xml")
            (tmp / "baseline.xml").unlink()
            if rc != 0 or failed:
                raise SystemExit(f"the unmutated code fails {test_file}: {failed}")
            baseline[test_file] = {"tests": total, "seconds": round(sec, 1)}
            print(f"baseline {test_file}: {total} tests pass ({sec:.0f} s)", flush=True)
        for m in chosen:
            work = tmp / m.name
            shutil.copytree(pristine, work)
            _apply(work, m.path, m.patches)
            for path, patches in m.extra:
                _apply(work, path, patches)
            rc, failed, total, sec = _run_tests(work, m.tests, tmp / f"{m.name}.xml", not args.all_tests)
            rows.append({"name": m.name, "what": m.what, "file": m.path, "origin": m.origin, "tests": m.tests,
                         "caught": bool(failed), "failing": failed, "run": total, "seconds": round(sec, 1)})
            print(f"{m.name:32s} {'CAUGHT' if failed else 'MISSED'} by {len(failed)} / {total}: {', '.join(failed)}",
                  flush=True)
            shutil.rmtree(work)
    total_s = time.perf_counter() - started
    result = {"command": "python benchmarks/mutation.py" + (" --all-tests" if args.all_tests else "")
              + (f" --only {' '.join(args.only)}" if args.only else ""), "first_failure": not args.all_tests,
              "baseline": baseline, "mutations": rows, "caught": sum(r["caught"] for r in rows), "total": len(rows),
              "seconds": round(total_s, 1)}
    out = REPO / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(_markdown(result))
    print(f"{result['caught']} / {result['total']} mutations caught ({total_s:.0f} s); wrote {out}.md / .json")
    return 0 if result["caught"] == result["total"] else 1


def _markdown(result: dict) -> str:
    origin = {"issue": "previously not caught", "caught": "previously caught", "option": "option / schedule"}
    lines = [
        "# Mutation run: FedIRM and surgical aggregation",
        "",
        f"Command: `{result['command']}` ({result['seconds']:.0f} s on the shared 2-core machine). Each mutation is",
        "one source patch on a temporary copy of `custom/`; the method's test file runs against it (simulator tests",
        "left out" + (", stopping at the first failing test: the table names that test" if result["first_failure"]
                      else "; the table names every failing test") + "). Caught = at least one test fails. "
        "The unmutated code passes: "
        + ", ".join(f"`{k}` {v['tests']} tests" for k, v in result["baseline"].items()) + ".",
        "",
        f"**{result['caught']} of {result['total']} mutations caught.**",
        "",
        "| mutation | behaviour removed | file | kind | caught by |",
        "|---|---|---|---|---|",
    ]
    for r in result["mutations"]:
        by = ", ".join(f"`{t}`" for t in r["failing"]) if r["failing"] else "**not caught**"
        lines.append(f"| `{r['name']}` | {r['what']} | `{r['file'].removeprefix('custom/fedpartial/')}` | "
                     f"{origin[r['origin']]} | {by} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
