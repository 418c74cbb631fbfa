"""The run's start and end: the save directory's lock, restoring from a
checkpoint, the checks and the start line before the first update, and at
the end results.json, the last line, the curves and the exit code."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from textbox_like.core import collectives
from textbox_like.processes import distributed
from textbox_like.parallel import sharding
from textbox_like.storage.checkpoint import changes_numbers
from textbox_like.config.files import to_yaml
from textbox_like.core.errors import UserError, first_line
from textbox_like.core.faults import SaveFailed, os_reason, test_delay
from textbox_like.storage.fileio import atomic_write_text
from textbox_like.processes.preemption import raise_if_stopped
from textbox_like.models import adapters
from textbox_like.storage.sharded_checkpoint import drop_kept_copies, full_state_dicts, refuse_rerun


#: seconds a rank that does not see rank 0's lock file under --fsdp looks again before the run stops
LOCK_LOOKS = 30


class SaveDir:
    """The save directory this run holds, from before any data is read to
    the run's end: its lock, and whether this run made it."""

    def __init__(self, cfg, ranks):
        self.cfg, self.ranks = cfg, ranks
        self.save_lock = None           # savelock.SaveDirLock, on the main process while it holds it
        self.made_save_dir = None       # the save directory, where this run made it (removed again while empty)

    def claim(self):
        """One run per save directory: the main process takes its lock
        (savelock.py) before any data is read; every rank learns whether it
        got it, so a refusal ends all of them alike, and the lock's token,
        which each rank's writes into the directory check from then on
        (savelock.check_owner)."""
        from textbox_like.storage import savelock
        cfg, ranks = self.cfg, self.ranks
        save_dir = cfg.checkpoint.save_dir
        refusal = None
        if ranks.is_main and not cfg.checkpoint.no_save:
            # held before its file exists: a signal at any moment of take()
            # (SIGTERM during start-up) finds it here, and release removes the file
            self.save_lock = savelock.SaveDirLock(save_dir)
            try:
                self.save_lock.take()
                refuse_rerun(cfg.checkpoint)
            except UserError as exc:
                refusal = exc
                self.release()
        token = self.save_lock.token if self.save_lock is not None else None
        if ranks.world > 1:
            per_rank = collectives.one_per_rank([refusal is not None, token], ranks.world, ranks.group)
            if any(refused for refused, _ in per_rank) and refusal is None:
                refusal = UserError("rank 0 could not take the save directory (see its message)")
            token = per_rank[0][1]
        if refusal is not None:
            raise refusal
        # a rank that does not see rank 0's lock (a save directory not shared
        # by its node) cannot prove anything, and writes nothing there in a
        # normal run; under --fsdp every rank writes its shards there
        sees_lock = token is not None and savelock.not_owner(Path(save_dir) / savelock.LOCK_NAME, token, False) is None
        if token is not None and ranks.world > 1 and sharding.enabled(cfg):
            blind, sees_lock = self.ranks_blind_to_the_lock(save_dir, token, sees_lock)
            if blind:
                self.release()
                raise UserError(f"--fsdp needs a --save-dir that every rank shares (each writes its shards of every "
                                f"checkpoint there): rank(s) {', '.join(map(str, blind))} do not see rank 0's lock "
                                f"file in {save_dir}; give every node the same directory on a shared file system, "
                                f"or pass --no-save")
        if sees_lock:
            savelock.own(save_dir, token, holds_lock=self.save_lock is not None, who=f"rank {ranks.rank}")

    def ranks_blind_to_the_lock(self, save_dir, token, sees_lock) -> tuple:
        """(the ranks that do not see rank 0's lock file holding ``token`` in
        ``save_dir``, whether this rank sees it), looked at again once a second
        for LOCK_LOOKS seconds while a rank does not: the client of a shared
        file system may answer from its cache that a file just made elsewhere
        does not exist (NFS may keep a failed lookup as long as it caches the
        directory's attributes). Every rank takes part in every look, so all
        stop looking at the same one."""
        import time

        from textbox_like.storage import savelock
        ranks = self.ranks
        looks = max(1, int(test_delay("lock_looks") or LOCK_LOOKS))
        for look in range(looks + 1):
            seen = collectives.one_per_rank(sees_lock, ranks.world, ranks.group)
            blind = [rank for rank, sees in enumerate(seen) if not sees]
            if not blind or look == looks:
                return blind, sees_lock
            if look == 0 and not sees_lock:
                print(f"warning: rank {ranks.rank} does not see rank 0's lock file in {save_dir} (yet?); looking again "
                      f"for up to {looks} s, as a shared file system may show a new file late", file=sys.stderr)
            time.sleep(1.0)
            if not sees_lock:
                sees_lock = savelock.not_owner(Path(save_dir) / savelock.LOCK_NAME, token, False) is None

    def release(self):
        from textbox_like.storage.savelock import disown
        disown()
        lock, self.save_lock = self.save_lock, None
        if lock is not None:
            lock.release()
        if self.made_save_dir is not None:
            # a run that made its save directory and ended before writing into it
            # (refused: a bad --restore-file, a setting): the empty directory goes
            # again; rmdir removes nothing that is in it
            try:
                self.made_save_dir.rmdir()
            except OSError:
                pass


class Lifecycle:
    """Start and finish, and the save directory held in between
    (:class:`SaveDir`, claimed before the rest is built)."""

    def __init__(self, cfg, ranks, accelerator, *, save_dir, agent, task, train_data, model, optimizer, scheduler,
                 state, iterator, checkpointer, reporting, timing, preemption, callbacks, hooks, reseed, log):
        self.cfg, self.ranks, self.accelerator, self.save_dir, self.agent = cfg, ranks, accelerator, save_dir, agent
        self.task, self.train_data, self.model, self.optimizer, self.scheduler = \
            task, train_data, model, optimizer, scheduler
        self.state, self.iterator, self.checkpointer, self.reporting, self.timing = \
            state, iterator, checkpointer, reporting, timing
        self.preemption, self.callbacks, self.hooks, self.reseed, self.log = \
            preemption, callbacks, hooks, reseed, log
        self.updates_at_start = None    # num_updates when this start's first update began (out_of_memory)
        # from finish()'s start, why the run ends: its last update is done (and
        # saved), and a peer lost from here loses nothing (lost_peer_at_end)
        self.finishing = None
        self.exported = False           # the main process got to the task's export (export_model)

    def release_save_dir(self):
        self.save_dir.release()

    def restore(self):
        """Continue from --restore-file, or checkpoint_last.pt under --resume:
        None where there is nothing to restore, else (the checkpoint's path,
        where its run's data failed, if it did). What the restored position
        means for the split and the epoch is the trainer's (Trainer.restore)."""
        cfg, state, checkpoints, iterator, log = \
            self.cfg, self.state, self.checkpointer.checkpoints, self.iterator, self.log
        path = checkpoints.resume_path()
        if path is None:
            if cfg.checkpoint.resume:
                log.info(f"no checkpoint_last.pt in {cfg.checkpoint.save_dir}: starting fresh")
            if cfg.checkpoint.initial_optimizer:
                self.load_initial_optimizer(cfg.checkpoint.initial_optimizer)
            iterator.set_epoch(state.epoch)
            return None
        state_dict, path = checkpoints.load_newest(path, log.info)
        if cfg.checkpoint.resume:  # the same run, continued (--restore-file may start another)
            checkpoints.check_resumed_config(state_dict, path, changes_numbers(cfg),
                                             defaults={"model_conf": self.task.model_conf_defaults()},
                                             log=log.info)
        fresh = checkpoints.restore(state_dict, path)
        data_failure = state_dict.get("data_failure")
        del state_dict
        if cfg.checkpoint.reset_meters:
            state.reset_meters()
        if "iterator" in fresh:  # --reset-dataloader: a new pass from the start, same update count
            state.epoch, state.updates_in_epoch = 1, 0
            iterator.set_epoch(1)
            if "rng" in fresh:
                self.reseed("--reset-dataloader")
        else:
            state.epoch = iterator.epoch
        overrides = cfg.checkpoint.optimizer_overrides or {}
        for group in self.optimizer.param_groups:
            group.update({k: v for k, v in overrides.items() if not (k == "weight_decay" and group.get("no_decay"))})
        if overrides.get("lr") is not None:
            self.scheduler.rebase(float(overrides["lr"]))
        if "scheduler" in fresh:
            self.scheduler.step_update(state.num_updates)  # the schedule at the restored update, not at 0
        return path, data_failure

    def load_initial_optimizer(self, path):
        """kanachan's --initial-optimizer: the optimizer state of one of our
        checkpoints, or a file of ``optimizer.state_dict()``."""
        import torch
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise UserError(f"--initial-optimizer {path} cannot be read ({first_line(exc, 150)})") from None
        if isinstance(saved, dict) and "optimizer" in saved and "param_groups" not in saved:
            saved = saved["optimizer"]
        if not isinstance(saved, dict) or "param_groups" not in saved:
            raise UserError(f"--initial-optimizer {path} holds no optimizer state")
        saved = {k: v for k, v in saved.items() if k != "name"}
        try:
            self.optimizer.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise UserError(f"--initial-optimizer {path} does not fit this model and optimizer "
                            f"({first_line(exc, 150)})") from None
        self.log.info(f"optimizer state from {path}")

    def agreed_settings(self) -> dict:
        """What every rank must have alike: the position, the data, the
        precision actually chosen, and every setting that is not per node."""
        import yaml

        from textbox_like.data.base import samples_held
        state, iterator = self.state, self.iterator
        settings = {"position (update, epoch, offset)": (state.num_updates, iterator.epoch, iterator.offset),
                    "training samples": samples_held(self.train_data),
                    "precision": self.accelerator.mixed_precision}
        for key, value in yaml.safe_load(to_yaml(self.cfg)).items():
            if key not in distributed.PER_NODE_SETTINGS:
                settings[f"--{key.replace('_', '-')}"] = value
        return settings

    def start(self):
        """Before the first update: the ranks agree on the settings, the
        config is written, the trackers start (the rest of the start is the
        trainer's: Trainer.start)."""
        cfg, acc, ranks = self.cfg, self.accelerator, self.ranks
        # every node has its own command line: settings that change the
        # numbers or the order of collectives must agree, or the replicas
        # drift apart or hang
        distributed.check_ranks_agree(self.agreed_settings(), ranks.world, ranks.group)
        if ranks.is_main and not cfg.checkpoint.no_save:
            from textbox_like.config.files import write_config
            write_config(cfg, cfg.checkpoint.save_dir)
        if acc.log_with:
            import yaml

            from textbox_like.metrics.trackers import hyperparameters
            acc.init_trackers("textbox_like", config=hyperparameters(yaml.safe_load(to_yaml(cfg))))

    def into_training(self):
        """The last of the start: the model in training mode, and from here a
        signal saves and stops (before, it stops at once)."""
        self.model.train()
        self.updates_at_start = self.state.num_updates  # an allocation failing before the next one fails the batch size
        raise_if_stopped()  # a start-up signal whose stop was swallowed: not into training
        self.preemption.started = True
        self.callbacks.train_start()

    def finish(self, reason: str, global_batch: int) -> int:
        """The run's end, ``reason`` why (the last update settled);
        ``global_batch``: its samples per update, for a hand-off note."""
        cfg, state, acc, ranks = self.cfg, self.state, self.accelerator, self.ranks
        self.finishing = reason
        results = {"task": cfg.data.task, "num_updates": state.num_updates, "epochs_completed": state.epoch - 1,
                   "wall_time": state.clock.elapsed(),
                   "best_metric": state.best_metric, "best": state.best_valid, "final": state.last_valid,
                   "stopped": "preempted" if reason == "preempted" else "completed", "stop_reason": reason,
                   "world_size": ranks.world, "samples_trained": state.samples_trained}
        if ranks.is_main and not cfg.checkpoint.no_save:
            self.write_results(results)
            time.sleep(self.hooks.finish_delay)  # test-only: a slow end (a peer dies, the directory turns read-only)
            from textbox_like.processes import elastic
            if reason != "preempted":
                elastic.clear_handoff(cfg.checkpoint.save_dir)
                self.remove_kept_copies()
            elif self.agent is not None:  # torchrun stops workers with SIGTERM when a node joins
                elastic.write_handoff(cfg.checkpoint.save_dir, self.agent, state.num_updates, global_batch,
                                      "membership change or preemption")
        if not cfg.checkpoint.no_save and reason != "preempted":
            # sharded (--fsdp): every rank takes part in gathering the whole weights onto the main one
            whole = full_state_dicts(self.model)[0] if sharding.is_sharded(self.model) else None
            if ranks.is_main:
                self.export_model(whole)
        self.log.info(self.reporting.last_line(reason))
        timer = self.timing.timer
        if ranks.world > 1 and timer is not None:
            from textbox_like.training.balance import slowest_rank_line
            totals = timer.totals()
            keys = ("compute", "data", "wait", "updates")
            rows = collectives.one_per_rank([float(totals[k]) for k in keys], ranks.world, ranks.group)
            self.log.info(slowest_rank_line([dict(zip(keys, row)) for row in rows], timer.compute_is))
        self.callbacks.train_end(results)  # the ranks still agree on what it says: before the teardown
        if timer is not None:
            timer.close()
        self.log.close()
        self.preemption.close()
        acc.wait_for_everyone()
        if ranks.is_main:  # every rank is past its last collective: none needs the rendezvous any more
            distributed.remove_rendezvous_file(cfg)
        acc.end_training()
        if ranks.is_main and not cfg.checkpoint.no_save:
            self.plot_curves()
        self.release_save_dir()
        distributed.cleanup()
        return self.exit_code()

    def exit_code(self) -> int:
        """The exit code of the run that finish() ends, with the line of a preempted one."""
        if self.finishing == "preempted":
            checkpoints = self.checkpointer.checkpoints
            print(self.preemption.message(checkpoints.enabled and not self.cfg.checkpoint.no_last_checkpoints,
                                          checkpoints.file_name("checkpoint_last.pt")), file=sys.stderr)
            return self.preemption.exit_code
        return 0

    def lost_peer_at_end(self, exc) -> int:
        """A peer lost during finish(): after the run's last update was done
        and saved (a collective of the save), so not a failure mid-training:
        no emergency save, no hand-off note, not 75 (torchrun would restart a
        finished run), but one warning line and the run's own exit code. Left
        to do are this process's own steps of the end, without the
        collectives (the trackers: end_training finishes them before its
        teardown, so a peer lost in finish() was lost before they were)."""
        cfg, state, ranks = self.cfg, self.state, self.ranks
        if self.timing.timer is not None:
            self.timing.timer.close()
        self.log.close()
        for tracker in self.accelerator.trackers:
            tracker.finish()
        saved = self.checkpointer.saved_update
        if cfg.checkpoint.no_save:
            done = f"update {state.num_updates} finished; --no-save"
        elif saved == state.num_updates:
            done = f"update {state.num_updates} finished and saved"
        else:
            done = f"update {state.num_updates} finished" + (f"; saved last at update {saved}" if saved is not None
                                                              else "; not saved by this run")
        from textbox_like.tasks.base import Task
        unexported = (ranks.is_main and not cfg.checkpoint.no_save and self.finishing != "preempted"
                      and not self.exported and type(self.task).export_at_end is not Task.export_at_end)
        print(f"warning: rank {ranks.rank}: a peer was lost during the run's end ({done}: {first_line(exc, 160)}); "
              + ("the model was not exported: write it with textbox-like export; " if unexported else "")
              + "nothing is lost", file=sys.stderr)
        if ranks.is_main and not cfg.checkpoint.no_save:
            self.plot_curves()
        return self.exit_code()

    def remove_kept_copies(self):
        """The data each sharded name replaced, kept for readers during the run,
        removed (the main process, before the other ranks' last collectives):
        a failure to remove it is one warning, never a stop that leaves them
        waiting for this rank (then a lost peer)."""
        save_dir = self.cfg.checkpoint.save_dir
        try:
            drop_kept_copies(save_dir)
        except OSError as exc:
            print(f"warning: the data of replaced checkpoints, kept for readers during the run, could not be removed "
                  f"from {save_dir} ({os_reason(exc)}); the checkpoints are whole: the next run in it that finishes "
                  f"removes it", file=sys.stderr)

    def write_results(self, results):
        path = Path(self.cfg.checkpoint.save_dir) / "results.json"
        try:
            atomic_write_text(path, json.dumps(results, indent=2), make_parents=False)
        except OSError as exc:
            raise SaveFailed(f"could not write {path} ({os_reason(exc)}); the checkpoints are kept") from None

    def export_model(self, whole=None):
        """The task's export of the trained model (``Task.export_at_end``); a
        failure to write it is one warning: the checkpoints are whole, and
        ``textbox-like export`` writes it from them. ``whole``: a sharded
        model's gathered weights, exported from an unsharded copy."""
        self.exported = True  # tried: a failure to write is its own warning
        save_dir = self.cfg.checkpoint.save_dir
        if whole is None:
            model = self.checkpointer.task_model
        else:
            model = adapters.build_model(self.task, self.cfg.adapters)
            model.load_state_dict(whole)
        try:
            path = self.task.export_at_end(model, save_dir)
        except OSError as exc:
            print(f"warning: the model could not be exported into {save_dir} ({os_reason(exc)}); "
                  f"the checkpoints are kept: write it with textbox-like export", file=sys.stderr)
            return
        if path is not None:
            self.log.info(f"exported the trained model to {path}")

    def plot_curves(self):
        if os.environ.get("TEXTBOX_LIKE_CURVES") == "0":  # drawing takes ~1 s: the test suite's hundreds of runs skip it
            return
        try:
            from textbox_like.metrics.plot import plot_runs
        except ImportError:  # matplotlib missing: curves are a convenience
            return
        save_dir = self.cfg.checkpoint.save_dir
        plot_runs([save_dir], Path(save_dir) / "curves.png")
