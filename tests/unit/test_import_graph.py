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
    assert {"textbox_like.config.schema", "textbox_like.tasks"} <= graph["textbox_like.resolve.resolution"]
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(c, graph) for c in found)


def test_the_configuration_is_layered():
    graph = import_graph(PACKAGE_DIR, "textbox_like")
    config = {name: deps for name, deps in graph.items() if name.startswith("textbox_like.config.")}
    assert graph["textbox_like.config.value_types"] == set()
    assert graph["textbox_like.config.layers"] == set()
    assert graph["textbox_like.config.compat"] <= {"textbox_like.config.schema", "textbox_like.config.value_types",
                                                   "textbox_like.core.errors"}
    for name, deps in config.items():
        assert "textbox_like.config" not in deps, f"{name} imports the package's __init__; import the module"
        assert not deps & {"textbox_like.launch", "textbox_like.processes.distributed", "textbox_like.cli",
                           "textbox_like.training.outcome"}, f"{name} imports launch or training code: {sorted(deps)}"


#: the folders of textbox_like, top first: each imports only from its own folder
#: and those below it (a lazy import inside a function too). The package's own
#: top level is the entry points, in two tiers: the command and the package
#: (which reach every tool by name), and the trainer's command line, Python API
#: and launcher, which the tools call. docs/code-map.md tells the same story.
LAYERS = (
    ("textbox_like", "textbox_like.__main__", "textbox_like.commands"),
    ("textbox_like.tools",),         # commands other than training: bench, export, eval, prepare_bert
    ("textbox_like.cli", "textbox_like.api", "textbox_like.launch"),
    ("textbox_like.search",),        # hyperparameter search and seeds, local and on Ray Tune
    ("textbox_like.training",),      # the loop and its components, the balancer, the validator
    ("textbox_like.resolve",),       # command line and settings to a checked RunConfig: knows every registry
    ("textbox_like.tasks",),         # what is trained: a model, datasets, a loss
    ("textbox_like.callbacks",),     # the public callback contract, its registry, the record callbacks
    ("textbox_like.models",),
    ("textbox_like.data",),
    ("textbox_like.parallel",),      # Accelerate's Accelerator, FSDP2 sharding, malloc
    ("textbox_like.optim",),         # optimizers and LR schedulers
    ("textbox_like.processes",),     # ranks, process groups, the torchrun agent's notes, signals
    ("textbox_like.config",),        # the schema layer: value types, sections, registries, files
    ("textbox_like.metrics",),       # meters, trackers, text metrics, curves
    ("textbox_like.storage",),       # files, locks, checkpoints of both formats
    ("textbox_like.core",),          # errors, faults, small leaves
)
ENTRY_POINTS = {"__init__", "__main__", "commands", "cli", "api", "launch"}


def layer_of(module: str) -> int:
    """The index in LAYERS of the folder (or top-level entry point) holding ``module``."""
    found = [i for i, group in enumerate(LAYERS) for name in group
             if module == name or (name != "textbox_like" and module.startswith(name + "."))]
    assert found, f"{module} is in no layer: add its folder to LAYERS"
    return found[0]


def upward_imports(graph) -> list:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if layer_of(b) < layer_of(a))


def test_every_folder_imports_only_from_itself_and_the_folders_below_it():
    graph = import_graph(PACKAGE_DIR, "textbox_like")
    assert upward_imports(graph) == []


def test_the_layering_check_finds_an_upward_import_lazy_or_not(tmp_path):
    graph = import_graph(PACKAGE_DIR, "textbox_like")
    graph["textbox_like.core.errors"] = graph["textbox_like.core.errors"] | {"textbox_like.storage.fileio"}
    graph["textbox_like.config.schema"] = graph["textbox_like.config.schema"] | {"textbox_like.cli"}
    assert upward_imports(graph) == ["textbox_like.config.schema -> textbox_like.cli",
                                     "textbox_like.core.errors -> textbox_like.storage.fileio"]
    pkg = tmp_path / "textbox_like"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "errors.py").write_text("def f():\n    from textbox_like.cli import main\n")
    (pkg / "cli.py").write_text("")
    assert upward_imports(import_graph(pkg, "textbox_like")) == ["textbox_like.core.errors -> textbox_like.cli"]


def test_the_top_level_holds_only_the_entry_points_and_every_folder_is_a_layer():
    top = {p.stem for p in PACKAGE_DIR.glob("*.py")}
    assert top == ENTRY_POINTS
    folders = {p.name for p in PACKAGE_DIR.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert {f"textbox_like.{f}" for f in folders} == {name for group in LAYERS[1:] for name in group
                                                      if name.count(".") == 1 and not name.endswith(
                                                          tuple(ENTRY_POINTS))}


def test_no_class_over_400_lines():
    import ast
    long = []
    for path in PACKAGE_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                long.append(f"{path.relative_to(PACKAGE_DIR)}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert long == []


def long_functions(package_dir: Path, limit: int = 80) -> list:
    """Every function (method, nested function) of the package longer than ``limit`` lines, nested ones counted
    in the function that holds them."""
    long = []
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{path.relative_to(package_dir)}:{node.name} ({node.end_lineno - node.lineno + 1})")
    return long


def test_no_function_over_80_lines():
    assert long_functions(PACKAGE_DIR) == []


def given_the_trainer(path: Path) -> list:
    """Where a module gives a component the whole trainer: an ``__init__`` that takes a parameter named
    ``trainer``, or a ``self.trainer``. A component is given the few objects it uses (issue 48)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__init__":
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            found += [f"{path.name}:{node.lineno} __init__ takes trainer" for a in arguments if a.arg == "trainer"]
        if isinstance(node, ast.Attribute) and node.attr == "trainer" and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            found.append(f"{path.name}:{node.lineno} self.trainer")
    return sorted(set(found), key=lambda line: int(line.split(":")[1].split()[0]))


def test_training_components_are_given_their_collaborators_not_the_trainer():
    """Only trainer.py holds the trainer; what two components share is one object both are given."""
    found = []
    for path in sorted((PACKAGE_DIR / "training").glob("*.py")):
        if path.name != "trainer.py":
            found += given_the_trainer(path)
    assert found == []


def test_the_collaborator_check_finds_a_component_given_the_trainer(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("class Given:\n"
                       "    def __init__(self, cfg, *, trainer):\n"
                       "        self.cfg = cfg\n"
                       "\n"
                       "\n"
                       "class Keeps:\n"
                       "    def __init__(self, t):\n"
                       "        self.trainer = t\n"
                       "\n"
                       "    def step(self):\n"
                       "        return self.trainer.step\n")
    assert given_the_trainer(planted) == ["planted.py:2 __init__ takes trainer", "planted.py:8 self.trainer",
                                          "planted.py:11 self.trainer"]
    fine = tmp_path / "fine.py"
    fine.write_text("class Step:\n    def __init__(self, cfg, optimizer):\n        self.optimizer = optimizer\n\n\n"
                    "def peer_lost(trainer, exc):\n    return trainer.state\n")
    assert given_the_trainer(fine) == []
