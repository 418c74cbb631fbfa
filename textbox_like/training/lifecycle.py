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
from textbox_like.storage.sharded_checkpoint import drop_kept_copies, full_state_dicts, refuse_rerun


#: seconds a rank that does not see rank 0's lock file under --fsdp looks again before the run stops
LOCK_LOOKS = 30


class Lifecycle:
    """Start and finish, and the save directory held in between."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.save_lock = None           # savelock.SaveDirLock, on the main process while it holds it
        self.made_save_dir = None       # the save directory, where this run made it (removed again while empty)
        self.updates_at_start = None    # num_updates when this start's first update began (out_of_memory)
        # from finish()'s start, why the run ends: its last update is done (and
        # saved), and a peer lost from here loses nothing (lost_peer_at_end)
        self.finishing = None
        self.exported = False           # the main process got to the task's export (export_model)

    def claim_save_dir(self):
        """One run per save directory: the main process takes its lock
        (savelock.py) before any data is read; every rank learns whether it
        got it, so a refusal ends all of them alike, and the lock's token,
        which each rank's writes into the directory check from then on
        (savelock.check_owner)."""
        from textbox_like.storage import savelock
        t = self.trainer
        save_dir = t.cfg.checkpoint.save_dir
        refusal = None
        if t.is_main and not t.cfg.checkpoint.no_save:
            # held before its file exists: a signal at any moment of take()
            # (SIGTERM during start-up) finds it here, and release_save_dir removes the file
            self.save_lock = savelock.SaveDirLock(save_dir)
            try:
                self.save_lock.take()
                refuse_rerun(t.cfg.checkpoint)
            except UserError as exc:
                refusal = exc
                self.release_save_dir()
        token = self.save_lock.token if self.save_lock is not None else None
        if t.world > 1:
            per_rank = collectives.one_per_rank([refusal is not None, token], t.world, t.host_group)
            if any(refused for refused, _ in per_rank) and refusal is None:
                refusal = UserError("rank 0 could not take the save directory (see its message)")
            token = per_rank[0][1]
        if refusal is not None:
            raise refusal
        # a rank that does not see rank 0's lock (a save directory not shared
        # by its node) cannot prove anything, and writes nothing there in a
        # normal run; under --fsdp every rank writes its shards there
        sees_lock = token is not None and savelock.not_owner(Path(save_dir) / savelock.LOCK_NAME, token, False) is None
        if token is not None and t.world > 1 and sharding.enabled(t.cfg):
            blind, sees_lock = self.ranks_blind_to_the_lock(save_dir, token, sees_lock)
            if blind:
                self.release_save_dir()
                raise UserError(f"--fsdp needs a --save-dir that every rank shares (each writes its shards of every "
                                f"checkpoint there): rank(s) {', '.join(map(str, blind))} do not see rank 0's lock "
                                f"file in {save_dir}; give every node the same directory on a shared file system, "
                                f"or pass --no-save")
        if sees_lock:
            savelock.own(save_dir, token, holds_lock=self.save_lock is not None, who=f"rank {t.rank}")

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
        t = self.trainer
        looks = max(1, int(test_delay("lock_looks") or LOCK_LOOKS))
        for look in range(looks + 1):
            seen = collectives.one_per_rank(sees_lock, t.world, t.host_group)
            blind = [rank for rank, sees in enumerate(seen) if not sees]
            if not blind or look == looks:
                return blind, sees_lock
            if look == 0 and not sees_lock:
                print(f"warning: rank {t.rank} does not see rank 0's lock file in {save_dir} (yet?); looking again "
                      f"for up to {looks} s, as a shared file system may show a new file late", file=sys.stderr)
            time.sleep(1.0)
            if not sees_lock:
                sees_lock = savelock.not_owner(Path(save_dir) / savelock.LOCK_NAME, token, False) is None

    def release_save_dir(self):
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

    def restore(self):
        """Continue from --restore-file, or checkpoint_last.pt under --resume."""
        t = self.trainer
        cfg, state, checkpoints, feed = t.cfg, t.state, t.checkpointer.checkpoints, t.feed
        path = checkpoints.resume_path()
        if path is None:
            if cfg.checkpoint.resume:
                t.log.info(f"no checkpoint_last.pt in {cfg.checkpoint.save_dir}: starting fresh")
            if cfg.checkpoint.initial_optimizer:
                self.load_initial_optimizer(cfg.checkpoint.initial_optimizer)
            t.iterator.set_epoch(state.epoch)
            return
        state_dict, path = checkpoints.load_newest(path, t.log.info)
        if cfg.checkpoint.resume:  # the same run, continued (--restore-file may start another)
            checkpoints.check_resumed_config(state_dict, path, changes_numbers(cfg),
                                             defaults={"model_conf": t.task.model_conf_defaults()},
                                             log=t.log.info)
        fresh = checkpoints.restore(state_dict, path)
        feed.previous_data_failure = state_dict.get("data_failure")
        del state_dict
        if cfg.checkpoint.reset_meters:
            state.reset_meters()
        if "iterator" in fresh:  # --reset-dataloader: a new pass from the start, same update count
            state.epoch, state.updates_in_epoch = 1, 0
            t.iterator.set_epoch(1)
            if "rng" in fresh:
                t.reseed("--reset-dataloader")
        else:
            state.epoch = t.iterator.epoch
        overrides = cfg.checkpoint.optimizer_overrides or {}
        for group in t.optimizer.param_groups:
            group.update({k: v for k, v in overrides.items() if not (k == "weight_decay" and group.get("no_decay"))})
        if overrides.get("lr") is not None:
            t.scheduler.rebase(float(overrides["lr"]))
        if "scheduler" in fresh:
            t.scheduler.step_update(state.num_updates)  # the schedule at the restored update, not at 0
        if t.global_batch.balancer is not None:  # the saved split, or an even one on another world size
            t.global_batch.apply_split()
        if feed.end_of_epoch():
            feed.next_epoch()
        t.log.forget_after(state.num_updates)
        t.log.info(f"resumed from {path}: epoch {state.epoch}, update {state.num_updates}")

    def load_initial_optimizer(self, path):
        """kanachan's --initial-optimizer: the optimizer state of one of our
        checkpoints, or a file of ``optimizer.state_dict()``."""
        import torch
        t = self.trainer
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
            t.optimizer.load_state_dict(saved)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise UserError(f"--initial-optimizer {path} does not fit this model and optimizer "
                            f"({first_line(exc, 150)})") from None
        t.log.info(f"optimizer state from {path}")

    def agreed_settings(self) -> dict:
        """What every rank must have alike: the position, the data, the
        precision actually chosen, and every setting that is not per node."""
        import yaml
        t = self.trainer
        settings = {"position (update, epoch, offset)": (t.state.num_updates, t.iterator.epoch, t.iterator.offset),
                    "training samples": len(t.train_data),
                    "precision": t.accelerator.mixed_precision}
        for key, value in yaml.safe_load(to_yaml(t.cfg)).items():
            if key not in distributed.PER_NODE_SETTINGS:
                settings[f"--{key.replace('_', '-')}"] = value
        return settings

    def start(self):
        t = self.trainer
        cfg, acc, state = t.cfg, t.accelerator, t.state
        # every node has its own command line: settings that change the
        # numbers or the order of collectives must agree, or the replicas
        # drift apart or hang
        distributed.check_ranks_agree(self.agreed_settings(), t.world, t.host_group)
        if t.is_main and not cfg.checkpoint.no_save:
            from textbox_like.config.files import write_config
            write_config(cfg, cfg.checkpoint.save_dir)
        if acc.log_with:
            import yaml

            from textbox_like.metrics.trackers import hyperparameters
            acc.init_trackers("textbox_like", config=hyperparameters(yaml.safe_load(to_yaml(cfg))))
        memory = t.global_batch.memory
        if memory is not None:  # measured on the second update of this start (a resume too)
            memory.measure_at = state.num_updates + 2
        if t.global_batch.balancer is not None:
            t.global_batch.balancer.start(state.num_updates)
        t.log.info(t.reporting.start_line())
        state.clock.mark_samples, state.clock.mark_updates = state.samples_seen, state.num_updates
        t.reporting.start()
        t.step.decide_device_skips()
        t.model.train()
        self.updates_at_start = state.num_updates  # an allocation failing before the next one fails the batch size
        raise_if_stopped()  # a start-up signal whose stop was swallowed: not into training
        t.preemption.started = True  # from here a signal saves and stops; before, it stops at once
        t.callbacks.train_start()

    def finish(self) -> int:
        t = self.trainer
        t.step.settle()
        cfg, state, acc = t.cfg, t.state, t.accelerator
        reason = self.finishing = t.stop_reason() or "completed"
        results = {"task": cfg.data.task, "num_updates": state.num_updates, "epochs_completed": state.epoch - 1,
                   "wall_time": state.clock.elapsed(),
                   "best_metric": state.best_metric, "best": state.best_valid, "final": state.last_valid,
                   "stopped": "preempted" if reason == "preempted" else "completed", "stop_reason": reason,
                   "world_size": t.world, "samples_trained": state.samples_trained}
        if t.is_main and not cfg.checkpoint.no_save:
            self.write_results(results)
            time.sleep(t.hooks.finish_delay)  # test-only: a slow end (a peer dies, the directory turns read-only)
            from textbox_like.processes import elastic
            if reason != "preempted":
                elastic.clear_handoff(cfg.checkpoint.save_dir)
                self.remove_kept_copies()
            elif t.agent is not None:  # torchrun stops workers with SIGTERM when a node joins
                elastic.write_handoff(cfg.checkpoint.save_dir, t.agent, state.num_updates, t.global_batch.total(),
                                      "membership change or preemption")
        if not cfg.checkpoint.no_save and reason != "preempted":
            # sharded (--fsdp): every rank takes part in gathering the whole weights onto the main one
            whole = full_state_dicts(t.model)[0] if sharding.is_sharded(t.model) else None
            if t.is_main:
                self.export_model(whole)
        t.log.info(t.reporting.last_line(reason))
        timer = t.timing.timer
        if t.world > 1 and timer is not None:
            from textbox_like.training.balance import slowest_rank_line
            totals = timer.totals()
            keys = ("compute", "data", "wait", "updates")
            rows = collectives.one_per_rank([float(totals[k]) for k in keys], t.world, t.host_group)
            t.log.info(slowest_rank_line([dict(zip(keys, row)) for row in rows], timer.compute_is))
        t.callbacks.train_end(results)  # the ranks still agree on what it says: before the teardown
        if timer is not None:
            timer.close()
        t.log.close()
        t.preemption.close()
        acc.wait_for_everyone()
        if t.is_main:  # every rank is past its last collective: none needs the rendezvous any more
            distributed.remove_rendezvous_file(cfg)
        acc.end_training()
        if t.is_main and not cfg.checkpoint.no_save:
            self.plot_curves()
        self.release_save_dir()
        distributed.cleanup()
        return self.exit_code()

    def exit_code(self) -> int:
        """The exit code of the run that finish() ends, with the line of a preempted one."""
        t = self.trainer
        if self.finishing == "preempted":
            checkpoints = t.checkpointer.checkpoints
            print(t.preemption.message(checkpoints.enabled and not t.cfg.checkpoint.no_last_checkpoints,
                                       checkpoints.file_name("checkpoint_last.pt")), file=sys.stderr)
            return t.preemption.exit_code
        return 0

    def lost_peer_at_end(self, exc) -> int:
        """A peer lost during finish(): after the run's last update was done
        and saved (a collective of the save), so not a failure mid-training:
        no emergency save, no hand-off note, not 75 (torchrun would restart a
        finished run), but one warning line and the run's own exit code. Left
        to do are this process's own steps of the end, without the
        collectives (the trackers: end_training finishes them before its
        teardown, so a peer lost in finish() was lost before they were)."""
        t = self.trainer
        cfg, state = t.cfg, t.state
        if t.timing.timer is not None:
            t.timing.timer.close()
        t.log.close()
        for tracker in t.accelerator.trackers:
            tracker.finish()
        saved = t.checkpointer.saved_update
        if cfg.checkpoint.no_save:
            done = f"update {state.num_updates} finished; --no-save"
        elif saved == state.num_updates:
            done = f"update {state.num_updates} finished and saved"
        else:
            done = f"update {state.num_updates} finished" + (f"; saved last at update {saved}" if saved is not None
                                                              else "; not saved by this run")
        from textbox_like.tasks.base import Task
        unexported = (t.is_main and not cfg.checkpoint.no_save and self.finishing != "preempted"
                      and not self.exported and type(t.task).export_at_end is not Task.export_at_end)
        print(f"warning: rank {t.rank}: a peer was lost during the run's end ({done}: {first_line(exc, 160)}); "
              + ("the model was not exported: write it with textbox-like export; " if unexported else "")
              + "nothing is lost", file=sys.stderr)
        if t.is_main and not cfg.checkpoint.no_save:
            self.plot_curves()
        return self.exit_code()

    def remove_kept_copies(self):
        """The data each sharded name replaced, kept for readers during the run,
        removed (the main process, before the other ranks' last collectives):
        a failure to remove it is one warning, never a stop that leaves them
        waiting for this rank (then a lost peer)."""
        save_dir = self.trainer.cfg.checkpoint.save_dir
        try:
            drop_kept_copies(save_dir)
        except OSError as exc:
            print(f"warning: the data of replaced checkpoints, kept for readers during the run, could not be removed "
                  f"from {save_dir} ({os_reason(exc)}); the checkpoints are whole: the next run in it that finishes "
                  f"removes it", file=sys.stderr)

    def write_results(self, results):
        path = Path(self.trainer.cfg.checkpoint.save_dir) / "results.json"
        try:
            atomic_write_text(path, json.dumps(results, indent=2), make_parents=False)
        except OSError as exc:
            raise SaveFailed(f"could not write {path} ({os_reason(exc)}); the checkpoints are kept") from None

    def export_model(self, whole=None):
        """The task's export of the trained model (``Task.export_at_end``); a
        failure to write it is one warning: the checkpoints are whole, and
        ``textbox-like export`` writes it from them. ``whole``: a sharded
        model's gathered weights, exported from an unsharded copy."""
        t = self.trainer
        self.exported = True  # tried: a failure to write is its own warning
        if whole is None:
            model = t.accelerator.unwrap_model(t.model, keep_torch_compile=False)
        else:
            model = t.task.build_model()
            model.load_state_dict(whole)
        try:
            path = t.task.export_at_end(model, t.cfg.checkpoint.save_dir)
        except OSError as exc:
            print(f"warning: the model could not be exported into {t.cfg.checkpoint.save_dir} ({os_reason(exc)}); "
                  f"the checkpoints are kept: write it with textbox-like export", file=sys.stderr)
            return
        if path is not None:
            t.log.info(f"exported the trained model to {path}")

    def plot_curves(self):
        if os.environ.get("TEXTBOX_LIKE_CURVES") == "0":  # drawing takes ~1 s: the test suite's hundreds of runs skip it
            return
        try:
            from textbox_like.metrics.plot import plot_runs
        except ImportError:  # matplotlib missing: curves are a convenience
            return
        save_dir = self.trainer.cfg.checkpoint.save_dir
        plot_runs([save_dir], Path(save_dir) / "curves.png")
