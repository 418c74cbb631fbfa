"""The command line of run_hetseq.py: options, checks, and the hand-off to the
launcher (distributed.py) or the trainer (trainer.py).

Heavy libraries are imported only after the arguments are known to be good,
so ``--help`` and every bad-input error answer at once.
"""
from __future__ import annotations

import os
import sys

from . import config as C
from .errors import UserError, closest, note
from .faults import RunStopped, StoppedEarly, Superseded
from .preemption import guard_startup


_built = {}


def build_options():
    """The parser, from the settings' declarations (settings.py), the other
    tools' spellings (compat.py) and each task's, optimizer's and LR
    scheduler's own options. Built once per set of registered components:
    resolving never changes it."""
    from .lr_scheduler import SCHEDULERS
    from .optim import OPTIMIZERS
    from .tasks import TASKS
    key = (C.program_name("run_hetseq.py"), tuple(TASKS.choices()), tuple(OPTIMIZERS.choices()),
           tuple(SCHEDULERS.choices()))
    if key not in _built:
        _built.clear()
        _built[key] = _build_options()
    return _built[key]


def _build_options():
    from . import compat
    from .lr_scheduler import SCHEDULERS
    from .lr_scheduler import add_args as add_scheduler_args
    from .optim import OPTIMIZERS
    from .optim import add_args as add_optimizer_args
    from .settings import declared_settings
    from .tasks import TASKS
    from .trackers import TRACKERS

    o = C.Options(C.program_name("run_hetseq.py"), "Train a task on one process, one node or several unlike nodes.")
    o.group("meta", "configuration files")
    o.add("--config", action="append", default=[], metavar="FILE",
          help="YAML file of option: value (repeatable; later files win; the command line wins over all)")
    o.add("--print_config", action="store_true", help="print the resolved configuration as YAML and exit")
    choices = {"task": f"{', '.join(TASKS.names())}", "optimizer": f"one of: {', '.join(OPTIMIZERS.choices())}",
               "lr_scheduler": f"one of: {', '.join(SCHEDULERS.choices())}", "report_to": ", ".join(TRACKERS)}
    group = None
    for _, section, f in declared_settings():
        meta = f.metadata
        if group != section.group_of(f):
            group = section.group_of(f)
            o.group(group, GROUP_TITLES[group])
        kwargs = {"default": meta["cli_default"], "help": meta["help"].replace("{choices}", choices.get(f.name, ""))}
        if meta["switch"]:
            kwargs["action"] = "store_true"
        elif meta["merge"]:
            kwargs["action"] = C.MergeDict
        for key in ("type", "choices", "metavar"):
            if meta[key] is not None:
                kwargs[key] = meta[key]
        if meta["optional_value"]:
            kwargs.update(nargs="?", const=True)
        o.add(meta["flag"] or "--" + f.name.replace("_", "-"), **kwargs)
    compat.add_aliases(o)
    for name, cls in TASKS.items():
        o.group(f"task:{name}", f"task {name}")
        cls.add_args(o)
    add_optimizer_args(o)
    add_scheduler_args(o)
    compat.add_aliases(o, compat.PLUGIN_ALIASES, "other tools' spellings of the optimizers' options")
    return o


GROUP_TITLES = {"common": "task and data", "optimization": "optimization", "validation": "validation",
                "checkpoint": "checkpoints and resuming", "logging": "logging",
                "distributed": "distributed training"}


def groups_for(ns):
    from .lr_scheduler import SCHEDULERS
    from .optim import OPTIMIZERS
    from .tasks import TASKS
    from .compat import check_optimizer_name
    ns.task = TASKS.canonical(ns.task)
    check_optimizer_name(ns.optimizer, OPTIMIZERS, SCHEDULERS)
    ns.optimizer = OPTIMIZERS.canonical(ns.optimizer)
    ns.lr_scheduler = SCHEDULERS.canonical(ns.lr_scheduler)
    return ["common", "optimization", "validation", "checkpoint", "logging", "distributed",
            f"task:{ns.task}", f"optimizer:{ns.optimizer}", f"lr_scheduler:{ns.lr_scheduler}"]


def check(cfg):
    """Combinations argparse cannot see, checked on the resolved configuration
    before anything heavy starts."""
    from .lr_scheduler import check_scheduler
    from .optim import OPTIMIZERS, optimizer_kwargs, typed_like
    from .tasks import TASKS

    data, optim, ckpt = cfg.data, cfg.optim, cfg.checkpoint
    if data.max_sentences is None and data.max_tokens is None and data.global_batch_size is None:
        raise UserError("give a batch size: --max-sentences N (or --max-tokens N, or --global-batch-size N)")
    _check_global_batch(cfg)
    if not cfg.schedule.max_epoch and not cfg.schedule.max_update:
        raise UserError("training would never stop: set --max-epoch or --max-update")
    if cfg.numerics.fp16 and cfg.numerics.bf16:
        raise UserError("--fp16 and --bf16 exclude each other; choose one")
    spec = OPTIMIZERS.get(optim.optimizer)
    if spec.unusable:
        raise UserError(f"--optimizer {optim.optimizer}: {spec.unusable}; choose another optimizer")
    optim_keys = optimizer_kwargs(optim)
    check_scheduler(cfg)
    if ckpt.restore_file and ckpt.resume:
        raise UserError("--resume and --restore-file exclude each other: --resume reads checkpoint_last.pt "
                        "from --save-dir, --restore-file the file you name")
    if not isinstance(ckpt.optimizer_overrides, dict):
        raise UserError("--optimizer-overrides expects a dict literal like \"{'lr': 0.5}\"")
    for key, value in ckpt.optimizer_overrides.items():
        if key not in optim_keys:
            raise UserError(f"unknown key {key!r} in --optimizer-overrides for {optim.optimizer}"
                            f"{closest(key, optim_keys)}; valid keys: {', '.join(sorted(optim_keys))}")
        typed_like(value, optim_keys[key], key, optim.optimizer, "--optimizer-overrides")
    dist = cfg.distributed
    if dist.distributed_no_spawn and not dist.distributed_init_method and "RANK" not in os.environ:
        raise UserError("--distributed-no-spawn needs --distributed-init-method (or a launcher that sets RANK)")
    if os.path.exists(ckpt.save_dir) and not os.path.isdir(ckpt.save_dir):
        raise UserError(f"--save-dir {ckpt.save_dir} is a file, not a directory; choose another path")
    _check_optimizer_values(optim)
    task = TASKS.get(data.task)
    task.check_config(cfg)
    metric = cfg.validation.best_checkpoint_metric
    if metric and task.metric_names and metric not in task.metric_names:
        raise UserError(f"--best-checkpoint-metric {metric!r} is not a metric of task "
                        f"{data.task}{closest(metric, task.metric_names)}; "
                        f"choose from: {', '.join(task.metric_names)}")


def _check_global_batch(cfg):
    """--global-batch-size and what goes with it (with --max-tokens it counts tokens: see balance.py)."""
    data, dist = cfg.data, cfg.distributed
    if dist.balance and not data.global_batch_size:
        raise UserError("--balance re-splits a fixed global batch by the ranks' speed: give --global-batch-size N")
    if not data.global_batch_size:
        return
    if any(k != 1 for k in cfg.schedule.update_freq):
        raise UserError("--global-batch-size sets the samples of an update; leave --update-freq out (a rank runs "
                        "as many micro-batches of --max-sentences as its share needs)")


def _check_optimizer_values(optim):
    """Let torch judge the values (lr < 0, rho > 1, betas of the wrong length)
    on one dummy parameter, before any data is read."""
    import torch
    from .optim import build_optimizer
    try:
        build_optimizer(optim, [{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    except IndexError:
        raise UserError(f"optimizer {optim.optimizer}: betas must be two numbers, like '(0.9, 0.999)'") from None
    except (ValueError, TypeError) as exc:
        raise UserError(f"optimizer {optim.optimizer}: {exc}; check --lr, --weight-decay and its own options") \
            from None


def resolve(argv=(), overrides=None, environ=None, overrides_name="textbox_like.train()"):
    """(the resolved RunConfig, whether --print_config was asked for).
    ``overrides``: settings by name, from Python (textbox_like.train, a
    search's trial), at the command line's rank; ``overrides_name`` says
    where they came from."""
    from .compat import environment_settings
    from .settings import RunConfig
    from .tasks import TASKS
    options = build_options()
    ns, keys, found = C.resolve(options, list(argv), TASKS, groups_for, overrides=overrides,
                                environment=environment_settings(environ), overrides_name=overrides_name)
    # ESPnet2's spelling of the batch size means the batch over all --ngpu processes (compat.py)
    finalize(options, ns, found, espnet2_batch="--batch_size" in {str(a).split("=", 1)[0] for a in argv})
    plugin_keys = {"task_options": options.groups.get(f"task:{ns.task}", []),
                   "optimizer_options": options.groups.get(f"optimizer:{ns.optimizer}", []),
                   "scheduler_options": options.groups.get(f"lr_scheduler:{ns.lr_scheduler}", [])}
    cfg = RunConfig.from_values(vars(ns), keys, plugin_keys, found.names)
    return cfg, bool(ns.print_config)


def parse(argv=(), overrides=None, overrides_name="textbox_like.train()"):
    """The resolved configuration of a command line (and Python overrides)."""
    return resolve(argv, overrides, overrides_name=overrides_name)[0]


def _credit_optim_conf_lr(found):
    """An lr given as --optim_conf lr=X is the run's lr (resolve_optim_conf:
    at the same layer --optim_conf wins): its source is where that
    --optim_conf came from, not the layer of the --lr it replaced."""
    rank = found.dict_sources.get("optim_conf", {}).get("lr")
    if rank is None or rank < found.sources.get("lr", C.BUILTIN):
        return
    layer = found.names.get("optim_conf") if found.sources.get("optim_conf") == rank else None
    found.sources["lr"] = rank
    found.names["lr"] = f"{layer or C.LAYER_NAMES.get(rank, 'default')} (--optim_conf lr)"


def finalize(options, ns, found, espnet2_batch=False):
    """Options of other tools that stand for ours, and the values that
    depend on several options, resolved once, so that --print_config and
    config.yaml show what the run uses."""
    from .compat import apply_foreign_settings
    from .lr_scheduler import resolve_scheduler_conf
    from .optim import resolve_optim_conf
    from .tasks import TASKS
    from .tasks.base import best_metric_direction

    def user_gave(dest):
        return found.sources.get(dest, C.BUILTIN) >= C.CONFIG_FILE

    apply_foreign_settings(ns, user_gave, lambda dest: found.sources.get(dest, C.BUILTIN), found.names,
                           espnet2_batch=espnet2_batch)
    # the model's sizes, after the rewrites (--model_path and --initial-encoder
    # name the weights whose config.json gives them) and before anything reads them
    TASKS.get(ns.task).resolve_config(ns)
    if ns.required_batch_size_multiple > 1 and ns.max_sentences and not ns.max_tokens:
        from .data.iterators import round_batch_size
        rounded = round_batch_size(ns.max_sentences, ns.required_batch_size_multiple)
        if rounded != ns.max_sentences:
            note(f"--max-sentences {ns.max_sentences} rounded down to {rounded}, a multiple of "
                 f"--required-batch-size-multiple {ns.required_batch_size_multiple}")
            ns.max_sentences = rounded

    # the optimizer's and the scheduler's own arguments, in full
    builtin_optimizer = options.actions["optimizer"].default
    resolve_optim_conf(ns, found.sources, found.dict_sources.get("optim_conf", {}), found.layer_values,
                       builtin_optimizer)
    _credit_optim_conf_lr(found)
    _, maximize = best_metric_direction(ns, TASKS.get(ns.task))  # ReduceLROnPlateau's mode follows it
    resolve_scheduler_conf(ns, options.groups.get(f"lr_scheduler:{ns.lr_scheduler}", []), maximize)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    guard_startup()

    def resolve_and_run():
        cfg, print_config = resolve(argv)
        if print_config:
            sys.stdout.write(C.to_yaml(cfg))
            return 0
        check(cfg)
        return run(cfg)
    return exit_code(resolve_and_run)


def run_resolved(path):
    """A spawned rank: run the configuration its launcher resolved."""
    guard_startup()
    return exit_code(lambda: run(C.read_resolved(path)))


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


def run(cfg):
    """Start the processes this configuration asks for on this node, or train
    in this one."""
    from . import distributed
    from .compat import apply_gpu_id, apply_hetseq_gpus, launcher_note
    launcher_note()
    cfg = apply_hetseq_gpus(apply_gpu_id(cfg))
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
                return distributed.spawn(placements, cfg)
    # before CUDA and cuBLAS initialise, in every worker
    distributed.apply_determinism(cfg)
    cfg = elastic_restart(cfg)
    from .trainer import train
    try:
        return train(cfg)
    except (UserError, RunStopped) as exc:
        # leave the process group before exiting: a group torn down by the
        # interpreter at exit, with its peer already gone, can abort the
        # process ("terminate called without an active exception") and turn
        # a clean refusal (exit 2) into SIGABRT. Not a superseded process:
        # see exit_code
        if not isinstance(exc, Superseded):
            distributed.cleanup()
        raise
    except Exception as exc:
        if cfg.numerics.cudnn_deterministic and isinstance(exc, RuntimeError) and "deterministic" in str(exc):
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            print(f"error: --cudnn_deterministic: {first}; leave it out to train with this operation",
                  file=sys.stderr)
            return 2
        if not distributed.lost_peer(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        init = os.environ.get("TEXTBOX_LIKE_INIT_METHOD") or dist.distributed_init_method or ""
        stale = (f"; if the rendezvous file {init[len('file://'):]} was left by an earlier run, delete it and "
                 f"rerun") if init.startswith("file://") else ""
        print(f"error: rank {os.environ.get('RANK', '?')}: another process of this run died or is "
              f"unreachable ({first}){stale}; stopping", file=sys.stderr)
        return 1


def elastic_restart(cfg):
    """Under torchrun: a worker dies with its agent (a node that dies takes
    its workers along), and a restarted worker group resumes by itself,
    keeping the first start's global batch (elastic.py)."""
    import signal

    from . import STARTED_BY, distributed, elastic
    from .errors import note
    agent = elastic.Agent.from_env()
    if agent is None:
        return cfg
    # torchrun starts each worker in a session of its own, so nothing else
    # ends it when the agent is killed: SIGKILL, as the node's death would,
    # and the survivors go on from the update in flight (elastic.py)
    distributed.signal_when_parent_dies(signal.SIGKILL, STARTED_BY)
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
