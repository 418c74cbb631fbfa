"""What the run says: the logging schedule (every --log-interval updates,
and sooner by wall time) and its records, the epoch's record, the start
line and the last line."""
from __future__ import annotations

import os
import time

from textbox_like.core import collectives
from textbox_like.config.compat import default_notes
from textbox_like.training.due import every

#: the longest a run goes without a progress record, in seconds of rank 0's
#: wall clock (as near as a schedule decided at log time can keep it)
LOG_EVERY_S = 5.0
#: rank 0's seconds since its last log decision, shared in the log window's sum
CLOCK_KEY = "log_clock_s_rank0"


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (getrusage's
    ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class RunFacts:
    """What the trainer's build found, for the start line and the log
    schedule: the model's size, the threads, where Accelerate's settings
    came from (``sources``, updated in place by a --compile fallback), the
    sharding's line, the training samples, whether the data is read inline,
    and the updates of --max-epoch epochs."""

    def __init__(self, n_params, threads, sources, sharding_line, train_samples, reads_inline, planned_updates,
                 n_trained=None):
        self.n_params, self.threads, self.sources, self.sharding_line = n_params, threads, sources, sharding_line
        self.n_trained = n_params if n_trained is None else n_trained
        self.train_samples, self.reads_inline, self.planned_updates = train_samples, reads_inline, planned_updates


class Reporting:
    """The open log window (the update step's :class:`~.state.StepRecord`)
    and the schedule that decides when it is logged."""

    def __init__(self, cfg, ranks, accelerator, *, state, record, timing, task, facts, log):
        self.cfg, self.ranks, self.accelerator, self.state = cfg, ranks, accelerator, state
        self.record, self.timing, self.task, self.facts, self.log = record, timing, task, facts, log
        # the wall-clock schedule (schedule_time_log), set at start()
        self.time_log_at, self.time_log_mark = None, None
        self.first_log_probe = True
        self.interval_for = (None, None)  # (target updates, the log interval worked out for it)

    def start(self):
        """The throughput's marks, and the wall-clock log schedule
        (schedule_time_log), which learns the pace at this run's first update."""
        state = self.state
        state.clock.mark_samples, state.clock.mark_updates = state.samples_seen, state.num_updates
        self.time_log_at, self.time_log_mark = state.num_updates + 1, (time.perf_counter(), state.num_updates)
        self.first_log_probe = True

    def fold_log_window(self, share_clock=False) -> dict:
        """Sum the open log window over ranks (one collective) into the
        epoch's meters; ``share_clock``: with rank 0's clock in the same sum,
        for the wall-clock log schedule. The last update is settled by then:
        the trainer settles it before anything that reads the counts."""
        window = self.record.window
        if share_clock:
            elapsed = time.perf_counter() - self.time_log_mark[0] if self.ranks.is_main else 0.0
            window.add({CLOCK_KEY: elapsed})   # every rank the key: the same collective everywhere
        sums = window.reduce(self.accelerator)
        window.reset()
        if share_clock:
            self.schedule_time_log(sums.pop(CLOCK_KEY))
        self.state.epoch_sums.add(sums)
        self.state.samples_seen += int(sums.get("nsamples", 0))
        return sums

    def target_updates(self) -> int:
        """The update the run will stop at (0: not known)."""
        known = [n for n in (self.cfg.schedule.max_update, self.facts.planned_updates) if n]
        return min(known) if known else 0

    def log_interval(self) -> int:
        """--log-interval, shortened so that a short run still logs about ten
        times (a 20-update run with the default 100 would print nothing); a
        user's own --log-interval is kept. The longest spacing of records in
        updates; due() adds records by wall time."""
        target = self.target_updates()
        if self.interval_for[0] != target:   # asked every update: worked out once
            cfg = self.cfg
            interval = cfg.logging.log_interval
            if not (cfg.given("log_interval") or not target or interval <= 0):
                interval = min(interval, max(1, target // 10))
            self.interval_for = (target, interval)
        return self.interval_for[1]

    def due(self, update: int) -> bool:
        """Whether ``update`` logs: every --log-interval updates
        (log_interval), and sooner where the wall-clock schedule
        (schedule_time_log) says so; the same answer on every rank."""
        interval = self.log_interval()
        return interval > 0 and (update % interval == 0 or update >= self.time_log_at)

    def schedule_time_log(self, rank0_seconds: float):
        """The next update to log so that records come at least every
        LOG_EVERY_S seconds: from rank 0's seconds per update since the last
        decision, which every rank received in the same sum, so all ranks
        pick the same update without a collective of their own."""
        num_updates = self.state.num_updates
        updates = max(num_updates - self.time_log_mark[1], 1)
        spacing = max(1, int(LOG_EVERY_S * updates / max(rank0_seconds, 1e-9)))
        self.time_log_at = num_updates + spacing
        self.time_log_mark = (time.perf_counter(), num_updates)

    def log_train(self):
        """The record of the updates since the last one (the trainer asks due() first)."""
        state = self.state
        sums = self.fold_log_window(share_clock=True)
        if self.first_log_probe:
            # the first update of a run is folded to learn its pace, not
            # printed (unless --log-interval asks for it)
            self.first_log_probe = False
            if not every(state.num_updates, self.log_interval()):
                return
        rates = state.clock.window(state.samples_seen, state.num_updates)
        gnorm = self.record.gnorm
        record = {"epoch": state.epoch, "update": state.num_updates, **self.task.metrics(sums), "lr": self.record.lr,
                  "gnorm": float(gnorm) if gnorm is not None else None, **rates}
        if "ntokens" in sums:
            record["tokens_per_s"] = rates["samples_per_s"] * sums["ntokens"] / max(sums.get("nsamples", 0), 1)
        target = self.target_updates()
        if target and rates["updates_per_s"] > 0:
            record["eta_s"] = max(target - state.num_updates, 0) / rates["updates_per_s"]
        record.update(self.peak_memory_per_rank())
        if self.ranks.world > 1:
            record.update(self.seconds_per_rank())
        record["wall"] = state.clock.elapsed()
        self.log.log("train", record)

    def seconds_per_rank(self) -> dict:
        """Each rank's compute, data and all-reduce wait seconds per update
        in this log window (one host collective)."""
        window = self.timing.window("log")
        updates = max(window["updates"], 1)
        mine = [float(window["compute"] / updates), float(window["data"] / updates), float(window["wait"] / updates)]
        rows = collectives.one_per_rank(mine, self.ranks.world, self.ranks.group)
        return {f"{name}_s_per_rank": [round(row[i], 5) for row in rows]
                for i, name in enumerate(("compute", "data", "wait"))}

    def log_epoch(self):
        state = self.state
        self.fold_log_window()
        self.log.log("train_epoch", {"epoch": state.epoch, "update": state.num_updates,
                                     **self.task.metrics(state.epoch_sums.state_dict()),
                                     "wall": state.clock.elapsed()})
        state.epoch_sums.reset()

    def peak_memory_per_rank(self) -> dict:
        """Each rank's peak memory in GiB so far, under a key that says which
        figure it is: on CUDA the allocator's peak (``peak_mem_gib``), on
        other devices the process's peak resident set (``peak_rss_gib``:
        everything the process held, Python and torch themselves included)."""
        import torch
        if self.accelerator.device.type == "cuda":
            # in the default dtype, as a device tensor of it held the figure before
            peak = torch.tensor(torch.cuda.max_memory_allocated() / 2 ** 30, dtype=torch.get_default_dtype()).item()
            key = "peak_mem_gib"
        else:
            peak, key = peak_rss_bytes() / 2 ** 30, "peak_rss_gib"
        return {key: [round(float(v), 3) for v in collectives.one_per_rank(peak, self.ranks.world, self.ranks.group)]}

    def start_line(self, batches: str, schedule: str) -> str:
        """What the run is: task, size, devices, precision and where it was
        chosen, optimizer and lr (and why that lr), ``schedule`` (the lr
        schedule's description), ``batches`` (the global batch's), data."""
        from textbox_like.optim import lr_explained
        cfg, acc, facts, state = self.cfg, self.accelerator, self.facts, self.state
        precision_source = facts.sources.get("precision", "default")
        # each setting Accelerate honours where it did not come from our default: its own field, so that
        # the precision's parenthesis names the precision's source only
        others = "".join(f" | {k} from {v}" for k, v in facts.sources.items() if k != "precision" and v != "default")
        return (f"task {cfg.data.task} | {self.parameters_text()} | world size {self.ranks.world} | "
                f"device {acc.device}" + (f" ({facts.threads} thread{'s' if facts.threads > 1 else ''})"
                                          if acc.device.type == "cpu" else "")
                + f" | precision {self.precision_name()}"
                + (f" (precision from {precision_source})" if precision_source != "default" else "") + others
                + f" | {cfg.optim.optimizer} {lr_explained(cfg)} | lr schedule: {schedule}"
                + (f" | {facts.sharding_line}" if facts.sharding_line else "")
                + f" | {batches} | train " + (f"{facts.train_samples:,} samples" if facts.train_samples is not None
                                           else "streamed")
                + ("" if cfg.validation.disable_validation else
                   f" | best {state.best_metric} ({'higher' if state.maximize else 'lower'} is better)")
                + (" (in memory: read inline, --num-workers not needed)"
                   if cfg.data.num_workers and facts.reads_inline else "")
                + f" | {self.saved_where()}"
                + "".join(f" | {line}" for line in [*self.task.start_notes(), *default_notes(cfg)]))

    def parameters_text(self) -> str:
        """The model's size, and where some weights are frozen (--peft) how many train."""
        facts, method = self.facts, self.cfg.adapters.peft
        if facts.n_trained == facts.n_params:
            return f"{facts.n_params:,} parameters"
        share = 100.0 * facts.n_trained / max(facts.n_params, 1)
        return (f"{facts.n_params:,} parameters, {facts.n_trained:,} trained ({share:.2g}%"
                + (f", --peft {method})" if method != "none" else ")"))

    def precision_name(self) -> str:
        """Accelerate's mixed precision (fp16, bf16), or where it has none
        ("no"), the dtype the model trains in: float32 (float64)."""
        chosen = self.accelerator.mixed_precision
        return self.cfg.numerics.train_dtype if chosen == "no" else chosen

    def saved_where(self) -> str:
        """Where the run is saved, for its start and done lines."""
        if self.cfg.checkpoint.no_save:
            return "not saved (--no-save)"
        return f"saved in {os.path.abspath(self.cfg.checkpoint.save_dir)}"

    def last_line(self, reason):
        """How the run ended, and whose the figures are (the last validation's)."""
        state, cfg = self.state, self.cfg
        head = {"preempted": f"stopped by a signal at update {state.num_updates}",
                "patience": f"done: no better {state.best_metric} in {cfg.validation.patience} validations "
                            f"(--patience) at update {state.num_updates}"}.get(reason, f"done | updates {state.num_updates}")
        if reason.startswith("callback on rank"):
            head = f"done: stopped by a {reason} at update {state.num_updates}"
        figures = (" | last validation: " + " | ".join(f"{k} {v:.4f}" for k, v in state.last_valid.items())
                   if state.last_valid else " | not validated")
        return head + figures + f" | wall {state.clock.elapsed():.1f}s | {self.saved_where()}"
