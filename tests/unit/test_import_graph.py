"""No import cycle among textbox_like's modules, read statically (ast): every
``import`` and ``from ... import`` of every module, at its top or inside a
function (a lazy import closes a cycle as surely as a top-level one, only
later), counts as an edge. ``from . import name`` is an edge to the module
``name`` where there is one, else to the package whose __init__ defines it.
Plugins found at run time (importlib over a package's folder) are not edges.

The configuration package is checked for its layering too: value types and
layers import nothing of ours, compat only value types (and errors.py), and
no module of it imports the package's __init__ or the launch code."""
from __future__ import annotations

import ast
from pathlib import Path

import textbox_like

PACKAGE_DIR = Path(textbox_like.__file__).resolve().parent


def module_files(package_dir: Path, package: str) -> dict:
    """{module name: (path, whether it is a package's __init__)} of every .py under ``package_dir``."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def imported_modules(name: str, path: Path, is_package: bool, modules: dict, package: str) -> set:
    """The modules of ``package`` that the module ``name`` imports anywhere in its text."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target != package and not target.startswith(package + "."):
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                out.add(target)
    return out


def import_graph(package_dir: Path, package: str) -> dict:
    modules = module_files(package_dir, package)
    return {name: imported_modules(name, path, is_package, modules, package)
            for name, (path, is_package) in modules.items()}


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each a frozenset."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(start):
        # iterative: a deep package must not hit Python's recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe(component, graph) -> str:
    return "; ".join(f"{a} -> {', '.join(sorted(b for b in graph[a] if b in component))}"
                     for a in sorted(component))


def test_the_walker_finds_a_cycle_through_a_lazy_import(tmp_path):
    """The check itself: a cycle closed inside a function, through a
    package's __init__, is found; a package importing its plugins is not one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import helper\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import helper\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\nimport os\n")
    (pkg / "d.py").write_text("from .sub.c import helper\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.d"] == {"pkg.sub.c"} and graph["pkg.sub"] == {"pkg.sub.c"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"})]
    (pkg / "b.py").write_text("thing = 1\n")
    assert cycles(import_graph(pkg, "pkg")) == []


def test_no_import_cycle_among_textbox_like_modules():
    graph = import_graph(PACKAGE_DIR, "textbox_like")
    # the walk sees top-level and lazy imports alike (resolution imports the task registry inside functions)
    assert {"textbox_like.config.schema", "textbox_like.tasks"} <= graph["textbox_like.config.resolution"]
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(c, graph) for c in found)


def test_the_configuration_is_layered():
    graph = import_graph(PACKAGE_DIR, "textbox_like")
    config = {name: deps for name, deps in graph.items() if name.startswith("textbox_like.config.")}
    assert graph["textbox_like.config.value_types"] == set()
    assert graph["textbox_like.config.layers"] == set()
    assert graph["textbox_like.config.compat"] <= {"textbox_like.config.schema", "textbox_like.config.value_types",
                                                   "textbox_like.errors"}
    for name, deps in config.items():
        assert "textbox_like.config" not in deps, f"{name} imports the package's __init__; import the module"
        assert not deps & {"textbox_like.launch", "textbox_like.distributed", "textbox_like.cli",
                           "textbox_like.trainer"}, f"{name} imports launch or training code: {sorted(deps)}"
