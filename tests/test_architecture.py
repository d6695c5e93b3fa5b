"""The package's import graph (every ``import`` of ``custom/fedpartial``, module level and inside functions, read
with ``ast``) has no circle, and no room imports from a room on its own or a higher floor of the table in
``docs/architecture.md`` ("Floors")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "custom" / "fedpartial"


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; ``from .x import name`` counts as ``x.name`` where that is
    a module, else ``x``."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def floors() -> dict[str, int]:
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("### Floors", 1)[1]
    out = {}
    for floor, rooms in re.findall(r"^\| (\d+) \| (.+) \|$", table, re.M):
        for room in re.findall(r"`([a-z_]+)`", rooms):
            out[room] = int(floor)
    return out


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_no_module_imports_itself_around_a_circle():
    found = circles(import_graph())
    assert not found, f"import circles: {found}"


def test_every_import_goes_to_a_lower_floor():
    floor = floors()
    graph = import_graph()
    rooms = {room(m) for m in graph} - {""}
    assert rooms <= set(floor), f"rooms without a floor in docs/architecture.md: {sorted(rooms - set(floor))}"
    upward = sorted(
        f"{a} -> {b}"
        for a, bs in graph.items()
        for b in bs
        if room(a) and room(b) and room(a) != room(b) and floor[room(b)] >= floor[room(a)]
    )
    assert not upward, f"imports to a room on the same or a higher floor: {upward}"


def test_the_checks_see_a_circle_and_an_upward_arrow():
    """The checks themselves: a circle made by hand is found; models -> methods would be an upward arrow."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    floor = floors()
    assert floor["methods"] > floor["models"] and floor["tools"] > floor["fl"] > floor["methods"]


def test_no_private_name_crosses_modules():
    """A module's ``_name`` is its own: another module of the package that needs it gets a public name instead."""
    crossing = []
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fedpartial")):
                crossing += [
                    f"{mod} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not crossing, crossing


def test_each_dataset_constant_is_written_once_in_the_catalog():
    """A release's class names, its other vocabularies' names and its CT windows are written in
    ``data/catalog/<dataset>.py`` only: no other module of the package (nor a benchmark or a job.py) spells a list of four or
    more of them, or a mapping between them, as a literal of its own (it imports the catalog's)."""
    from fedpartial.data import catalog

    constants = []
    for mod in (
        catalog.ich,
        catalog.ham10000,
        catalog.isic2019,
        catalog.nih_cxr14,
        catalog.chexpert,
        catalog.mimic_cxr,
    ):
        for name, value in vars(mod).items():
            if name.isupper() and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                constants.append((f"{mod.__name__}.{name}", set(value)))
            elif name.isupper() and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
                constants.append((f"{mod.__name__}.{name}", set(value) | set(value.values())))
    assert len(constants) >= 12, constants
    windows = {tuple(map(float, w)) for w in catalog.ich.CT_WINDOWS}

    def literals(tree):
        for node in ast.walk(tree):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                if len(node.elts) >= 4 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
                ):
                    yield node.lineno, {e.value for e in node.elts}
                if node.elts and all(isinstance(e, (ast.Tuple, ast.List)) and len(e.elts) == 2 for e in node.elts):
                    pairs = {tuple(getattr(x, "value", None) for x in e.elts) for e in node.elts}
                    if all(isinstance(v, (int, float)) for p in pairs for v in p) and windows <= pairs:
                        yield node.lineno, "the CT windows"
            elif isinstance(node, ast.Dict) and node.keys:  # a name mapping: strings to strings only
                kv = [*node.keys, *node.values]
                if all(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in kv):
                    yield node.lineno, ("dict", {x.value for x in kv})

    files = [p for p in PACKAGE.rglob("*.py") if "catalog" not in p.parts]
    files += sorted((REPO / "benchmarks").glob("*.py")) + sorted((REPO / "jobs").glob("*/job.py"))
    found = []
    for path in files:
        for line, lit in literals(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{line}"
            if lit == "the CT windows":
                found.append((where, lit))
                continue
            is_dict = isinstance(lit, tuple)
            strings = lit[1] if is_dict else lit
            for name, const in constants:
                if (is_dict and len(strings) >= 4 and strings == const) or (not is_dict and len(strings & const) >= 4):
                    found.append((where, name))
    assert found == [], found


def test_an_import_of_the_package_inside_a_function_says_why():
    """No import inside a function hides a circle (the graph above counts them); one kept there for start-up cost
    says so in a comment on its line or above its block of imports (what it loads); every other one is at the top."""
    silent = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fedpartial")):
                    above = node.lineno - 2  # the comment may head a block of imports
                    while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
                        above -= 1
                    around = lines[node.lineno - 1 : node.end_lineno] + lines[max(above, 0) : above + 1]
                    if not any("#" in line for line in around):
                        silent.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert silent == [], silent
