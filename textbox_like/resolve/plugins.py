"""Components from outside this package: a user's own folder (``--user-dir
DIR``, fairseq's and HetSeq's spelling; ``user_dir`` in a configuration file)
and installed packages (the entry-point group ``textbox_like.resolve.plugins``).
Importing them runs their ``@register_task``, ``@register_optimizer`` and
``@register_scheduler``, so they must be imported before a parser is built
or a configuration read: config/resolution.py does both (``resolve`` scans
the command line, its Python settings and its --config files for the user
dir first; ``read_resolved``, which a spawned rank or a search trial runs,
reads it from the file).

A registration refused (a taken name, a class of the wrong kind) is one line
(registry.RegistrationError); anything else the user's code raises while it
is imported is theirs: it goes on with its traceback, which points at their
file and line, and a note naming the folder.

This module imports no heavy library: ``--help`` must answer at once.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from textbox_like.config.value_types import absolute_path
from textbox_like.core.errors import UserError

#: installed packages name a module here (``[project.entry-points."textbox_like.resolve.plugins"]``);
#: importing it registers its components
ENTRY_POINT_GROUP = "textbox_like.resolve.plugins"

_imported_dirs = set()
_installed_loaded = False


def load_plugins(user_dir=None, task_class=None):
    """The installed plugins (once per process), then ``user_dir``'s
    package, if any (once per folder), then the task class a run records
    (``task_class``, ``MODULE:CLASS``), if any."""
    load_installed()
    if user_dir:
        import_user_dir(user_dir)
    if task_class:
        import_task_class(task_class)


def load_installed():
    """Import every module the entry-point group names."""
    global _installed_loaded
    if _installed_loaded:
        return
    _installed_loaded = True
    from importlib.metadata import entry_points
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            point.load()
        except UserError:
            raise
        except ModuleNotFoundError as exc:
            if not names_a_missing_module(point, exc):
                add_note(exc, f"(raised while importing the installed plugin {point.name} = {point.value}, entry "
                              f"point group {ENTRY_POINT_GROUP}: the traceback above ends in that package's code)")
                raise
            # a dangling entry point (its package removed or renamed) is no reason to refuse every
            # command: it is named, and skipped; a component it would have given is then unknown
            dist = getattr(point, "dist", None)
            owner = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
            print(f"warning: the installed plugin {point.name} = {point.value} (entry point group "
                  f"{ENTRY_POINT_GROUP}, from {owner}) names a module that does not exist; skipped: fix that "
                  f"package's entry point, or uninstall it"
                  + (f" (pip uninstall {dist.name})" if dist is not None else ""), file=sys.stderr)
        except Exception as exc:
            add_note(exc, f"(raised while importing the installed plugin {point.name} = {point.value}, entry point "
                          f"group {ENTRY_POINT_GROUP}: the traceback above ends in that package's code)")
            raise


def names_a_missing_module(point, exc) -> bool:
    """Whether ``exc`` (a ModuleNotFoundError of ``point.load()``) is the entry
    point's own module (or a package above it) not existing, rather than an
    import inside that module's code failing."""
    missing = getattr(exc, "name", None)
    module = point.value.split(":", 1)[0].strip()
    return bool(missing) and (module == missing or module.startswith(missing + "."))


def add_note(exc, text):
    """``exc.add_note(text)`` where Python has it (3.11); before, the text
    goes to stderr ahead of the traceback."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:
        print(text, file=sys.stderr)


def import_user_dir(user_dir):
    """Import the package in the folder ``user_dir`` under its folder's name,
    as fairseq's --user-dir does (its modules import each other by that
    name or relatively). UserError for a folder that is missing, is no
    package, or whose name is another module's."""
    folder = Path(absolute_path(user_dir))
    if folder in _imported_dirs:
        return
    if not folder.exists():
        raise UserError(f"--user-dir {user_dir}: no such directory; give the folder of your components, a Python "
                        f"package (a folder with an __init__.py that imports your modules)")
    if not folder.is_dir():
        raise UserError(f"--user-dir {user_dir} is a file, not a directory; give the folder of your components, "
                        f"a Python package (a folder with an __init__.py that imports your modules)")
    init = folder / "__init__.py"
    if not init.is_file():
        raise UserError(f"--user-dir {user_dir} is not a Python package: it has no __init__.py; add "
                        f"{init} importing your modules (e.g. 'from . import my_task')")
    name = folder.name
    if name in sys.modules:
        origin = getattr(sys.modules[name], "__file__", None)
    else:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        origin = found.origin if found is not None and found.has_location else None
    if origin is not None and Path(origin).resolve() != init.resolve() or origin is None and name in sys.modules:
        raise UserError(f"--user-dir {user_dir}: its name {name!r} is that of another module "
                        f"({origin or 'built in'}), which it would hide; rename the folder")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(name, None)
            if isinstance(exc, Exception) and not isinstance(exc, UserError):
                add_note(exc, f"(raised while importing --user-dir {folder}: the traceback above ends in your code)")
            raise
    _imported_dirs.add(folder)


def class_path(cls) -> str:
    """``MODULE:QUALNAME``, what ``task_class`` records of a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def why_not_importable(cls):
    """Why a fresh interpreter (a spawned rank, a search trial, a later
    ``--config SAVE_DIR/config.yaml``) cannot import ``cls`` by its path,
    or None where it can."""
    if cls.__module__ == "__main__":
        return "it is defined in __main__ (a notebook, stdin or the script that started the run)"
    if "<locals>" in cls.__qualname__:
        return "it is defined inside a function"
    return None


def module_root(cls):
    """The folder on sys.path that ``cls``'s module is imported from, or
    None (a module without a file)."""
    module = sys.modules.get(cls.__module__)
    where = getattr(module, "__file__", None)
    if not where:
        return None
    path = Path(where).resolve()
    if path.name == "__init__.py":
        path = path.parent
    return str(path.parents[len(cls.__module__.split(".")) - 1])


def register_task_class(cls) -> str:
    """The task name of the class ``cls``: the one it is registered under,
    else it is registered now under its ``name`` (set in its own body) or
    else its class name. The same class defined again (a notebook cell run
    twice) takes its earlier version's place; another class holding that
    name is one line (registry.NameTaken)."""
    from textbox_like.tasks import TASKS
    for name, held in TASKS.items():
        if held is cls:
            return name
    name = vars(cls).get("name") if isinstance(cls, type) else None
    name = name if isinstance(name, str) and name else getattr(cls, "__name__", repr(cls))
    if name in TASKS:
        held = TASKS.get(name)
        if class_path(held) == class_path(cls) and held.__module__.split(".")[0] != __name__.split(".")[0]:
            TASKS.unregister(TASKS.canonical(name))
    TASKS.register(name)(cls)
    return name


def import_task_class(path) -> str:
    """The task name of the class ``path`` (``MODULE:QUALNAME``) names,
    imported (and registered, where its module does not) in this process;
    a class that is not there is one line naming the fix."""
    from textbox_like.tasks import TASKS
    for name, held in TASKS.items():
        if class_path(held) == path:
            return name
    module_name, _, qualname = str(path).partition(":")
    fix = ("put the class in a module of its own (on PYTHONPATH, or in a --user-dir package) and pass it from "
           "there")
    if not module_name or not qualname:
        raise UserError(f"task_class {path!r}: give the task's class as MODULE:CLASS (e.g. my_tasks:MyTask)")
    if "<locals>" in qualname:
        raise UserError(f"task_class {path}: the class was defined inside a function, which no other process "
                        f"can import; {fix}")
    if module_name == "__main__" and not hasattr(sys.modules.get("__main__"), qualname.split(".")[0]):
        raise UserError(f"task_class {path}: the class was defined in the __main__ of the program that started "
                        f"the run (a notebook, stdin or a script), which this process cannot import; {fix}")
    try:
        found = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise       # an import inside the user's module: theirs, with its traceback
        raise UserError(f"task_class {path}: no module named {exc.name!r} here; put the folder holding it on "
                        f"PYTHONPATH, or the module in a --user-dir package") from None
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise UserError(f"task_class {path}: module {module_name} has no {qualname}; give the class's "
                            f"MODULE:CLASS")
    return register_task_class(found)
