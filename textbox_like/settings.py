"""The name the settings had before textbox_like/config/: see config/schema.py."""
from .config.schema import (GROUPS, SECTION_OF, SECTIONS, CheckpointConfig, DataConfig,  # noqa: F401
                            DistributedConfig, LoggingConfig, ModelConfig, NumericsConfig, OptimConfig,
                            OptimizerArguments, NoOptions, RunConfig, RuntimeConfig, ScheduleConfig,
                            SearchConfig, Section, ValidationConfig, declared_settings, setting)
from .config.value_types import positive_float, seed_list  # noqa: F401
