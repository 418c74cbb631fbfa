"""A task's, optimizer's and LR scheduler's own options are a typed section,
declared like the core sections (config/schema.py's ``setting``) and given
to the registry's decorator (``dataclass=``, as fairseq's): shown by --help
and --print_config, checked by their types, and handed to the run as an
instance of that section."""
from __future__ import annotations

import dataclasses

import pytest

from textbox_like.resolve.resolution import parse
from textbox_like.config.schema import NoOptions, Section, setting
from textbox_like.optim.lr_scheduler import PolynomialDecayOptions
from textbox_like.config.registry import Registry


def test_the_registry_takes_a_section_and_subclasses_inherit_it():
    @dataclasses.dataclass(frozen=True)
    class Own(Section):
        depth: int = setting(2, "depth", type=int)

    class Base:
        options = NoOptions

    things = Registry("thing", base=Base)

    @things.register("deep", dataclass=Own)
    class Deep(Base):
        pass

    @things.register("deeper")
    class Deeper(Deep):
        pass

    @things.register("plain")
    class Plain(Base):
        pass

    assert Deep.options is Own and Deeper.options is Own and Plain.options is NoOptions


def test_a_run_gets_its_plugins_sections_typed_and_frozen():
    cfg = parse(["--task", "mnist", "--max-sentences", "8", "--max-update", "1", "--power", "2",
                 "--optimizer", "sgd", "--nesterov", "--momentum", "0.5"])
    assert isinstance(cfg.scheduler_options, PolynomialDecayOptions)
    assert (cfg.scheduler_options.power, cfg.scheduler_options.end_learning_rate) == (2.0, 0.0)
    assert (cfg.optimizer_options.momentum, cfg.optimizer_options.nesterov) == (0.5, True)
    assert cfg.source("power") == "command line"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.scheduler_options.power = 3.0
    changed = cfg.replace(power=4.0)
    assert isinstance(changed.scheduler_options, PolynomialDecayOptions) and changed.get("power") == 4.0
    assert cfg.get("power") == 2.0
