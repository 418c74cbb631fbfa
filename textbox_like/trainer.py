"""The training loop, top to bottom.

Accelerate places the model, wraps it in DDP and runs mixed precision; this
file decides what is trained on, when to validate, log and save, and how an
update over unequal ranks is weighted: every rank knows from the batch plan
how many samples the whole update holds, and scales its summed loss so that
DDP's average of gradients equals the gradient of the mean over the union of
the samples.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import sys
from pathlib import Path

from . import distributed
from .checkpoint import FORMAT, Checkpointer, load_checkpoint, rng_state, set_rng_state
from .config import to_yaml
from .errors import UserError
from .meters import Logger, StatSums, TrainClock
from .tasks import TASKS

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again", i.e. rerun with --resume


class Preemption:
    """SIGTERM / SIGUSR1 (what Slurm and SGE send before a kill) set a flag;
    the loop finishes the current update, saves and exits."""

    def __init__(self):
        self.requested = False
        self.signal = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass

    def _handler(self, signum, _frame):
        self.requested = True
        self.signal = signal.Signals(signum).name


def mixed_precision(cfg, cuda):
    dtype = cfg.train_dtype
    if cfg.fp16:
        dtype = "float16"
    if cfg.bf16:
        dtype = "bfloat16"
    if dtype == "float16" and not cuda:
        print("warning: float16 mixed precision needs CUDA (Accelerate has none on CPU); "
              "running bfloat16 mixed precision instead", file=sys.stderr)
        dtype = "bfloat16"
    return {"float32": "no", "float16": "fp16", "bfloat16": "bf16"}[dtype]


def build_accelerator(cfg, placement):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    cuda = torch.cuda.is_available() and not cfg.cpu
    if cuda and placement.world_size == 1 and cfg.device_id is not None:
        torch.cuda.set_device(cfg.device_id)  # HetSeq's --device-id picks the GPU of a single process
    ddp = DistributedDataParallelKwargs(find_unused_parameters=cfg.find_unused_parameters,
                                        bucket_cap_mb=cfg.bucket_cap_mb)
    accelerator = Accelerator(cpu=not cuda, mixed_precision=mixed_precision(cfg, cuda),
                              kwargs_handlers=[ddp], step_scheduler_with_optimizer=False)
    if accelerator.num_processes != placement.world_size:
        raise UserError(f"Accelerate sees {accelerator.num_processes} process(es) but this run has "
                        f"{placement.world_size}; on a machine without CUDA start with "
                        f"'accelerate launch --multi_gpu --num_processes N' or '--distributed-world-size N'")
    return accelerator


def gather_per_rank(accelerator, value):
    if accelerator.num_processes == 1:
        return [value]
    from accelerate.utils import gather_object
    return gather_object([value])


def evaluate(task, model, data, batch_sizes, accelerator):
    """Metrics over every sample of ``data``, each rank taking its share
    (``batch_sizes``: one per rank, or one for all)."""
    import numpy as np
    import torch
    from .data.iterators import plan_fixed

    rank, world = accelerator.process_index, accelerator.num_processes
    sums = StatSums()
    was_training = model.training
    model.eval()
    with torch.no_grad():
        sizes = list(batch_sizes) if isinstance(batch_sizes, (list, tuple)) else [batch_sizes] * world
        for row in plan_fixed(len(data), sizes):
            batch = task.collate_to_device(data.get_batch(np.arange(row[rank], row[rank + 1])),
                                           accelerator.device)
            with accelerator.autocast():
                _, stats = task.loss(model, batch)
            sums.add(stats)
    model.train(was_training)
    return task.metrics(sums.reduce(accelerator))


def train(cfg, keys):
    placement = distributed.placement_from_env(cfg) or distributed.Placement()
    # processes sharing a node share its cores; Accelerate would otherwise
    # set 2 threads each, whatever the machine
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(placement.local_world_size, 1))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    import numpy as np
    import torch

    distributed.init_process_group(placement, cfg)
    accelerator = build_accelerator(cfg, placement)
    rank, world = accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process
    preemption = Preemption()
    log = Logger(cfg, is_main)
    if cfg.cudnn_deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.set_num_threads(threads)

    # ---- task, data, model, optimizer --------------------------------------
    from accelerate.utils import set_seed
    set_seed(cfg.seed)
    task = TASKS.get(cfg.task)(cfg)
    # once per run, then once per node (nodes may not share a file system)
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        task.prepare_data()
    train_data = task.build_dataset(cfg.train_subset)
    if len(train_data) == 0:
        raise UserError(f"the {cfg.train_subset!r} split of --data {cfg.data} holds no samples")
    valid_data = {} if cfg.disable_validation else {s: task.build_dataset(s) for s in cfg.valid_subset}
    model = task.build_model()
    n_params = sum(p.numel() for p in model.parameters())

    from .lr_scheduler import build_scheduler
    from .optim import build_optimizer
    optimizer = build_optimizer(cfg, task.param_groups(model, cfg.weight_decay))
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = build_scheduler(cfg, optimizer)
    # each rank its own dropout stream; rank 0 keeps the seed's own stream
    if rank:
        torch.manual_seed(cfg.seed + rank)

    from .data.iterators import EpochBatchIterator
    batch_sizes = gather_per_rank(accelerator, cfg.max_sentences or 0)
    max_tokens = gather_per_rank(accelerator, cfg.max_tokens or 0)
    if not any(max_tokens) and not all(batch_sizes):
        raise UserError("every rank needs --max-sentences (batch size) or --max-tokens")
    iterator = EpochBatchIterator(train_data, cfg.seed, rank, world, batch_sizes, max_tokens,
                                  shuffle=not cfg.no_shuffle, multiple=cfg.required_batch_size_multiple,
                                  num_workers=cfg.num_workers)

    def update_freq_for(e):
        return cfg.update_freq[min(e - 1, len(cfg.update_freq) - 1)]

    # what "decay over the whole run" means when only --max-epoch bounds it
    steps = iterator.steps_in_epoch()
    scheduler.planned_updates = sum(min(math.ceil(steps / update_freq_for(e)), cfg.num_iters_per_epoch or steps)
                                    for e in range(1, (cfg.max_epoch or 0) + 1))
    valid_batch_sizes = gather_per_rank(accelerator, cfg.max_sentences_valid or cfg.max_sentences or 64)
    checkpointer = Checkpointer(cfg, is_main)
    train_sums, log_sums, clock = StatSums(), StatSums(), TrainClock()
    epoch, num_updates, updates_in_epoch = 1, 0, 0
    best = None  # best value of the best-checkpoint metric so far
    best_metric = cfg.best_checkpoint_metric or task.default_best_metric
    maximize = cfg.maximize_best_checkpoint_metric if cfg.maximize_best_checkpoint_metric is not None \
        else task.default_maximize_best_metric
    last_valid, best_valid = {}, {}

    # ---- resume -------------------------------------------------------------
    resume_from = checkpointer.resume_path()
    if cfg.resume and resume_from is None:
        log.info(f"no checkpoint_last.pt in {cfg.save_dir}: starting fresh")
    if resume_from is not None:
        state = load_checkpoint(resume_from)
        if state.get("task") != cfg.task:
            raise UserError(f"{resume_from} is a checkpoint of task {state.get('task')!r}, not {cfg.task!r}")
        try:
            accelerator.unwrap_model(model).load_state_dict(state["model"])
        except RuntimeError as exc:
            raise UserError(f"{resume_from} does not fit this model ({str(exc).splitlines()[0][:150]}...); "
                            f"use the model options it was trained with") from None
        saved_optimizer = state["train"].get("optimizer", cfg.optimizer)
        if not cfg.reset_optimizer and state.get("optimizer") is not None:
            if saved_optimizer != cfg.optimizer:
                raise UserError(f"{resume_from} holds {saved_optimizer} state, this run uses {cfg.optimizer}; "
                                f"pass --reset-optimizer to start {cfg.optimizer} afresh")
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, RuntimeError) as exc:
                raise UserError(f"the optimizer state in {resume_from} does not fit ({exc}); "
                                f"pass --reset-optimizer") from None
        overrides = cfg.optimizer_overrides or {}
        for group in optimizer.param_groups:
            group.update({k: v for k, v in overrides.items()
                          if not (k == "weight_decay" and group.get("no_decay"))})
        if not cfg.reset_meters:
            train_sums.load_state_dict(state["meters"]["train"])
            clock.load_state_dict(state["meters"]["clock"])
            last_valid = state["meters"]["last_valid"]
            if (state["train"]["best_metric"], state["train"]["maximize"]) == (best_metric, maximize):
                best, best_valid = state["train"]["best"], state["meters"]["best_valid"]
        if accelerator.scaler is not None and state.get("scaler"):
            accelerator.scaler.load_state_dict(state["scaler"])
        train_state = state["train"]
        num_updates = train_state["num_updates"]
        if not cfg.reset_dataloader:
            iterator.load_state_dict(state["iterator"])
            epoch, updates_in_epoch = iterator.epoch, train_state["updates_in_epoch"]
        if not cfg.reset_lr_scheduler:
            scheduler.load_state_dict(state["scheduler"])
            if "lr" in overrides:  # an override of lr moves the schedule's base
                scheduler.lrs = [float(overrides["lr"])]
        else:
            if overrides.get("lr") is not None:
                scheduler.lrs = [float(overrides["lr"])]
            scheduler.step_update(num_updates)  # the schedule at the restored update, not at 0
        rngs = state.get("rng") or []
        if len(rngs) == world and not cfg.reset_dataloader:
            set_rng_state(rngs[rank])
        else:
            torch.manual_seed(cfg.seed + 7919 * num_updates + rank)
            log.info(f"checkpoint has RNG states for {len(rngs)} rank(s), this run has {world}: reseeding")
        epoch_done = iterator.end_of_epoch or (cfg.num_iters_per_epoch and
                                               updates_in_epoch >= cfg.num_iters_per_epoch)
        if epoch_done:
            epoch, updates_in_epoch = epoch + 1, 0
            iterator.set_epoch(epoch)
        log.forget_after(num_updates)
        log.info(f"resumed from {resume_from}: epoch {epoch}, update {num_updates}")
        del state
    else:
        iterator.set_epoch(epoch)
    # Every node has its own command line: the settings that fix the data
    # plan and the order of collectives must agree, or samples are skipped
    # or the ranks hang. A save dir that is not shared would also let ranks
    # start from different states.
    agreed = {"position (update, epoch, offset)": (num_updates, iterator.epoch, iterator.offset),
              "--seed": cfg.seed, "training samples": len(train_data), "--no-shuffle": cfg.no_shuffle,
              "--update-freq": tuple(cfg.update_freq), "--max-update": cfg.max_update,
              "--max-epoch": cfg.max_epoch, "--num_iters_per_epoch": cfg.num_iters_per_epoch,
              "--log-interval": cfg.log_interval, "--save-interval": cfg.save_interval,
              "--save-interval-updates": cfg.save_interval_updates, "--validate-interval": cfg.validate_interval,
              "--validate-interval-updates": cfg.validate_interval_updates,
              "--disable-validation": cfg.disable_validation}
    for name, values in zip(agreed, zip(*gather_per_rank(accelerator, tuple(agreed.values())))):
        if len(set(values)) > 1:
            raise UserError(f"the ranks disagree on {name}: {list(values)}; start every node with the same "
                            f"value" + (" and a --save-dir all nodes share" if name.startswith("position") else ""))

    if is_main and not cfg.no_save:
        from .config import write_config
        write_config(cfg, keys, cfg.save_dir)
    log.info(f"task {cfg.task} | {n_params:,} parameters | world size {world} | device {accelerator.device} | "
             f"precision {accelerator.mixed_precision} | batch sizes per rank {batch_sizes} | "
             f"train {len(train_data):,} samples")

    def done_training():
        return (cfg.max_epoch and epoch > cfg.max_epoch) or (cfg.max_update and num_updates >= cfg.max_update)

    # ---- validation -----------------------------------------------------------
    def validate():
        results = {}
        for subset, data in valid_data.items():
            metrics = evaluate(task, model, data, valid_batch_sizes, accelerator)
            results[subset] = metrics
            log.log(f"valid_{subset}" if len(valid_data) > 1 else "valid",
                    {"epoch": epoch, "update": num_updates, **metrics})
        return results

    # ---- checkpointing --------------------------------------------------------
    def fold_log_window():
        """Sum the open log window over ranks (one collective) into the epoch's meters."""
        nonlocal samples_seen
        sums = log_sums.reduce(accelerator)
        train_sums.add(sums)
        log_sums.reset()
        samples_seen += int(sums.get("nsamples", 0))
        return sums

    def save(end_of_epoch, is_best, final=False):
        names = checkpointer.names(epoch, num_updates, end_of_epoch, is_best, final)
        if not (checkpointer.enabled and names):
            return
        fold_log_window()  # so the saved meters are already summed over ranks
        rngs = gather_per_rank(accelerator, rng_state())
        if is_main:
            state = {
                "format": FORMAT,
                "model": accelerator.unwrap_model(model).state_dict(),
                "optimizer": None if cfg.no_save_optimizer_state else optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "iterator": iterator.state_dict(),
                "train": {"epoch": epoch, "num_updates": num_updates, "updates_in_epoch": updates_in_epoch,
                          "best": best, "best_metric": best_metric, "maximize": maximize,
                          "optimizer": cfg.optimizer},
                "meters": {"train": train_sums.state_dict(), "clock": clock.state_dict(),
                           "last_valid": last_valid, "best_valid": best_valid},
                "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
                "rng": rngs,
                "world_size": world,
                "task": cfg.task,
                "config": to_yaml(cfg, keys),
            }
            checkpointer.save(state, names)
        accelerator.wait_for_everyone()

    def after_validation(results):
        nonlocal best, last_valid, best_valid
        if not results:
            return False
        first = results[cfg.valid_subset[0]]
        last_valid = first
        if best_metric not in first:
            raise UserError(f"--best-checkpoint-metric {best_metric!r} is not a metric of task {cfg.task}; "
                            f"choose from: {', '.join(first)}")
        value = first[best_metric]
        improved = best is None or (value > best if maximize else value < best)
        if improved:
            best, best_valid = value, dict(first)
        return improved

    # ---- the loop -------------------------------------------------------------
    grad_params = [p for p in model.parameters() if p.requires_grad]
    stop_reason = None
    samples_seen = int(train_sums.sums.get("nsamples", 0))
    epochs_done = epoch - 1
    end_of_epoch = False
    pending_flag = None
    import torch.distributed as dist
    clock.mark_samples, clock.mark_updates = samples_seen, num_updates
    model.train()
    while not done_training():
        k = update_freq_for(epoch)
        scheduler.step_epoch(epoch)
        total_steps = iterator.steps_in_epoch()
        done = math.ceil((total_steps - len(iterator)) / k)
        bar_total = math.ceil(total_steps / k)
        if cfg.num_iters_per_epoch:
            bar_total = min(bar_total, cfg.num_iters_per_epoch)
        if cfg.max_update:
            bar_total = min(bar_total, done + cfg.max_update - num_updates)
        log.start_epoch(epoch, bar_total, done)
        batches = iter(iterator)
        while True:
            micro = list(itertools.islice(batches, k))
            if not micro:
                break
            # the update's denominators over all its micro-batches and ranks,
            # so that each loss term is its exact mean over the union
            totals = {"nsamples": sum(count for _, count in micro)}
            micro = [task.collate_to_device(batch, accelerator.device) for batch, _ in micro]
            if task.denominators:
                local = torch.stack([sum(task.count(b)[name] for b in micro).float()
                                     for name in task.denominators])
                if world > 1:
                    local = accelerator.reduce(local, reduction="sum")
                totals.update(zip(task.denominators, local.clamp(min=1.0)))
            for i, batch in enumerate(micro):
                # gradients are all-reduced once per update, on its last micro-batch
                sync = contextlib.nullcontext() if i == len(micro) - 1 else accelerator.no_sync(model)
                with sync:
                    terms, stats = task.loss(model, batch)
                    if not isinstance(terms, dict):
                        terms = {"nsamples": terms}
                    # DDP averages gradients over ranks: scale by world size
                    loss = sum(term * (world / totals[name]) for name, term in terms.items())
                    accelerator.backward(loss)
                log_sums.add(stats)
            log_now = cfg.log_interval > 0 and (num_updates + 1) % cfg.log_interval == 0
            gnorm = None
            if cfg.clip_norm > 0:
                gnorm = accelerator.clip_grad_norm_(grad_params, cfg.clip_norm)
            elif log_now:
                gnorm = accelerator.clip_grad_norm_(grad_params, float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            num_updates += 1
            updates_in_epoch += 1
            lr = scheduler.step_update(num_updates)
            log.advance()

            if log_now:
                sums = fold_log_window()
                sps, ups = clock.rates(samples_seen, num_updates)
                log.log("train", {"epoch": epoch, "update": num_updates, **task.metrics(sums), "lr": lr,
                                  "gnorm": float(gnorm) if gnorm is not None else None,
                                  "samples_per_s": sps, "updates_per_s": ups, "wall": clock.elapsed()})

            if world == 1:
                stop_reason = "preempted" if preemption.requested else None
            else:
                # Every rank must stop at the same update, whichever got the
                # signal: the flags are summed asynchronously and read one
                # update later, so the step never waits for it.
                if pending_flag is not None:
                    pending_flag[0].wait()
                    if pending_flag[1].item() > 0:
                        stop_reason = "preempted"
                flag = torch.tensor([float(preemption.requested)], device=accelerator.device)
                pending_flag = (dist.all_reduce(flag, async_op=True), flag)
            epoch_capped = cfg.num_iters_per_epoch and updates_in_epoch >= cfg.num_iters_per_epoch
            end_of_epoch = iterator.end_of_epoch or bool(epoch_capped)
            stop_now = stop_reason is not None or (cfg.max_update and num_updates >= cfg.max_update)
            if not end_of_epoch:
                mid_valid = (cfg.validate_interval_updates > 0 and
                             num_updates % cfg.validate_interval_updates == 0) or \
                    (stop_now and stop_reason is None)
                improved = after_validation(validate()) if mid_valid and valid_data else False
                interval_save = cfg.save_interval_updates > 0 and num_updates % cfg.save_interval_updates == 0
                if interval_save or improved or stop_now:
                    save(False, improved, final=stop_now)
            if stop_now or end_of_epoch:
                break

        log.end_epoch()
        if end_of_epoch:
            fold_log_window()
            epoch_metrics = task.metrics(train_sums.state_dict())
            log.log("train_epoch", {"epoch": epoch, "update": num_updates, **epoch_metrics,
                                    "wall": clock.elapsed()})
            train_sums.reset()
            improved = False
            if valid_data and epoch % cfg.validate_interval == 0:
                improved = after_validation(validate())
            final = stop_reason is not None or bool(cfg.max_update and num_updates >= cfg.max_update) or \
                bool(cfg.max_epoch and epoch >= cfg.max_epoch)
            save(True, improved, final=final)
            if stop_reason is not None:
                break
            epochs_done = epoch
            epoch, updates_in_epoch = epoch + 1, 0
            iterator.set_epoch(epoch)
        elif stop_reason is not None or (cfg.max_update and num_updates >= cfg.max_update):
            break

    results = {"task": cfg.task, "num_updates": num_updates, "epochs_completed": epochs_done,
               "wall_time": clock.elapsed(), "best_metric": best_metric, "best": best_valid,
               "final": last_valid, "stopped": stop_reason or "completed", "world_size": world}
    if is_main and not cfg.no_save:
        target = Path(cfg.save_dir) / "results.json"
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(target)
    if last_valid:
        log.info("done | " + " | ".join(f"{k} {v:.4f}" for k, v in last_valid.items())
                 + f" | updates {num_updates} | wall {clock.elapsed():.1f}s")
    log.close()
    if pending_flag is not None:
        pending_flag[0].wait()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    distributed.cleanup()
    if stop_reason == "preempted":
        saved = checkpointer.enabled and not cfg.no_last_checkpoints
        print(f"stopped by {preemption.signal or 'a signal'}"
              + ("; checkpoint_last.pt saved: rerun the same command with --resume" if saved
                 else "; nothing was saved (--no-save or --no-last-checkpoints)"), file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0
