"""The configuration of a run, as one acyclic package; each module imports
only those above it in this list:

- ``value_types``: the converters of option values (ours and other tools');
  imports nothing of ours.
- ``layers``: the layers a value comes from, lowest first, and where the
  properties files live; imports nothing of ours.
- ``schema``: one frozen dataclass section per component, ``RunConfig``, the
  printed groups and their titles.
- ``compat``: other tools' spellings (aliases, their settings rewritten onto
  ours, their defaults); imports only value_types of these.
- ``files``: YAML files read and written (``--config``, config.yaml, a
  resolved configuration handed to another process; read back by
  ``resolution.read_resolved``, which finds the plugins' sections).
- ``options``: the command-line parser, built from the schema.
- ``resolution``: a run's settings from their layers, with provenance,
  into one RunConfig (``resolve``, ``parse``).
- ``checks``: what argparse cannot see, before anything heavy starts.

What happens when a run starts on this node is textbox_like/launch.py's.
One exception stays here: TextBox's --output_prefix names its run by the
time of the first resolution and keeps that name in the environment
(TEXTBOX_LIKE_EXPERIMENT_NAME, compat), so every later resolution in the
process and its children lands in the same directory. Modules of this package import each
other by module (``from .schema import RunConfig``), never through this
file, which only keeps the names the one-module ``textbox_like.config``
had.
"""
import importlib

# each public name and the module that holds it, imported on first use: a
# process that needs only value_types (a worker reading its options) does
# not load resolution, yaml and argparse with it
_HOME = {
    **dict.fromkeys(["load_yaml", "read_text_file", "to_yaml", "write_config", "write_resolved"], "files"),
    **dict.fromkeys(["BUILTIN", "COMMAND_LINE", "CONFIG_FILE", "ENVIRONMENT", "LAYER_NAMES", "OVERALL", "PROPERTIES",
                     "TASK_FILE"], "layers"),
    **dict.fromkeys(["MergeDict", "Options", "program_name", "raise_user_errors", "run_tool"], "options"),
    **dict.fromkeys(["Provenance", "read_resolved", "resolve_namespace"], "resolution"),
    **dict.fromkeys(["BOOL", "INT_LIST", "LITERAL_DICT", "STR_LIST", "float_list", "float_tuple", "int_list",
                     "nonneg_int", "parse_dict", "positive_int", "seed_int", "str2bool", "str_list", "switch",
                     "with_numbers"], "value_types"),
}
__all__ = sorted(_HOME)


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value
