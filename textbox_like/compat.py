"""The name other tools' spellings had before textbox_like/config/: see
config/compat.py (their value types: config/value_types.py; what acts when a
run starts: launch.py)."""
from .config.compat import (ALIASES, FOREIGN_OPTIONS, NO_SUCH_PART, PLUGIN_ALIASES, TEXTBOX_ALIASES,  # noqa: F401
                            THEIR_DEFAULTS, apply_foreign_settings, check_optimizer_name, cuda_devices,
                            default_notes, environment_settings, foreign_source, no_such_part, tools_used)
from .config.value_types import AMP_LEVELS, device_name, dtype_name, gpu_ids, metric_name, metric_names  # noqa: F401
