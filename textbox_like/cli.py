"""The command line of run_hetseq.py: the configuration resolved and checked
(textbox_like/config/), then the hand-off to the launch code (launch.py,
distributed.py) or the trainer (trainer.py).

Heavy libraries are imported only after the arguments are known to be good,
so ``--help`` and every bad-input error answer at once.
"""
from __future__ import annotations

import os
import sys

from textbox_like.resolve.checks import check
from textbox_like.config.files import to_yaml

from textbox_like.resolve.resolution import read_resolved, resolve
from textbox_like.core.errors import UserError, first_line
from textbox_like.core.faults import RunStopped, StoppedEarly, Superseded
from textbox_like.processes.preemption import guard_startup


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    guard_startup()

    def resolve_and_run():
        cfg, print_config = resolve(argv)
        if print_config:
            sys.stdout.write(to_yaml(cfg))
            return 0
        check(cfg)
        return run(cfg)
    return exit_code(resolve_and_run)


def run_resolved(path):
    """A spawned rank (or a search trial): run the configuration its
    launcher resolved; reading it imports the run's --user-dir first."""
    guard_startup()
    return exit_code(lambda: run(read_resolved(path)))


def leave(code):
    """The end of a process that ran a command: exit with ``code`` as
    sys.exit would (signals ignored from here: preemption.leaving). A rank
    of a process group (also one process with a group of its own: --fsdp on
    a GPU) leaves without the interpreter's teardown, its output flushed:
    DDP's reducer keeps the group's gloo threads alive past
    destroy_process_group (torch 2.14), and destroying them while the
    interpreter shut down aborted, now and then, a rank of a run that had
    finished and saved everything (SIGABRT, "terminate called without an
    active exception", exit 134)."""
    import logging

    from textbox_like.processes import distributed
    from textbox_like.processes.preemption import leaving
    code = leaving(0 if code is None else code)
    if not distributed.was_rank_of_a_group():
        sys.exit(code)
    if not isinstance(code, int):  # sys.exit's rule: a message is printed and exits 1
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # no stream (None), or closed
            pass
    os._exit(code)


def exit_code(work):
    """``work()``'s exit code; a mistake the user can fix is one line and 2, Ctrl-C 130,
    a fault its own code (faults.py: 75 for a signal before training began)."""
    try:
        return work()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        print(str(exc) if isinstance(exc, StoppedEarly) else f"error: {exc}", file=sys.stderr)
        if isinstance(exc, Superseded):
            # at once, without the interpreter's clean-up: the process group's
            # store would write into (or remove) the rendezvous file, which may
            # be the newer run's now
            sys.stderr.flush()
            os._exit(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run(cfg, callbacks=()):
    """Start the processes this configuration asks for on this node, or train
    in this one; ``callbacks``: Callback instances from Python, for a run in
    this process (processes it starts get --callbacks' names only)."""
    from textbox_like.processes import distributed
    from textbox_like import launch
    launch.launcher_note()
    cfg = launch.apply_hetseq_gpus(launch.apply_gpu_id(cfg))
    dist = cfg.distributed
    if distributed.placement_from_env(cfg) is None:
        if dist.distributed_no_spawn and dist.distributed_init_method:
            placement = distributed.Placement(
                rank=dist.distributed_rank, world_size=dist.distributed_world_size,
                local_rank=dist.device_id or 0, local_world_size=1, init_method=dist.distributed_init_method)
            distributed.export(placement)
        else:
            placements = distributed.local_plan(cfg)
            if placements is not None:
                if callbacks:
                    raise UserError(
                        f"callbacks=[{', '.join(type(c).__name__ for c in callbacks)}]: a run of "
                        f"{len(placements)} processes cannot take Python objects to its ranks; register the class "
                        f"with @register_callback('name') in a module or --user-dir package and pass "
                        f"callbacks=['name'] (--callbacks name)")
                return launch.spawn(placements, cfg)
    # before CUDA and cuBLAS initialise, in every worker
    distributed.apply_determinism(cfg)
    cfg = elastic_restart(cfg)
    from textbox_like.training.outcome import train
    superseded = False
    try:
        return train(cfg, callbacks)
    except Superseded:
        superseded = True
        raise
    except (UserError, RunStopped):
        raise
    except Exception as exc:
        if cfg.numerics.cudnn_deterministic and isinstance(exc, RuntimeError) and "deterministic" in str(exc):
            first = first_line(exc, 200)
            print(f"error: --cudnn_deterministic: {first}; leave it out to train with this operation",
                  file=sys.stderr)
            return 2
        if not distributed.lost_peer(exc):
            raise
        first = first_line(exc, 200)
        init = os.environ.get("TEXTBOX_LIKE_INIT_METHOD") or dist.distributed_init_method or ""
        stale = (f"; if the rendezvous file {init[len('file://'):]} was left by an earlier run, delete it and "
                 f"rerun") if init.startswith("file://") else ""
        print(f"error: rank {os.environ.get('RANK', '?')}: another process of this run died or is "
              f"unreachable ({first}){stale}; stopping (exit 75: the same command can be run again)", file=sys.stderr)
        return StoppedEarly.exit_code   # lost outside training (setting up, tokenising): a retry may go on
    finally:
        # on every way out, also an exception re-raised: leave the process
        # group (a group torn down by the interpreter at exit, with its peer
        # already gone, can abort the process, "terminate called without an
        # active exception", and turn a clean refusal, exit 2, into SIGABRT)
        # and Accelerate's state (a later run in this process, api.train,
        # starts clean). Not a superseded process: see exit_code
        if not superseded:
            distributed.cleanup()


def elastic_restart(cfg):
    """Under torchrun: a worker dies with its agent (a node that dies takes
    its workers along), and a restarted worker group resumes by itself,
    keeping the first start's global batch (elastic.py)."""
    import signal

    from textbox_like.processes import children, elastic
    from textbox_like.core.parent_process import STARTED_BY
    from textbox_like.core.errors import note
    agent = elastic.Agent.from_env()
    if agent is None:
        return cfg
    # torchrun starts each worker in a session of its own, so nothing else
    # ends it when the agent is killed: SIGKILL, as the node's death would,
    # and the survivors go on from the update in flight (elastic.py)
    children.signal_when_parent_dies(signal.SIGKILL, STARTED_BY)
    joining = elastic.joining_note(agent)
    if joining and os.environ.get("RANK", "0") == "0" and agent.restart_count == 0:
        note(joining)
    why = elastic.resume_reason(cfg, agent)
    if why is None:
        return cfg
    settings = {"resume": True}
    kept = elastic.kept_global_batch(cfg)
    if kept is not None:
        settings["global_batch_size"] = kept
    if os.environ.get("RANK", "0") == "0":
        note(f"{why}: resuming from the newest checkpoint in {cfg.checkpoint.save_dir}"
             + (f", keeping the first start's global batch of {kept}" if kept else ""))
    return cfg.replace(f"torchrun (restart {agent.restart_count})", **settings)
