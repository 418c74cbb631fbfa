"""The tests of test_fsdp_options.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import write_mnist
from test_fsdp import assert_close, checkpoint, train_records
from test_hf_task import exactness_args, models, text_data  # noqa: F401 (fixtures)
from _fsdp_runs import Run, run_plan, script, spawned


# ------------------------------------------------------------------ every process of this file: one pair
@pytest.fixture(scope="module")
def two_rank_runs(models, text_data, tmp_path_factory):  # noqa: F811
    """Every run and script of this file's tests, one after another in one pair of rank processes
    (_fsdp_runs.run_plan), each with the rank variables, the rendezvous and the arguments its test gives
    it: {name: its _fsdp_runs.Run}, under the root returned. The scripts come last: they leave the
    trainer's runs a process as the trainer's own clean-up leaves it."""
    root = tmp_path_factory.mktemp("fsdp_options_runs")
    data = root / "mnist"
    write_mnist(data, n_train=256, n_test=16)
    common = ("--max-update", 3, "--distributed-world-size", 2, "--fsdp", "--distributed-timeout", 600)
    runs = {"unlike_nodes": unlike_nodes(data, root),
            "eager": spawned(exactness_args(models["causal_lm"], text_data, root / "eager", *common)[2:], 2,
                             root / "rdzv_eager"),
            "compiled": spawned(exactness_args(models["causal_lm"], text_data, root / "compiled", *common,
                                               "--compile")[2:], 2, root / "rdzv_compiled"),
            "two_rank_checks": two_rank_checks_script(root),
            "plugin": plugin_script(root)}
    run_plan(list(runs.values()), root / "plan", timeout=1500)
    return root, runs


# ------------------------------------------------------------------ --compile (a model compiled whole)
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_compiled_gpt2_is_sharded_and_equals_the_eager_run(two_rank_runs):
    """GPT-2 declares no compile regions: Accelerate wraps the whole sharded
    model in torch.compile, and the run must still see it sharded (start
    line, the micro-batch count the ranks agree on, the sharded gradient
    norm, the sharded checkpoint). Compiled and eager differ only by the
    rounding of fused kernels: after 3 SGD steps of lr 0.5 on weights of
    size up to 1 they differ by one float32 ulp (1.2e-7 measured), far below
    1e-5 (the exactness tests' bound), while a wrong update (one rank's
    gradient alone, a missed reduction) moves weights by ~1e-2. Both runs
    are two_rank_runs' ("eager", "compiled"), as run_hetseq.py's two spawned ranks."""
    root, runs = two_rank_runs
    runs["eager"].check()
    compiled = runs["compiled"]
    compiled.check()
    start = next(line for line in compiled.stderr.splitlines() if line.startswith("task hf"))
    assert "sharding full over 2 ranks (fully_shard applied by textbox_like" in start, start
    assert "units: 2 GPT2Block + the root" in start, start
    assert "compile from --compile" in start, start
    assert "did not compile" not in compiled.stderr and "Traceback" not in compiled.stderr
    records = train_records(root / "compiled")
    assert [r["update"] for r in records] == [1, 2, 3]
    assert all(min(r["compute_s_per_rank"]) > 0 for r in records)  # the sharded timing ran
    assert (root / "compiled" / "checkpoint_last.dcp").is_dir()  # a sharded checkpoint, as eager's
    assert_close(checkpoint(root / "compiled")["model"], checkpoint(root / "eager")["model"], atol=1e-5)
    assert records[-1]["loss"] == pytest.approx(train_records(root / "eager")[-1]["loss"], abs=1e-5)

SHARDED_ROOT_SCRIPT = '''
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from textbox_like.parallel import sharding
dist.init_process_group("gloo")
m = torch.nn.Sequential(torch.nn.Linear(4, 4)); fully_shard(m)
class Wrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__(); self.module = module
plain = torch.nn.Linear(4, 4)
found = (sharding.sharded_root(torch.compile(m)) is m, sharding.sharded_root(Wrapper(torch.compile(m))) is m,
         sharding.is_sharded(plain), sharding.is_sharded(torch.compile(plain)))
open(f"{__file__}.rank{dist.get_rank()}", "w").write("found %s %s %s %s\\n" % found)
'''

# the unit-level two-rank checks of this file and test_fsdp.py's sharding strategies: one script on two
# ranks runs each check's script in turn (its own namespace, its own verdict files), instead of one torchrun
# (three processes, a rendezvous) per check. The process group the first script starts is the one every
# later script works in (Accelerator(cpu=True) takes it as it is).
DRIVER_SCRIPT = '''
import os, sys, torch.distributed as dist
real_init = dist.init_process_group
def init_once(*args, **kwargs):
    if not dist.is_initialized():
        real_init(*args, **kwargs)
dist.init_process_group = init_once
first = os.environ["RANK"] == "0"  # one writer of the part lines: two ranks' lines in one pipe interleave
for path in sys.argv[1:]:
    if first:
        print("--- part", path, flush=True)
    exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__", "__file__": path})
    dist.barrier()
if first:
    print("--- all parts ran", flush=True)
'''

CHECK_PARTS = ("strategies", "sharded_root", "eval_first", "unused")


def two_rank_checks_script(root):
    """The driver of the checks on two ranks (two_rank_runs' "two_rank_checks")."""
    from test_fsdp import STRATEGIES_SCRIPT
    root = root / "two_rank_checks"
    root.mkdir()
    parts = {"strategies": STRATEGIES_SCRIPT, "sharded_root": SHARDED_ROOT_SCRIPT, "eval_first": EVAL_FIRST_SCRIPT,
             "unused": UNUSED_SCRIPT.replace("sys.argv[1:]", '["--find-unused-parameters"]')}
    for name, text in parts.items():
        (root / f"{name}.py").write_text(text)
    (root / "driver.py").write_text(DRIVER_SCRIPT)
    return script(root / "driver.py", 2, [root / f"{name}.py" for name in CHECK_PARTS])


@pytest.fixture(scope="module")
def two_rank_checks(two_rank_runs):
    """{check: what rank 0 printed during it, then each rank's verdict file}, from one driver on 2 ranks."""
    root, runs = two_rank_runs
    checks = runs["two_rank_checks"]
    checks.check()
    out = checks.outs[0]
    assert "--- all parts ran" in out, out[-3000:] + checks.stderr[-3000:]
    printed = {}
    for chunk in out.split("--- part ")[1:]:
        path, _, text = chunk.partition("\n")
        printed[Path(path).stem] = printed.get(Path(path).stem, "") + text
    folder = root / "two_rank_checks"
    return {name: printed.get(name, "") + "".join(p.read_text() for p in sorted(folder.glob(f"{name}.py.rank*")))
            for name in CHECK_PARTS}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sharding_strategies_keep_the_shards_they_say(two_rank_checks):
    """full and hybrid on one node split each parameter over the 2 ranks;
    none, and hybrid over 2 nodes of one rank, keep whole copies; every
    strategy's gradient is the one-process gradient."""
    out = two_rank_checks["strategies"]   # test_fsdp.STRATEGIES_SCRIPT: what rank 0 printed
    rows = [line.split(" ", 2) for line in out.splitlines() if line.split(" ")[0] in ("none", "hybrid", "full")]
    assert [(r[0], r[1]) for r in rows] == [("none", "1"), ("hybrid", "1"), ("hybrid", "2"), ("full", "1")]
    shapes = {(r[0], r[1]): r[2] for r in rows}
    assert shapes[("none", "1")].startswith("[13, 13, 10, 10] 0.0 sharding none (replicated over 2 ranks)")
    assert shapes[("hybrid", "1")].startswith(
        "[7, 7, 5, 5] 0.0 sharding hybrid: over 2 ranks per node, replicated over 1 node(s)")
    assert shapes[("hybrid", "2")].startswith(
        "[13, 13, 10, 10] 0.0 sharding hybrid: over 1 ranks per node, replicated over 2 node(s)")
    assert shapes[("full", "1")].startswith("[7, 7, 5, 5] 0.0 sharding full over 2 ranks")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sharded_root_is_found_under_torch_compile_and_ddp_like_wrappers(two_rank_checks):
    """Unit level: the FSDP module under torch.compile's OptimizedModule and
    under a ``.module`` wrapper (as DDP's), and none in a plain model."""
    out = two_rank_checks["sharded_root"]
    assert [line for line in out.splitlines() if line.startswith("found")] == ["found True True False False"] * 2, out


# ------------------------------------------------------------------ hybrid on unlike nodes
def unlike_nodes(data, root):
    """Rank 0 says its node holds 2 ranks, rank 1 that its node holds 1 (two_rank_runs' "unlike_nodes")."""
    args = ["--task", "mnist", "--data", str(data), "--save-dir", str(root / "unlike_nodes"), "--max-sentences", "16",
            "--max-update", "2", "--threads", "1", "--disable-validation", "--distributed-timeout", "120", "--fsdp",
            "--fsdp-sharding", "hybrid"]
    env = {str(rank): {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(local_world),
                       "MASTER_ADDR": "127.0.0.1", "TEXTBOX_LIKE_INIT_METHOD": f"file://{root / 'rdzv_unlike'}"}
           for rank, local_world in ((0, 2), (1, 1))}
    return Run({"0": args, "1": args}, env)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_hybrid_on_nodes_with_unlike_rank_counts_is_refused_on_every_rank(two_rank_runs):
    """Rank 0 says its node holds 2 ranks, rank 1 that its node holds 1
    (LOCAL_WORLD_SIZE as torchrun or SLURM would set it on unlike nodes):
    each would lay out another mesh, (1, 2) against (2, 1). Both ranks stop
    with the one line and exit 2, before any mesh is built (no hang)."""
    run = two_rank_runs[1]["unlike_nodes"]
    run.check(expect=2)
    for rank in (0, 1):
        err = run.errs[rank]
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert lines == ["error: --fsdp-sharding hybrid needs the same number of ranks on every node (here the "
                         "ranks see [2, 1] ranks on their node, rank by rank: LOCAL_WORLD_SIZE); use "
                         "--fsdp-sharding full"], err[-2000:]
        assert "Traceback" not in err

# ------------------------------------------------------------------ evaluation before training
EVAL_FIRST_SCRIPT = '''
import numpy as np, torch, torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard
from textbox_like.training.validate import evaluate
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
inputs = torch.randn(32, 8)
class Data:
    def __len__(self): return len(inputs)
    def get_batch(self, index): return inputs[index]
class Task:
    def loss(self, model, batch):
        return None, {"loss_sum": model(batch).square().sum().item(), "nsamples": len(batch)}
    def validation_stats(self, model, batch): return None
    def metrics(self, sums): return {"loss": sums["loss_sum"] / sums["nsamples"]}
first = evaluate(Task(), model, Data(), 8, acc, to_device=lambda b: b)
model(inputs).square().sum().backward()  # training after the evaluation
second = evaluate(Task(), model, Data(), 8, acc, to_device=lambda b: b)
rank = dist.get_rank()
open(f"{__file__}.rank{rank}", "w").write(f"rank {rank} trained after evaluating {first == second}\\n")
'''


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_sharded_model_evaluated_before_training_still_trains(two_rank_checks):
    """FSDP2's first forward under inference_mode makes inference tensors it
    keeps: a backward afterwards fails ("Inplace update to inference tensor
    outside InferenceMode"). Evaluating a sharded model uses no_grad."""
    out = two_rank_checks["eval_first"]
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == \
        ["rank 0 trained after evaluating True", "rank 1 trained after evaluating True"], out

# ------------------------------------------------------------------ --find-unused-parameters
UNUSED_SCRIPT = '''
import torch, torch.distributed as dist
from textbox_like.parallel import sharding
from textbox_like.resolve.resolution import resolve
from textbox_like.processes.distributed import Placement
import datetime, sys
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
cfg, _ = resolve(["--fsdp", "--fsdp-wrap", "none"] + sys.argv[1:])
torch.manual_seed(0)
class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
    def forward(self, x, branch):
        return getattr(self, branch)(x)
model, ref = TwoBranches(), TwoBranches()
ref.load_state_dict(model.state_dict())
x = torch.randn(5, 6)
ref.a(x).square().sum().div(2).backward(); ref.b(x).square().sum().div(2).backward()  # the mean of both ranks
sharding.shard_model(model, cfg, Placement(world_size=2, local_world_size=2), "cpu", "no")
sharding.reduce_unused_parameters(model, cfg)
model(x, "a" if rank == 0 else "b").square().sum().backward()  # rank 0 uses a only, rank 1 b only
error = max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
open(f"{__file__}.rank{rank}", "w").write(f"rank {rank} error {error < 1e-6}\\n")
'''


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_find_unused_parameters_lets_fsdp_ranks_use_different_parameters(two_rank_checks):
    """Each rank's forward uses another layer: with --find-unused-parameters
    the unused layer's zero gradient joins the reduce-scatter on both ranks,
    and every gradient is the mean over the ranks, as DDP's."""
    out = two_rank_checks["unused"]
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == \
        ["rank 0 error True", "rank 1 error True"], out

# ------------------------------------------------------------------ Accelerate's FSDP2 plugin (the CUDA path)
ACCELERATE_PLUGIN_SCRIPT = '''
import copy, sys, types
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule
from transformers import BertConfig
from textbox_like.parallel import sharding
from textbox_like.resolve.resolution import resolve
from textbox_like.processes.distributed import Placement
from textbox_like.models.bert import BertForPreTrainingMasked
cfg, _ = resolve(["--fsdp"] + sys.argv[3:])
plugin, _ = sharding.accelerate_plugin(cfg, Placement(world_size=1, local_world_size=1), "no")
torch.manual_seed(0)
model = BertForPreTrainingMasked(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=32, hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0))
ref = copy.deepcopy(model)
# what Accelerator.prepare calls under its FSDP2 plugin (which activates on GPUs only)
accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                    mixed_precision="no", is_main_process=True, device=torch.device("cpu"))
ids, positions = torch.randint(0, 64, (3, 8)), torch.tensor([[1, 2]] * 3)
try:
    if sys.argv[2] == "fitted":
        with sharding.units_for_accelerate(accelerator, model, cfg):
            model = fsdp2_prepare_model(accelerator, model)
    else:
        model = fsdp2_prepare_model(accelerator, model)
    for m in (model, ref):
        mlm, nsp = m(ids, masked_lm_positions=positions)
        (mlm.square().sum() + nsp.square().sum()).backward()
except Exception as exc:
    print("failed:", type(exc).__name__)
    sys.exit(0)
units = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule) and m is not model)
print("units", units)
print("tied", model.get_input_embeddings().weight is model.get_output_embeddings().weight,
      model.cls.predictions.bias is model.cls.predictions.decoder.bias)
grads = {n: p.grad for n, p in ref.named_parameters()}
error = max((p.grad.full_tensor() - grads[n]).abs().max().item() for n, p in model.named_parameters())
print("gradients equal", error < 1e-6 or error)
'''


#: the three cases in one process (one import of torch, transformers and accelerate, not three): each runs
#: the script afresh with its own arguments, in the one-rank process group the first started
PLUGIN_CASES_SCRIPT = '''
import sys, torch.distributed as dist
real_init = dist.init_process_group
def init_once(*args, **kwargs):
    if not dist.is_initialized():
        real_init(*args, **kwargs)
dist.init_process_group = init_once
script, rdzv = sys.argv[1:3]
for case in sys.argv[3:]:
    print("--- case", case, flush=True)
    sys.argv = [script, rdzv, *case.split("|")]
    try:
        exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__", "__file__": script})
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    sys.stdout.flush()
'''

PLUGIN_CASES = ["fitted", "fitted|--fsdp-wrap|none", "as built"]


def plugin_script(root):
    """The three cases, one process with no rank variables (two_rank_runs' "plugin", in rank 0's process)."""
    folder = root / "plugin"
    folder.mkdir()
    (folder / "plugin.py").write_text(ACCELERATE_PLUGIN_SCRIPT)
    (folder / "cases.py").write_text(PLUGIN_CASES_SCRIPT)
    return Run({"0": [str(folder / "plugin.py"), str(folder / "rdzv"), *PLUGIN_CASES]}, {"0": {}},
               script=str(folder / "cases.py"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_accelerates_fsdp2_plugin_shards_transformers_bert_with_the_units_shard_model_chooses(two_rank_runs):
    """On CUDA Accelerate's FSDP2 plugin shards the model. transformers 5
    adds BertEmbeddings to BERT's _no_split_modules, and the plugin, left to
    itself, shards the tied word embedding apart from its decoder and fails
    (seen on an H200: every --fsdp BERT run on one GPU). Fitted to the units
    shard_model chooses (the BertLayers; the tied embedding in the root), it
    shards, the tie holds, and the gradients equal the unsharded model's."""
    run = two_rank_runs[1]["plugin"]
    run.check()
    out = run.outs[0]
    printed = [chunk.splitlines()[1:] for chunk in out.split("--- case ")[1:]]
    assert len(printed) == 3, out
    assert printed[0] == ["units ['FSDPBertLayer', 'FSDPBertLayer']", "tied True True", "gradients equal True"]
    assert printed[1] == ["units []", "tied True True", "gradients equal True"]
    assert printed[2] == ["failed: TypeError"]
