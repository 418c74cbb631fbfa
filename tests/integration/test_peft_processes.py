"""The tests of test_peft.py (tests/unit) that start processes: the slow tier.

- 3+5 = 1 x 8: two ranks, one with --max-sentences 3 and one with 5 (a file:// rendezvous, each its own
  command line, as two unlike nodes), train the losses and adapters of one process over 8, within 1e-5,
  for every method on a tiny GPT-2, lora, prefix-tuning, prompt-tuning and bitfit on a tiny BART, and those
  four under --fsdp (the frozen base weights sharded, the adapters trained);
- kill -9: both rank processes of a two-rank run killed with SIGKILL (their process group) after a
  checkpoint, then --resume on two ranks gives the uninterrupted run's trained weights (adapters, prefixes,
  prompts, biases) and optimizer state bit for bit, for lora, prefix-tuning, prompt-tuning and bitfit; for
  LoRA --resume on one rank and under --fsdp (DDP -> FSDP) give them within 1e-5.
"""
from __future__ import annotations

import random
import signal
import time

import pytest

from conftest import assert_bitwise_equal
from test_fsdp import PY, assert_close, checkpoint, in_process, train_records
from test_hf_task import hf_args, models, text_data  # noqa: F401 (fixtures)
from test_peft import SEQ2SEQ, SMALL
from _fsdp_runs import Plan, by_rank, one_rank, spawned

#: a global batch of 8 re-split by --balance (every 2 updates), each rank's 3 or 5 its micro-batch cap
BALANCED = ("--global-batch-size", "8", "--balance", "--balance-interval", "2")
EXACT = [("causal_lm", m, ()) for m in ("lora", "prefix-tuning", "p-tuning-v2", "prompt-tuning", "bitfit")] + \
    [("seq2seq", m, ()) for m in ("lora", "prefix-tuning", "prompt-tuning", "bitfit")] + \
    [("causal_lm", m, ("--fsdp",)) for m in ("lora", "prefix-tuning", "prompt-tuning", "bitfit")] + \
    [("causal_lm", "lora", ("--update-freq", "2")), ("causal_lm", "lora", BALANCED)]
#: the methods killed with kill -9 and resumed (LoRA also on one rank and under --fsdp)
KILLED = ("lora", "prefix-tuning", "prompt-tuning", "bitfit")


def run_name(head, method, extra):
    return f"{head}_{method}" + ("_fsdp" if "--fsdp" in extra else "") + \
        ("_accumulated" if "--update-freq" in extra else "") + ("_balanced" if "--balance" in extra else "")


def exact_args(models, data, save_dir, head, method, *extra, max_update=10):
    """SGD (Adam would scale rounding noise where a gradient is ~0), one record per update, no validation."""
    columns = SEQ2SEQ if head == "seq2seq" else ()
    return hf_args(models[head], data, save_dir, "--peft", method, *SMALL[method], *columns, "--optimizer", "sgd",
                   "--lr", "0.5", "--disable-validation", "--threads", "1", "--log-format", "simple",
                   "--log-interval", "1", "--distributed-timeout", "120", *extra, max_update=max_update)


def two_nodes(models, data, save_dir, rdzv, head, method, *extra):
    """Rank 0 with 3 samples a step and rank 1 with 5, each its own command line (a file rendezvous)."""
    common = ["--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", "2",
              "--distributed-gpus", "1", "--distributed-no-spawn", *extra]
    return by_rank([exact_args(models, data, save_dir, head, method, "--max-sentences", batch, *common,
                               "--distributed-rank", rank) for batch, rank in (("3", "0"), ("5", "1"))])


def killed_args(models, data, save_dir, method, *extra):
    """SGD with momentum (a state to save; Adam would turn the ranks' rounding of near-zero gradients into
    lr-sized steps), a checkpoint every 3 updates, 12 updates of 4 + 4 samples."""
    return hf_args(models["causal_lm"], data, save_dir, "--peft", method, *SMALL[method], "--optimizer", "sgd",
                   "--momentum", "0.9", "--lr", "0.5", "--max-sentences", "4", "--save-interval-updates", "3",
                   "--disable-validation", "--threads", "1", "--log-format", "simple", "--log-interval", "1",
                   "--distributed-timeout", "120", *extra, max_update=12)


def kill_after_first_checkpoint(plan, save_dir, seed):
    """Both rank processes of ``plan`` killed (SIGKILL, their group) at a moment up to 0.5 s after the
    checkpoint of update 3 is there."""
    plan.wait_for(lambda: (save_dir / "checkpoint_1_3.pt").exists(), timeout=1500)
    time.sleep(random.Random(seed).uniform(0.0, 0.5))
    plan.kill()
    plan.finish()


@pytest.fixture(scope="module")
def peft_runs(models, text_data, tmp_path_factory):
    """Every multi-rank run of this file in one pair of rank processes (_fsdp_runs.Plan); the last,
    "killed_lora", is killed (both processes, SIGKILL) once its checkpoint at update 3 is there, at a moment
    up to 0.5 s later, as is each other method's run in a pair of its own; then a last Plan resumes them on
    two ranks, and LoRA's also on one and under --fsdp."""
    from textbox_like.training import balance
    root = tmp_path_factory.mktemp("peft_runs")
    runs = {run_name(*case): two_nodes(models, text_data, root / run_name(*case), root / f"rdzv_{run_name(*case)}",
                                       *case[:2], *case[2]) for case in EXACT}

    def killed(method, name, *extra, env=None, rdzv=None):
        """A two-rank run in ``name``; ``rdzv``: its rendezvous file's name (a resume's is not the killed run's,
        which the kill left behind)."""
        return spawned(killed_args(models, text_data, root / name, method, "--distributed-world-size", 2, *extra),
                       2, root / f"rdzv_{rdzv or name}", env=env)
    # rank 1 20 ms a sample slower (the other waits for it): ~0.1 s an update, so that the kill falls mid-run
    slow = {balance.SLOW_RANK_ENV: "1:0.02@0"}
    runs.update({f"killed_ref_{m}": killed(m, f"killed_ref_{m}") for m in KILLED})
    # --fsdp cut at update 6 and resumed: under --fsdp (every rank's adapter shard restored) and under DDP
    constant = ("--fsdp", "--lr-scheduler", "constant")   # the same schedule for a run cut at 6 of 12 updates
    runs["fsdp_ref"] = killed("lora", "fsdp_ref", *constant)
    runs["fsdp_cut"] = killed("lora", "fsdp_cut", *constant, "--max-update", 6)
    runs["killed_lora"] = killed("lora", "killed_lora", env=slow)
    with Plan(list(runs.values()), root / "plan") as plan:
        kill_after_first_checkpoint(plan, root / "killed_lora", 2)
    for seed, method in enumerate(KILLED[1:]):
        runs[f"killed_{method}"] = killed(method, f"killed_{method}", env=slow)
        with Plan([runs[f"killed_{method}"]], root / f"plan_{method}") as plan:
            kill_after_first_checkpoint(plan, root / f"killed_{method}", seed)
    import shutil
    for copy in ("killed_lora_one", "killed_lora_fsdp"):
        shutil.copytree(root / "killed_lora", root / copy)
    shutil.copytree(root / "fsdp_cut", root / "fsdp_cut_ddp")
    killed_at = {m: checkpoint(root / f"killed_{m}")["train"]["num_updates"] for m in KILLED}
    resumed = {f"resumed_{m}": killed(m, f"killed_{m}", "--resume", rdzv=f"resumed_{m}") for m in KILLED}
    resumed["resumed_lora_one"] = one_rank(killed_args(models, text_data, root / "killed_lora_one", "lora",
                                                       "--max-sentences", 8, "--resume"))
    resumed["resumed_lora_fsdp"] = killed("lora", "killed_lora_fsdp", "--fsdp", "--resume", rdzv="resumed_lora_fsdp")
    resumed["fsdp_resumed"] = killed("lora", "fsdp_cut", *constant, "--resume", rdzv="fsdp_resumed")
    resumed["fsdp_to_ddp"] = killed("lora", "fsdp_cut_ddp", "--lr-scheduler", "constant", "--resume",
                                    rdzv="fsdp_to_ddp")
    with Plan(list(resumed.values()), root / "plan_resumed") as plan:
        plan.finish()
    return root, {**runs, **resumed}, killed_at


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("head, method, extra", EXACT, ids=[run_name(*case) for case in EXACT])
def test_three_and_five_equal_one_process_of_eight(models, text_data, peft_runs, tmp_path, head, method, extra):
    root, runs, _ = peft_runs
    name = run_name(head, method, extra)
    stderr = runs[name].check()
    start = next(line for line in stderr.splitlines() if line.startswith("task hf"))
    split = "global batch 8 (balanced) | batch sizes per rank [4, 4] | micro-batch caps [3, 5]" if "--balance" in extra else \
        "batch sizes per rank [3, 5]"
    assert split in start and f"--peft {method})" in start, start
    if "--fsdp" in extra:
        assert "sharding full over 2 ranks" in start and "gradients" in start, start
    one = tmp_path / "one"
    accumulated = extra[:2] if "--update-freq" in extra else ()   # one process accumulates as the ranks do
    in_process([PY, "run_hetseq.py", *exact_args(models, text_data, one, head, method, "--max-sentences", "8",
                                                 *accumulated)])
    two = root / name
    losses = [[r["loss"] for r in train_records(d)] for d in (one, two)]
    # 10 updates (9 with accumulation: the hf task's 3 epochs of 3 updates of 16)
    assert len(losses[0]) == len(losses[1]) == (9 if "--update-freq" in extra else 10)
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert_close(checkpoint(two)["model"], checkpoint(one)["model"])
    assert losses[0][-1] < losses[0][0]   # it learns


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("method", KILLED)
def test_killed_and_resumed_equals_the_uninterrupted_run(peft_runs, method):
    root, runs, killed_at = peft_runs
    runs[f"killed_ref_{method}"].check()
    assert runs[f"killed_{method}"].codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}, \
        runs[f"killed_{method}"].stderr[-2000:]
    assert 3 <= killed_at[method] < 12
    runs[f"resumed_{method}"].check()
    reference = checkpoint(root / f"killed_ref_{method}")
    resumed = checkpoint(root / f"killed_{method}")
    assert resumed["train"]["num_updates"] == 12
    assert_bitwise_equal(resumed["model"], reference["model"], "trained weights")
    assert_bitwise_equal(resumed["optimizer"]["state"], reference["optimizer"]["state"], "optimizer state")
    assert [r["loss"] for r in train_records(root / f"killed_ref_{method}")][-3:] == \
        [r["loss"] for r in train_records(root / f"killed_{method}")][-3:]
    if method == "lora":
        for other in ("killed_lora_one", "killed_lora_fsdp"):
            runs[other.replace("killed", "resumed")].check()
            assert_close(checkpoint(root / other)["model"], reference["model"])
        assert (root / "killed_lora_fsdp" / "checkpoint_last.dcp").is_dir()



@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_an_fsdp_run_resumed_under_fsdp_restores_every_ranks_shard_and_under_ddp_goes_on(peft_runs):
    """LoRA under --fsdp cut at update 6 of 12: resumed under --fsdp on 2 ranks it trains, bit for bit, the
    adapters of the run never cut (each rank's shard of them restored, not rank 0's alone); resumed under DDP,
    the same within 1e-5."""
    root, runs, _ = peft_runs
    for name in ("fsdp_ref", "fsdp_cut", "fsdp_resumed", "fsdp_to_ddp"):
        runs[name].check()
    reference = checkpoint(root / "fsdp_ref")
    resumed = checkpoint(root / "fsdp_cut")
    assert reference["train"]["num_updates"] == resumed["train"]["num_updates"] == 12
    assert_bitwise_equal(resumed["model"], reference["model"], "adapters")
    assert [r["loss"] for r in train_records(root / "fsdp_ref")][-6:] == \
        [r["loss"] for r in train_records(root / "fsdp_cut")][-6:]
    assert checkpoint(root / "fsdp_cut_ddp")["train"]["num_updates"] == 12
    assert_close(checkpoint(root / "fsdp_cut_ddp")["model"], reference["model"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_search_over_lora_r_and_seeds_train_adapters(models, text_data, tmp_path):
    """run_hyper.py's space names the method's option like any other (TextBox's lines): each trial's
    adapters have the rank the trial drew; run_multi_seed.py's seeds each train adapters."""
    import subprocess

    import torch
    import yaml

    from conftest import REPO, clean_env
    (tmp_path / "space.test").write_text("lora_r choice [2, 4]\n")
    args = [a for a in hf_args(models["causal_lm"], text_data, tmp_path / "unused", "--peft", "lora", max_update=2)]
    args = args[:args.index("--save-dir")] + args[args.index("--save-dir") + 2:]
    proc = subprocess.run([PY, str(REPO / "run_hyper.py"), "--space=space.test", "--algo=exhaustive", "--output",
                           str(tmp_path / "search"), *args], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = {}
    for trial in ("trial_1", "trial_2"):
        folder = tmp_path / "search" / trial
        r = yaml.safe_load((folder / "config.yaml").read_text())["lora_r"]
        state = torch.load(folder / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
        ranks[r] = {v.shape[0] for k, v in state.items() if "lora_A" in k}
    assert ranks == {2: {2}, 4: {4}}
    # run_multi_seed.py: every seed's run trains the adapters
    proc = subprocess.run([PY, str(REPO / "run_multi_seed.py"), "--multi_seed=2", "--output", str(tmp_path / "seeds"),
                           *args], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seeds = sorted((tmp_path / "seeds").glob("seed_*"))
    assert len(seeds) == 2
    for folder in seeds:
        state = torch.load(folder / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
        assert state and all("lora_" in key for key in state)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lora_run_whose_node_dies_goes_on_alone_and_equals_one_process(models, text_data, tmp_path):
    """An elastic run (two torchrun nodes) of LoRA with a global batch of 8: node B dies as a machine does
    (its agent's process group killed); A's worker saves the last completed update, torchrun restarts it
    alone, it takes both shares of the global batch and ends with the adapters of one process over 8."""
    import json
    import os

    from conftest import free_port
    from test_elastic import Node, start
    save = tmp_path / "save"

    def lora(save_dir, *extra):
        return killed_args(models, text_data, save_dir, "lora", "--global-batch-size", 8, "--max-epoch", 0, *extra)
    port = free_port()
    a = Node(port, tmp_path / "a.log", lora(save, "--distributed-timeout", 30), hosts_rendezvous=True)
    b = Node(port, tmp_path / "b.log", lora(save, "--distributed-timeout", 30))
    try:
        start(a, b)
        a.wait_for_update(4)
        os.killpg(b.proc.pid, signal.SIGKILL)   # the agent's group; its worker dies by its parent-death signal
        b.proc.wait()
        a.wait_for_resume()
        assert a.finish(400) == 0, a.text()[-3000:]
    finally:
        for node in (a, b):
            if node.proc.poll() is None:
                node.die()
    text = a.text()
    assert "lost a peer of this run" in text and "world size 1" in text.split("resumed from")[1], text[-3000:]
    results = json.loads((save / "results.json").read_text())
    assert (results["num_updates"], results["world_size"]) == (12, 1)
    one = tmp_path / "one"
    in_process([PY, "run_hetseq.py", *lora(one, "--max-sentences", 8)])
    assert_close(checkpoint(save)["model"], checkpoint(one)["model"])
