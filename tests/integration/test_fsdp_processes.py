"""The tests of test_fsdp.py (tests/unit) that start processes: the slow tier.

What they hold is told in that module's docstring."""
from __future__ import annotations

import random
import re
import signal
import time
from pathlib import Path

import pytest

from textbox_like.storage.sharded_checkpoint import read_extra_state, read_manifest

from conftest import assert_bitwise_equal, read_jsonl, write_mnist
from test_bert_train import bert_data  # noqa: F401 (a fixture)
from test_hf_task import exactness_args, models, text_data  # noqa: F401 (fixtures)
from test_fsdp import PY, assert_close, checkpoint, in_process, train_records
from _fsdp_runs import Plan, by_rank, one_rank, spawned


SHARDED_ON_CPU = "(fully_shard applied by textbox_like (Accelerate has no FSDP on CPU)"


# ------------------------------------------------------------------ MNIST: unlike batches, accumulation, clipping
@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mnist_fsdp")
    write_mnist(directory, n_train=1280, n_test=64)
    return directory


def mnist_args(data, save_dir, *extra):
    # --clip-norm 0.5 clips every update (the norms here are 1-3); two
    # micro-batches per update (--update-freq 2); a record per update, so that
    # runs compare update by update (a slow run adds records on the wall clock)
    return ["run_hetseq.py", "--task", "mnist", "--data", data, "--save-dir", save_dir, "--optimizer", "sgd",
            "--lr", "0.05", "--lr-scheduler", "constant", "--max-epoch", "0", "--max-update", "20",
            "--update-freq", "2", "--clip-norm", "0.5", "--log-format", "simple", "--log-interval", "1",
            "--threads", "1", "--distributed-timeout", "120", "--disable-validation",
            "--model_conf", "dropout1=0", "--model_conf", "dropout2=0", *extra]


def two_nodes(data, save_dir, rdzv, *extra):
    """Rank 0 with batch 48 and rank 1 with batch 16 (each its own --max-sentences), as two 'nodes' of one
    rank each (--distributed-rank, a file rendezvous)."""
    common = ["--distributed-init-method", f"file://{rdzv}", "--distributed-world-size", "2",
              "--distributed-gpus", "1", "--distributed-no-spawn", *extra]
    return by_rank([mnist_args(data, save_dir, "--max-sentences", batch, *common, "--distributed-rank", rank)[1:]
                    for batch, rank in (("48", "0"), ("16", "1"))])


UPDATES_PER_LEG = 6


def leg_args(data, save_dir, world, leg, *extra):
    """A global batch of 64 on any number of ranks (micro-batches of at most
    32), SGD with momentum (a state to carry across the resumes), a save at
    the end of each leg of UPDATES_PER_LEG updates."""
    return [PY, "run_hetseq.py", "--task", "mnist", "--data", data, "--save-dir", save_dir, "--optimizer", "sgd",
            "--momentum", "0.9", "--lr", "0.05", "--lr-scheduler", "constant", "--max-epoch", "0",
            "--max-update", UPDATES_PER_LEG * leg, "--save-interval-updates", UPDATES_PER_LEG,
            "--global-batch-size", "64", "--max-sentences", "32", "--log-format", "simple", "--log-interval", "3",
            "--threads", "1", "--distributed-timeout", "120", "--disable-validation", "--model_conf", "dropout1=0",
            "--model_conf", "dropout2=0", "--distributed-world-size", world, *extra,
            *(["--resume"] if leg > 1 else [])]


def killed_args(data, save_dir):
    """Adam (a state to shard and save), a sharded checkpoint every 6 updates, on two ranks."""
    return mnist_args(data, save_dir, "--max-sentences", "16", "--optimizer", "adam", "--lr", "0.001",
                      "--max-update", "24", "--update-freq", "1", "--save-interval-updates", "6",
                      "--distributed-world-size", "2", "--fsdp")[1:]


#: the chains of resumed runs: --fsdp on 2, then 1, then 2 ranks; DDP, then --fsdp, then DDP on 2 ranks
CHAINS = {"ranks": [(2, "--fsdp"), (1, "--fsdp"), (2, "--fsdp")], "ddp": [(2,), (2, "--fsdp"), (2,)]}


@pytest.fixture(scope="module")
def two_rank_runs(mnist, bert_data, models, text_data, tmp_path_factory):  # noqa: F811
    """Every run of two ranks this file's tests compare or inspect, one after another in one pair of rank
    processes (_fsdp_runs.Plan: each run with the rank variables and a rendezvous of its own, as
    run_hetseq.py's spawned ranks, or as two one-rank nodes): {name: its _fsdp_runs.Run}, the runs'
    directories under the root returned. The legs of the resumed chains run in turn, a leg on one rank in
    the first rank's process. The last, "killed", is test_fsdp_killed_and_resumed_equals_the_uninterrupted_run's:
    once its first sharded checkpoint is there, at a moment up to 1 s later (test_resume.kill_after_checkpoint's,
    seed 1), both rank processes are killed with SIGKILL at once (their process group)."""
    from textbox_like.training import balance
    from test_balance import bert_args
    root = tmp_path_factory.mktemp("fsdp_two_ranks")
    runs = {
        "mnist_ddp": two_nodes(mnist, root / "mnist" / "ddp", root / "rdzv_ddp"),
        "mnist_fsdp": two_nodes(mnist, root / "mnist" / "fsdp", root / "rdzv_fsdp", "--fsdp"),
        # rank 1 slowed so that --balance re-splits
        "bert": spawned(bert_args(bert_data, root / "bert", "--global-batch-size", 256, "--max-tokens", 64,
                                  "--distributed-world-size", 2, "--balance", "--balance-interval", 2,
                                  "--max-update", 20, "--fsdp"), 2, root / "rdzv_bert",
                        env={balance.SLOW_RANK_ENV: "1:0.01@0"}),
        "gpt2": spawned(exactness_args(models["causal_lm"], text_data, root / "gpt2", "--max-update", 20,
                                       "--distributed-world-size", 2, "--fsdp")[2:], 2, root / "rdzv_gpt2"),
        "killed_ref": spawned(killed_args(mnist, root / "killed_ref"), 2, root / "rdzv_killed_ref"),
    }
    for name, legs in CHAINS.items():
        for leg, (world, *extra) in enumerate(legs, 1):
            args = leg_args(mnist, root / "legs" / name, world, leg, *extra)[2:]
            runs[f"{name}{leg}"] = (one_rank(args) if world == 1 else
                                    spawned(args, world, root / f"rdzv_{name}{leg}"))
    runs["killed"] = spawned(killed_args(mnist, root / "killed"), 2, root / "rdzv_killed")
    with Plan(list(runs.values()), root / "plan") as plan:
        plan.wait_for(lambda: (root / "killed" / "checkpoint_1_6.dcp").exists(), timeout=1500)
        time.sleep(random.Random(1).uniform(0.0, 1.0))
        plan.kill()
        plan.finish()
    return root, runs


@pytest.fixture(scope="module")
def after_the_kills(mnist, two_rank_runs, tmp_path_factory):
    """Two rank processes (_fsdp_runs.Plan) for what comes after a kill: "resumed", the killed run's
    --resume on two ranks (as run_hetseq.py's spawned ranks); then "survivor", an --fsdp run on two
    one-rank nodes (--distributed-timeout 30) whose rank 1's process is killed with SIGKILL once rank 0
    logged an update past the save at update 6 (9 to 17). {"killed_at": the update of the killed run's
    newest checkpoint before its resume, "resumed"/"survivor": their Runs, "save": the survivor's --save-dir}"""
    root, runs = two_rank_runs
    killed_at = checkpoint(root / "killed")["train"]["num_updates"]
    here = tmp_path_factory.mktemp("fsdp_after_kills")
    save, rdzv = here / "save", here / "rdzv"
    steps = [spawned([*killed_args(mnist, root / "killed"), "--resume"], 2, here / "rdzv_resumed"),
             by_rank([leg_args(mnist, save, 2, 3, "--fsdp", "--distributed-timeout", "30",
                               "--distributed-init-method", f"file://{rdzv}", "--distributed-rank", r,
                               "--distributed-no-spawn")[2:] for r in (0, 1)])]
    with Plan(steps, here / "plan") as plan:
        plan.wait_for(lambda: re.search(r"\| update (9|1[0-7]) \|", plan.output(1, 0) or ""), timeout=900)
        plan.kill(1)
        plan.finish()
    return {"killed_at": killed_at, "resumed": steps[0], "survivor": steps[1], "save": save}


@pytest.fixture(scope="module")
def mnist_runs(mnist, two_rank_runs, tmp_path_factory):
    """One process (64 a micro-batch), and DDP and FSDP over 48 + 16 (two_rank_runs)."""
    root, runs = two_rank_runs
    root = root / "mnist"
    in_process([PY, *mnist_args(mnist, root / "one", "--max-sentences", "64")])
    return root, runs["mnist_ddp"].check(), runs["mnist_fsdp"].check()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_with_unlike_batches_and_accumulation_equals_one_process(mnist_runs):
    root, err_ddp, err_fsdp = mnist_runs
    start = next(line for line in err_fsdp.splitlines() if line.startswith("task mnist"))
    assert "batch sizes per rank [48, 16]" in start
    assert "sharding from --fsdp" in start and "sharding full over 2 ranks " + SHARDED_ON_CPU in start
    # 1,199,882 float32 parameters over 2 ranks; SGD without momentum keeps no state
    assert ("expected per rank: parameters 2.29 MiB, gradients 2.29 MiB, optimizer states 0.00 MiB "
            "(DDP: 9.15 MiB in all)") in start
    assert "sharding" not in next(line for line in err_ddp.splitlines() if line.startswith("task mnist"))
    # saved sharded: a checkpoint directory, no file checkpoint
    assert (root / "fsdp" / "checkpoint_last.dcp").is_dir() and not list((root / "fsdp").glob("*.pt"))
    fsdp = checkpoint(root / "fsdp")
    assert fsdp["train"]["num_updates"] == 20
    assert_close(fsdp["model"], checkpoint(root / "one")["model"])
    # the saved weights are whole tensors with the model's own names, as DDP saves them
    ddp = checkpoint(root / "ddp")["model"]
    assert {k: v.shape for k, v in fsdp["model"].items()} == {k: v.shape for k, v in ddp.items()}
    assert_close(fsdp["model"], ddp)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_clips_by_the_global_norm_as_ddp_does(mnist_runs):
    root, _, _ = mnist_runs
    fsdp, ddp, one = ({r["update"]: r for r in train_records(root / name)} for name in ("fsdp", "ddp", "one"))
    assert set(fsdp) == set(ddp) == set(one) == set(range(1, 21))
    common = range(1, 21)
    # the norm over both ranks' shards, before clipping: DDP's and one process's. Within 1e-4: torch's
    # float32 norm of fc1's 1.2M-element gradient rounds differently over a half (measured: 3e-5)
    for a, b, c in ((fsdp[u], ddp[u], one[u]) for u in common):
        assert a["gnorm"] == pytest.approx(b["gnorm"], rel=1e-4)
        assert b["gnorm"] == pytest.approx(c["gnorm"], rel=1e-5)
        assert a["gnorm"] > 0.5  # clipped: a shard clipped by its own norm would not match
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    # clipped by the same global norm: the weights agree far inside 1e-5 (a shard clipped by its
    # own, smaller norm would move further)
    assert_close(checkpoint(root / "fsdp")["model"], checkpoint(root / "ddp")["model"], atol=1e-6)


# ------------------------------------------------------------------ tiny BERT: a global batch in tokens, --balance
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_bert_balanced_global_batch_in_tokens_equals_one_process(bert_data, two_rank_runs, tmp_path):  # noqa: F811
    """Tiny BERT, --global-batch-size 256 tokens with micro-batch caps of 64
    (several micro-batches per rank, their counts unlike: a rank with fewer
    joins with empty ones), rank 1 slowed so that --balance re-splits
    (two_rank_runs' "bert")."""
    from test_balance import bert_args
    in_process([PY, "run_hetseq.py", *bert_args(bert_data, tmp_path / "one", "--global-batch-size", 256,
                                         "--max-tokens", 256, "--max-update", 20)])
    root, runs = two_rank_runs
    out, stderr = root / "bert", runs["bert"].check()
    start = next(line for line in stderr.splitlines() if line.startswith("task bert"))
    assert "units: 2 BertLayer + the root" in start, start
    splits = [r["batch_sizes"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "balance"]
    assert any(split != [128, 128] for split in splits), (splits, stderr[-2000:])
    assert checkpoint(out)["train"]["num_updates"] == 20
    assert_close(checkpoint(out)["model"], checkpoint(tmp_path / "one")["model"])


# ------------------------------------------------------------------ tiny GPT-2 (--task hf)
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_gpt2_unlike_micro_batches_equals_one_process(models, text_data, two_rank_runs, tmp_path):  # noqa: F811
    """A global batch of 120 real tokens, micro-batches of at most 50 per rank:
    the ranks' shares hold unlike numbers of samples and micro-batches (two_rank_runs' "gpt2")."""
    in_process(exactness_args(models["causal_lm"], text_data, tmp_path / "one", "--max-update", 20))
    root, runs = two_rank_runs
    two = root / "gpt2"
    start = next(line for line in runs["gpt2"].check().splitlines() if line.startswith("task hf"))
    assert "units: 2 GPT2Block + the root" in start, start
    assert_close(checkpoint(two)["model"], checkpoint(tmp_path / "one")["model"])
    assert train_records(two)[-1]["loss"] == pytest.approx(train_records(tmp_path / "one")[-1]["loss"], abs=1e-5)


# ------------------------------------------------------------------ checkpoints
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_killed_and_resumed_equals_the_uninterrupted_run(two_rank_runs, after_the_kills):
    """Adam (state to shard and save): every process (both ranks) killed with
    SIGKILL after a sharded checkpoint (two_rank_runs' "killed"), then
    --resume from it on two ranks (after_the_kills' "resumed"): the final
    weights and optimizer state are bitwise those of the run that was never
    interrupted (two_rank_runs' "killed_ref")."""
    root, runs = two_rank_runs
    runs["killed_ref"].check()
    killed = runs["killed"]
    assert killed.codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}, killed.stderr[-1000:]
    save_dir = root / "killed"
    killed_at = after_the_kills["killed_at"]
    assert killed_at % 6 == 0 and killed_at < 24
    resumed = after_the_kills["resumed"]
    assert f"resumed from {save_dir / 'checkpoint_last.dcp'}: epoch 1, update {killed_at}" in resumed.check()
    assert not list(save_dir.glob(".*.partial"))  # what a save killed midway left is gone
    final, ref = checkpoint(save_dir), checkpoint(root / "killed_ref")
    assert final["train"]["num_updates"] == ref["train"]["num_updates"] == 24
    assert_bitwise_equal(final["model"], ref["model"], "model")
    assert_bitwise_equal(final["optimizer"], ref["optimizer"], "optimizer")
    # the optimizer state is whole (Adam's two moments per parameter), not one rank's shard
    state = final["optimizer"]["state"]
    assert state and all(state[name]["exp_avg"].shape == final["model"][name].shape for name in state)

@pytest.fixture(scope="module")
def resumed_runs(mnist, two_rank_runs):
    """One process over 3 legs uninterrupted (in this process), and two runs
    resumed twice (two_rank_runs): --fsdp on 2, then 1, then 2 ranks; DDP,
    then --fsdp, then DDP on 2 ranks. (root, {chain: [each leg's output]})"""
    root, runs = two_rank_runs
    root = root / "legs"
    in_process(leg_args(mnist, root / "one", 1, 3))
    return root, {name: [runs[f"{name}{leg}"].check() for leg in (1, 2, 3)] for name in CHAINS}


def assert_each_sample_once(root, name):
    """Every leg's end equals the uninterrupted one process's update over the
    same global batches (within 1e-5), and 64 samples were trained per
    update: no sample skipped or repeated across the resumes."""
    for leg in (1, 2, 3):
        update = UPDATES_PER_LEG * leg
        saved = checkpoint(root / name, f"checkpoint_1_{update}")
        ref = checkpoint(root / "one", f"checkpoint_1_{update}")
        assert saved["train"]["num_updates"] == update and saved["train"]["samples_trained"] == 64 * update
        assert [saved["iterator"][k] for k in ("epoch", "offset")] == [ref["iterator"][k] for k in ("epoch", "offset")]
        assert_close(saved["model"], ref["model"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_resumes_on_one_rank_and_back_on_two_each_sample_once(resumed_runs):
    root, logs = resumed_runs
    save = root / "ranks"
    assert "sharding full over 2 ranks" in logs["ranks"][0]
    assert f"resumed from {save / 'checkpoint_last.dcp'}: epoch 1, update 6" in logs["ranks"][1]
    assert "sharding none (--fsdp with one process: nothing to shard)" in logs["ranks"][1]
    assert f"resumed from {save / 'checkpoint_last.dcp'}: epoch 1, update 12" in logs["ranks"][2]
    # each leg saved sharded, by the ranks it ran on
    assert [read_manifest(save / f"checkpoint_1_{u}.dcp")["world_size"] for u in (6, 12, 18)] == [2, 1, 2]
    assert not list(save.glob("*.pt"))
    assert_each_sample_once(root, "ranks")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ddp_resumes_under_fsdp_and_back_each_sample_once(resumed_runs):
    """A DDP run's file checkpoint (optimizer state by parameter id) resumes
    under --fsdp, whose sharded checkpoint resumes without it: the momentum
    carried both ways (else the weights would part from the one process's)."""
    root, logs = resumed_runs
    save = root / "ddp"
    assert f"resumed from {save / 'checkpoint_last.pt'}: epoch 1, update 6" in logs["ddp"][1]
    assert "sharding full over 2 ranks" in logs["ddp"][1]
    assert f"resumed from {save / 'checkpoint_last.dcp'}: epoch 1, update 12" in logs["ddp"][2]
    assert (save / "checkpoint_1_6.pt").is_file() and (save / "checkpoint_1_12.dcp").is_dir()
    assert (save / "checkpoint_1_18.pt").is_file()
    assert_each_sample_once(root, "ddp")
    momentum = checkpoint(save, "checkpoint_1_18")["optimizer"]["state"]
    assert momentum and all(entry["momentum_buffer"].abs().sum() > 0 for entry in momentum.values())


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fsdp_survivor_of_a_lost_peer_names_the_last_checkpoint_and_it_resumes(mnist, resumed_runs, after_the_kills):
    """Rank 1 of two --fsdp ranks killed (SIGKILL; after_the_kills' "survivor"):
    the survivor holds only its shards, so it saves nothing, says which
    checkpoint to resume from and exits 75; the run resumed on one rank from
    there ends equal to the uninterrupted one process."""
    import re
    root, _ = resumed_runs
    survivor, save = after_the_kills["survivor"], after_the_kills["save"]
    assert survivor.codes == {0: 75, 1: -signal.SIGKILL}, survivor.stderr[-3000:]
    text = survivor.errs[0]
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert "lost a peer of this run" in lines[0] and "under --fsdp a rank holds only its shard" in lines[0], lines
    named = Path(re.search(r"rerun with --resume from the last checkpoint \((\S+)\)", lines[0]).group(1))
    assert named.is_dir() and named.suffix == ".dcp" and not list(save.glob("*.pt"))  # no emergency save
    update = read_extra_state(named)["train"]["num_updates"]
    assert update in (6, 12)
    done = in_process(leg_args(mnist, save, 1, 3, "--fsdp"))   # the resume on one rank: in this process
    assert f"epoch 1, update {update}\n" in done
    assert checkpoint(save)["train"]["samples_trained"] == 64 * 18
    assert_close(checkpoint(save)["model"], checkpoint(root / "one", "checkpoint_1_18")["model"])
