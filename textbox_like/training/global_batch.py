"""--global-batch-size: the update's N samples (tokens) split over the ranks,
each rank's share cut into micro-batches under its cap, the memory guard
that lowers a cap and redoes the update, and the re-splits by measured speed
(--balance). Also each rank's timing (who waits for whom), which the
balancer and the log read."""
from __future__ import annotations

import itertools

from textbox_like.core import collectives
from textbox_like.core.errors import UserError, note


class RankTiming:
    """Who waits for whom: per-rank compute, all-reduce wait and data
    seconds where there are ranks to compare, or a global batch to balance
    (``timer``, a balance.RankTimer, else None), and each reader's mark, so
    that each sees its own window of it."""

    def __init__(self, timer=None):
        self.timer = timer
        self.marks = {}  # consumer -> RankTimer.totals() when it last looked

    @classmethod
    def for_run(cls, grad_params, device, model, timed: bool) -> "RankTiming":
        """``timed``: several ranks, or a global batch to balance."""
        from textbox_like.training import balance
        return cls(balance.RankTimer(grad_params, device, model) if timed else None)

    def window(self, consumer) -> dict:
        """This rank's timer totals since ``consumer`` last asked."""
        from textbox_like.training.balance import since
        now = self.timer.totals()
        window = since(now, self.marks.get(consumer))
        self.marks[consumer] = now
        return window

    def mark_once(self, consumer):
        """``consumer``'s window starts here, unless it has started already."""
        if consumer not in self.marks:
            self.marks[consumer] = self.timer.totals()


def clamped_batch_size(size, dataset, what) -> int:
    """A batch larger than the dataset holds nothing more, but its
    buffers are allocated in full: clamped, with a note."""
    from textbox_like.data.base import samples_held
    held = samples_held(dataset) if dataset is not None else None
    if size and held and held < size:
        note(f"{what} {size} is larger than the {held:,} samples of the data: using {held}")
        return held
    return size or 0


def per_rank_batch_sizes(data, train_data, ranks) -> tuple:
    """Every rank's --max-sentences (clamped to the data) and --max-tokens,
    one host collective each: (batch sizes, token caps), a list per rank each."""
    batch_sizes = collectives.one_per_rank(
        clamped_batch_size(data.max_sentences, train_data, "--max-sentences"), ranks.world, ranks.group)
    max_tokens = collectives.one_per_rank(data.max_tokens or 0, ranks.world, ranks.group)
    if not data.global_batch_size and not any(max_tokens) and not all(batch_sizes):
        raise UserError("every rank needs --max-sentences (batch size) or --max-tokens")
    return batch_sizes, max_tokens


class GlobalBatch:
    """Each rank's batch size, and under --global-batch-size the split, the
    micro-batch caps, the memory guard and the balancer."""

    def __init__(self, cfg, ranks, batch_sizes, max_tokens, *, train_data, iterator, feed, state, optimizer,
                 grad_params, sharded: bool, in_flight, timing, log):
        from textbox_like.training.balance import Balancer
        self.cfg, self.ranks, self.batch_sizes, self.max_tokens = cfg, ranks, batch_sizes, max_tokens
        self.train_data, self.iterator, self.feed, self.state = train_data, iterator, feed, state
        self.optimizer, self.grad_params, self.in_flight, self.timing, self.log = \
            optimizer, grad_params, in_flight, timing, log
        self.sharded = sharded  # the model is sharded (--fsdp): every forward and backward has collectives
        # --global-batch-size: a step is one update's N samples (tokens where
        # a rank gives --max-tokens), split over the ranks; --max-sentences
        # (--max-tokens) caps this rank's micro-batches
        self.balancer, self.by_tokens = None, bool(cfg.data.global_batch_size and any(self.max_tokens))
        self.micro_caps, self.micro_cap = None, None
        if cfg.data.global_batch_size:
            caps = self.max_tokens if self.by_tokens else self.batch_sizes
            self.balancer = Balancer(cfg.data.global_batch_size, ranks.world,
                                     1 if self.by_tokens else cfg.data.required_batch_size_multiple,
                                     cfg.distributed.balance_interval, enabled=cfg.distributed.balance,
                                     unit="tokens" if self.by_tokens else "samples")
            self.micro_caps = [c or cfg.data.global_batch_size for c in caps]
            self.micro_cap = self.micro_caps[ranks.rank]
            if timing.timer is not None:
                self.balancer.speeds = timing.timer.compute_is
        self.memory = None  # the memory guard of a share's micro-batches (build_memory_guard)

    def build_memory_guard(self, device):
        """The memory cap of a share's micro-batches on CUDA."""
        from textbox_like.training import balance
        world = self.ranks.world
        # not under --fsdp: every forward all-gathers, so a rank that runs out
        # of memory mid-update cannot redo it while the others wait in a collective
        probe = balance.memory_probe(device) if self.balancer is not None and not self.sharded else None
        # the out-of-memory protocol has collectives: with unlike devices (CUDA
        # beside CPU), every rank takes part if any rank's memory is guarded
        if self.balancer is not None and world > 1 and \
                any(collectives.one_per_rank(probe is not None, world, self.ranks.group)):
            probe = probe or balance.UnlimitedMemory()
        self.memory = balance.MemoryGuard(probe, self.micro_cap) if probe is not None else None

    def start(self, num_updates: int):
        """A start (a resume too): the memory measured on its second update, the balancer's schedule from here."""
        if self.memory is not None:
            self.memory.measure_at = num_updates + 2
        if self.balancer is not None:
            self.balancer.start(num_updates)

    @property
    def tokens_word(self) -> str:
        """' tokens' after a figure of a global batch counted in tokens, else nothing."""
        return " tokens" if self.by_tokens else ""

    @property
    def split_name(self) -> str:
        """What the split of the global batch gives each rank, in log lines."""
        return "tokens per rank" if self.by_tokens else "batch sizes per rank"

    def apply_split(self):
        """The balancer's split of the global batch to the batch plan, from the current position."""
        self.iterator.set_split(self.balancer.split, by_tokens=self.by_tokens)

    def check_token_caps(self):
        """--global-batch-size in tokens: a sample must fit in every rank's micro-batch cap."""
        tokens = self.train_data.num_tokens() if self.by_tokens else None
        longest = int(tokens.max()) if tokens is not None and len(tokens) else 0
        for rank, cap in enumerate(self.max_tokens):
            if cap and longest > cap:
                raise UserError(f"a sample has {longest} tokens, more than --max-tokens {cap} of rank {rank} "
                                f"(its micro-batch cap under --global-batch-size); raise --max-tokens")

    def total(self) -> int:
        """Samples of one update over all ranks (the first start's total,
        which an elastic restart keeps: elastic.kept_global_batch)."""
        if self.balancer is not None:
            return self.balancer.total
        return sum(self.batch_sizes) * self.feed.update_freq() if not any(self.iterator.max_tokens or []) else 0

    def describe(self) -> str:
        """The batches, for the start line."""
        if self.balancer is not None:
            return (f"global batch {self.balancer.total}{self.tokens_word}"
                    f"{' (balanced)' if self.balancer.enabled else ''} | {self.split_name} {self.balancer.split} | "
                    f"micro-batch caps {self.micro_caps}{self.tokens_word}")
        return f"batch sizes per rank {self.batch_sizes}"

    def backward_share(self, batch, totals, forward_backward):
        """--global-batch-size: this rank's share of the update, cut into
        micro-batches of at most its cap; (their stats, the share's samples
        or tokens). On CUDA a micro-batch that runs out of memory lowers this
        rank's cap, every rank learns of it in one host all-reduce, and the
        update is redone from its first micro-batch: nothing lost, nothing
        counted twice. While the cap is unproven (the first updates, until
        the memory is measured, and a redone update) every micro-batch runs
        under no_sync and the gradients are all-reduced by hand once every
        rank is through: an out-of-memory error in any backward is retried.
        After that DDP all-reduces in the last backward, overlapped with it,
        and an out-of-memory error there ends the run (the other ranks are
        inside that all-reduce); elsewhere it is retried, the failing rank
        joining the all-reduce with an empty micro-batch. ``forward_backward``:
        the update step's (step.ForwardBackward)."""
        ranks, to_device = self.ranks, forward_backward.to_device
        update, redoing = self.state.num_updates + 1, False
        tokens = self.train_data.batch_num_tokens(batch) if self.by_tokens else None
        while True:
            sizes, units = self.micro_batch_plan(batch, tokens)
            if self.memory is None:
                return forward_backward.backward([to_device(b) for b in self.same_count(batch, sizes)],
                                                 totals), sum(units)
            timed = self.timing.timer.snapshot()
            self.memory.before(update)
            by_hand = redoing or update <= self.memory.measure_at  # the same on every rank
            stats, failed = self.try_share(batch, sizes, units, totals, update, by_hand, forward_backward)
            if not collectives.any_rank_failed(failed is not None, ranks.world, ranks.group)[0]:
                if by_hand:
                    self.all_reduce_gradients()
                return stats, sum(units)
            if failed is not None:
                self.micro_cap = self.memory.cap
                self.log.info(f"rank {ranks.rank}: out of memory on a micro-batch of {failed}{self.tokens_word} at "
                              f"update {update}; micro-batches of at most {self.micro_cap} from now on, the update "
                              f"redone", everywhere=True)
            self.optimizer.zero_grad(set_to_none=True)
            self.timing.timer.restore(timed)
            redoing = True

    def same_count(self, batch, sizes) -> list:
        """This rank's micro-batches; under --fsdp as many as the rank with
        the most (empty ones added): every forward and backward all-gathers
        and reduce-scatters, and FSDP has no Join as DDP has."""
        from textbox_like.data.base import cut_batch
        world = self.ranks.world
        batches = cut_batch(batch, sizes)
        if world > 1 and self.sharded:
            most = max(collectives.one_per_rank(len(sizes), world, self.ranks.group))
            batches += [cut_batch(batch, [0])[0] for _ in range(most - len(sizes))]
        return batches

    def try_share(self, batch, sizes, units, totals, update, by_hand, forward_backward):
        """One attempt at this rank's share under the memory guard: (stats,
        None), or (None, the units of the micro-batch that ran out of memory)."""
        from textbox_like.training.balance import is_out_of_memory
        from textbox_like.data.base import cut_batch
        to_device = forward_backward.to_device
        try:
            stats = forward_backward.backward([to_device(b) for b in cut_batch(batch, sizes)], totals,
                                              sync=not by_hand)
        except Exception as exc:
            if not is_out_of_memory(exc) or self.in_flight.all_reducing:
                raise  # out of memory in DDP's all-reducing backward: it cannot take part again
            self.optimizer.zero_grad(set_to_none=True)
            self.memory.out_of_memory(max(units))
            if not by_hand:  # the update's one all-reduce, with nothing of this rank in it
                forward_backward.backward([to_device(cut_batch(batch, [0])[0])], totals)
            return None, max(units)
        lowered = self.memory.after(update, units[0])
        if lowered is not None:
            self.micro_cap = lowered
            self.log.info(f"rank {self.ranks.rank}: micro-batches of at most {lowered}{self.tokens_word} fit in "
                       f"its memory (measured at update {update})", everywhere=True)
        return stats, None

    def all_reduce_gradients(self):
        """DDP's average of the gradients, by hand, after micro-batches that
        all ran under no_sync (a parameter without a gradient counts as zero,
        as in DDP); the wait in it is the rank's all-reduce wait."""
        import torch
        import torch.distributed as dist
        world = self.ranks.world
        if world > 1:
            for p in self.grad_params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        if self.timing.timer is not None:
            self.timing.timer.synced()

    def micro_batch_plan(self, batch, tokens):
        """This rank's share cut under its cap: the micro-batches' sample
        counts and their units (samples, or tokens under --max-tokens)."""
        from textbox_like.training.balance import micro_batch_sizes, micro_batches_by_tokens
        from textbox_like.data.base import batch_samples
        if tokens is None:
            sizes = micro_batch_sizes(batch_samples(batch), self.micro_cap)
            return sizes, sizes
        sizes = micro_batches_by_tokens(tokens, self.micro_cap, self.batch_sizes[self.ranks.rank] or None)
        ends = itertools.accumulate(sizes)
        return sizes, [int(tokens[end - size:end].sum()) for size, end in zip(sizes, ends)]

    def rebalance(self):
        """--balance: at each of the balancer's exchanges, the ranks' compute
        seconds and samples and their timed whole updates on the current
        split in one host collective, and from them the same next split on
        every rank (checked: a rank that computed another stops the run).
        Timing a split starts after its first update (balance.Balancer.marks)."""
        balancer, ranks = self.balancer, self.ranks
        if balancer is None:
            return
        from textbox_like.training.balance import since
        state, timing = self.state, self.timing
        new, was = None, list(balancer.split)
        if balancer.due(state.num_updates):
            window = timing.window("balance")
            timed = since(timing.timer.host_totals(), timing.marks.get("probe"))
            mine = [window["compute"], window["samples"], timed["wall"], timed["wall_sq"], timed["timed"]]
            figures = collectives.one_per_rank([float(v) for v in mine], ranks.world, ranks.group)
            new = balancer.decide([f[0] for f in figures], [f[1] for f in figures], state.num_updates,
                                  walls=[f[2:] for f in figures])
        if balancer.marks(state.num_updates):
            timing.marks["probe"] = timing.timer.host_totals()
        if new is None:
            return
        splits = collectives.one_per_rank(new, ranks.world, ranks.group)
        if any(row != splits[0] for row in splits):
            raise RuntimeError(f"the ranks computed different splits of the global batch: {splits}")
        if new != was:
            self.apply_split()
        rates, unit, table = balancer.units_per_s(), balancer.unit, balancer.table()
        measured = ", ".join(f"{split} {seconds:.4f}" for split, seconds in table.items())
        self.log.event("balance", {"update": state.num_updates, "batch_sizes": new, "was": was,
                                   "reason": balancer.reason, "s_per_update": table, f"{unit}_per_s": rates,
                                   "unit": unit},
                       f"update {state.num_updates} | balance: {self.split_name} {new} "
                       f"({'kept' if new == was else f'was {was}'}): "
                       f"{balancer.reason} | s per update {measured} | {unit}/s per rank {rates}")
