"""Device choices that need a GPU to matter, checked with torch.cuda mocked:
TextBox's --gpu_id and the bfloat16 warning on GPUs below compute capability 8.0."""
from __future__ import annotations

import os
import types

import torch

from textbox_like.parallel import accelerator
from textbox_like import cli
from textbox_like.processes import distributed
from textbox_like.resolve.resolution import parse


def test_gpu_id_sets_visible_devices_and_one_process_each(monkeypatch):
    from textbox_like.training import outcome as trainer
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed, "apply_determinism", lambda ns: None)
    seen = {}

    def plan(ns):
        seen["world"] = ns.distributed.distributed_world_size
        seen["source"] = ns.source("distributed_world_size")
        return None  # run in this process: no spawning in a test

    monkeypatch.setattr(distributed, "local_plan", plan)
    monkeypatch.setattr(trainer, "train", lambda ns, callbacks=(): 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ns = parse(["--task", "mnist", "--gpu_id", "2,3"])
    assert cli.run(ns) == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3" and seen["world"] == 2
    assert seen["source"] == "command line (TextBox --gpu_id)"


def test_bf16_on_an_old_gpu_warns_once(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    cfg = types.SimpleNamespace(fp16=False, bf16=True, train_dtype="float32")
    assert accelerator.precision(cfg, cuda=True)[0] == "bf16"
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "emulated" in lines[0] and "V100" in lines[0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    accelerator.precision(cfg, cuda=True)
    assert capsys.readouterr().err == ""
