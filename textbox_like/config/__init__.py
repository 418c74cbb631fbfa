"""The configuration's schema layer, one acyclic package; each module imports
only those above it in this list:

- ``value_types``: the converters of option values (ours and other tools');
  imports nothing of ours.
- ``layers``: the layers a value comes from, lowest first, and where the
  properties files live; imports nothing of ours.
- ``schema``: one frozen dataclass section per component, ``RunConfig``, the
  printed groups and their titles.
- ``registry``: name -> class registries (tasks, optimizers, schedulers,
  callbacks) with their typed options.
- ``compat``: other tools' spellings (aliases, their settings rewritten onto
  ours, their defaults); imports only value_types of these.
- ``files``: YAML files read and written (``--config``, config.yaml, a
  resolved configuration handed to another process).

The command-line parser and the resolution of a run's settings, which know
every registry, are one layer up: textbox_like/resolve/. Modules import each
other by module (``from textbox_like.config.schema import RunConfig``); this
file exports nothing.
"""
