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


def catalog_folders() -> list:
    """The modules ``fedpartial.data.catalog.<folder>`` (one per named dataset's folder)."""
    import importlib

    folders = sorted(p.parent.name for p in (PACKAGE / "data" / "catalog").glob("*/__init__.py"))
    return [importlib.import_module(f"fedpartial.data.catalog.{f}") for f in folders]


def test_each_dataset_constant_is_written_once_in_the_catalog():
    """A release's class names, its other vocabularies' names and its CT windows are written in
    ``data/catalog/<dataset>/__init__.py`` only: no other module of the package (its loader neither, nor a benchmark
    or a job.py) spells a list of four or more of them, or a mapping between them, as a literal of its own (it
    imports the catalog's)."""
    from fedpartial.data import catalog

    constants = []
    for mod in catalog_folders():
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

    constants_files = set((PACKAGE / "data" / "catalog").glob("*/__init__.py"))
    files = [p for p in PACKAGE.rglob("*.py") if p not in constants_files]
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


NAMED_DATASETS = {"ham10000", "isic2019", "isic2018", "nih_cxr14", "chexpert", "mimic_cxr", "rsna_ich", "ich_phantom"}
DERIVED_FROM_THE_CATALOG = ("data/sources/__init__.py", "data/prepare.py", "data/prepare_cli.py", "tools/export.py")


def dataset_names() -> set[str]:
    """Every source, preset and folder name of the catalog (at least the named datasets above)."""
    from fedpartial.data import catalog

    names = set(catalog.DATASETS) | set(catalog.PRESETS) | {m.__name__.rpartition(".")[2] for m in catalog_folders()}
    assert NAMED_DATASETS <= names, sorted(NAMED_DATASETS - names)
    return names


def spelled_dataset_names(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where ``tree`` spells a dataset name in code: a string constant equal to one or listing two or more (not a
    docstring; comments are not in the tree), or an identifier (a name, attribute, argument, function, class,
    keyword or imported module) with one as a ``_``/``.``-delimited part (``load_ham10000``, ``catalog.chexpert``)."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    part = re.compile(
        "|".join(rf"(?<![a-z0-9]){re.escape(n)}(?![a-z0-9])" for n in sorted(names, key=len, reverse=True))
    )
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            listed = set(re.findall(r"[a-z0-9_]+", node.value.lower())) & names
            if node.value in names or len(listed) >= 2:
                found.append((node.lineno, repr(node.value)))
            continue
        identifiers = []
        if isinstance(node, ast.Name):
            identifiers = [node.id]
        elif isinstance(node, ast.Attribute):
            identifiers = [node.attr]
        elif isinstance(node, ast.arg):
            identifiers = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            identifiers = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            identifiers = [node.name]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            identifiers = [getattr(node, "module", None) or ""] + [a.name for a in node.names]
            identifiers += [a.asname for a in node.names if a.asname]
        for ident in identifiers:
            if part.search(ident.lower()):
                found.append((getattr(node, "lineno", 0), ident))
    return found


def test_no_named_dataset_is_spelled_where_the_catalog_is_derived():
    """The source table, prepare (published sources, centre order, vocabulary grouping, the ``--source`` help) and
    the export's DICOM modalities are derived from the catalog's declarations: none of these modules spells a
    named dataset (adding one touches its folder and its docs row only)."""
    names = dataset_names()
    found = [
        f"{rel}:{line}: {what}"
        for rel in DERIVED_FROM_THE_CATALOG
        for line, what in spelled_dataset_names(ast.parse((PACKAGE / rel).read_text()), names)
    ]
    assert found == [], found


def test_the_dataset_name_check_sees_a_spelled_name():
    """The check itself: a literal, a hand-written list in a help text, a loader's name and an import are found; a
    docstring, a comment and one example inside a longer text are not."""
    names = dataset_names()
    code = '''"""Docstring naming ham10000 and chexpert."""
from .catalog.isic2019 import CENTRES  # a comment on nih_cxr14
x = {"rsna_ich": "CT"}
y = load_mimic_cxr
z = "ham10000, isic2018 or csv"
w = "PRESET:SIZE such as nih_cxr14:224"
'''
    found = spelled_dataset_names(ast.parse(code), names)
    assert sorted(line for line, _ in found) == [2, 3, 4, 5], found


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


MAX_FUNCTION_LINES = 100
"""The longest function of ``data/`` (``def`` to its last line, docstring included): a longer one is split into
named steps."""


def long_functions(folder: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function (methods and nested ones too) of ``folder`` over ``limit``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_of_the_data_layer_is_over_100_lines():
    """Every function of ``custom/fedpartial/data/`` fits in 100 lines: a longer one is split into named steps."""
    assert long_functions(PACKAGE / "data") == []


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 100)
    found = long_functions(tmp_path)
    assert len(found) == 1 and "long (101 lines)" in found[0], found


def test_a_site_imports_the_prepare_library_only():
    """``data/site_config.py`` (every site) imports the library of ``data/prepare.py``, neither the command line
    (``data/prepare_cli.py``) nor the figure (``data/prepare_figure.py``, matplotlib)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, fedpartial.data.site_config; "
        "print(sorted(m for m in sys.modules if m.startswith('fedpartial.data.prepare_') or m == 'matplotlib'))"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
