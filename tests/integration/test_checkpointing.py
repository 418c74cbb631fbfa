"""kanachan's --checkpointing on BERT: activations are recomputed in backward,
so far fewer are kept, and the loss and gradients are the same."""
from __future__ import annotations

import numpy as np
import torch

from test_bert_train import bert_data  # noqa: F401  (the module-scoped fixture)
from textbox_like.resolve.resolution import parse
from textbox_like.tasks import TASKS
import pytest

pytestmark = pytest.mark.slow  # every test here starts processes (conftest.no_process_started)


def forward_backward(d, checkpointing):
    cfg = parse(["--task", "bert", "--data", str(d / "shards"), "--dict", str(d / "vocab.txt"),
                       "--config_file", str(d / "bert_config.json"), "--max-sentences", "8",
                       "--checkpointing", str(checkpointing).lower()])
    torch.manual_seed(0)
    task = TASKS.get("bert")(cfg)
    model = task.build_model().train()
    batch = task.build_dataset("train").get_batch(np.arange(8))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):  # every activation autograd keeps for backward, weights excluded
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms, _ = task.loss(model, batch)
        loss = terms["masked_tokens"] / task.count(batch)["masked_tokens"] + terms["nsamples"] / 8
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), grads, sum(kept.values())


def test_checkpointing_keeps_fewer_activations_and_the_same_loss(bert_data):  # noqa: F811
    loss, grads, kept = forward_backward(bert_data, False)
    loss_ck, grads_ck, kept_ck = forward_backward(bert_data, True)
    assert torch.equal(loss, loss_ck)
    torch.testing.assert_close(grads, grads_ck, rtol=1e-5, atol=1e-7)
    assert kept_ck < 0.5 * kept, (kept_ck, kept)
