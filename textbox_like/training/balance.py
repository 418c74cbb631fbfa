"""One global batch over unlike ranks: its split, measured speed, and memory.

With ``--global-batch-size N`` every update trains on N samples over all
ranks: one contiguous slice of the epoch order, cut into one share per rank
(:func:`proportional_split`). A rank's ``--max-sentences`` caps one of its
micro-batches (memory), not its share: a share larger than the cap runs as
several micro-batches, all but the last under ``no_sync``, so an update still
all-reduces once. Each sample's weight in the loss is exact
(``Task.denominators``), so any split gives the gradient of one process over
the same N samples. Where the ranks batch by tokens (``--max-tokens``), N
counts tokens: an update is the longest run of the epoch order within N
tokens (``iterators.plan_global_tokens``), split over the ranks by token
shares, a rank's ``--max-tokens`` caps one of its micro-batches
(:func:`micro_batches_by_tokens`), and speed is measured per token.

With ``--balance`` the split follows the ranks' measured speed:

- :class:`RankTimer` measures this rank's compute (forward and backward up to
  its last gradient, not the wait in DDP's all-reduce), its wait in that
  all-reduce and its wait for data; on CUDA with events, read only where the
  host waits anyway (a log line, a re-split, the end), so no update waits.
  Under --fsdp every unit's forward and backward all-gathers and
  reduce-scatters, so a fast rank waits for a slow one inside its own
  compute: on CPU the host time in FSDP's collectives (:class:`TimedCollective`)
  counts as wait, not compute; where that time cannot be seen (CUDA, whose
  collectives run on their own streams, or a replicated mesh dimension,
  whose all-reduce cannot be timed) the ranks' compute times are not compared
  and the split is searched on whole-update time alone;
- :class:`Balancer` shares the figures every ``--balance-interval`` updates
  (the first within 10) in one small collective and computes, on every rank
  from the same numbers, the same new split: shares in proportion to speed,
  multiples of ``--required-batch-size-multiple``, summing to N; a new split
  is taken only when it shortens the predicted update by
  :attr:`Balancer.THRESHOLD` (hysteresis). The split is a checkpoint part.

How :class:`Balancer` searches. What it optimises is the measured wall time of whole updates (every
rank's, from the read of its data to the end of its optimizer step), not
a model of it. It starts from the split proportional to the ranks'
measured compute speed (taken only where that model predicts an update
:attr:`Balancer.THRESHOLD` shorter), then searches around the best split measured
so far: each tried split runs for a probe of :attr:`Balancer.PROBE` updates (the
first of them not timed: new shapes warm up), moving ``step`` samples
between two ranks (the slowest and the fastest first), the step coarse
at first and halved down to one ``multiple`` when no neighbour is
faster. A neighbour replaces the best only when it is faster by more
than the noise (:meth:`Balancer.faster`); one that looks faster by more than
:attr:`Balancer.MIN_GAIN` but within the noise is timed on for up to
:attr:`Balancer.EXTEND` more probes, its measurements pooled; still within the
noise, the best is timed again (:meth:`Balancer.retime_length`, pooled with its
earlier probe) and the two compared once more, before the split is taken
or left (under a noisy neighbour one 10-update probe's noise margin is
~6% of an update, more than a split near the best gains). That return to
the best is the one back-and-forth of an interval: it lasts an interval
at least, so going on to the split taken after it is not a second. Once
settled it re-checks every
``interval`` updates: the best re-measured over the interval, its two
neighbours at :meth:`Balancer.recheck_step`, and, where the ranks' speeds moved
(a neighbour came or went), the best moved by as much as the
proportional split moved; a faster one restarts the search from there.
Every split it tries keeps each rank within ``[one multiple, its cap]``.

On CUDA, :class:`MemoryGuard` lowers a rank's micro-batch cap to what its
device holds (peak memory per sample, measured on an early update, against
the device's capacity with a margin) and after an out-of-memory error.

``TEXTBOX_LIKE_SLOW_RANK=RANK:SECONDS[@UPDATE]`` (tests and demonstrations
only) makes rank RANK sleep SECONDS per sample of each micro-batch between
forward and backward, from update UPDATE on: a slow device, reproducibly.
"""
from __future__ import annotations

import math
import os
import statistics
import time

SLOW_RANK_ENV = "TEXTBOX_LIKE_SLOW_RANK"


# ------------------------------------------------------------------ the split
def proportional_split(total: int, weights, multiple: int = 1) -> list:
    """``total`` samples in shares proportional to ``weights`` (one per rank),
    summing to ``total`` exactly. Shares are multiples of ``multiple`` (the
    remainder of ``total`` by it goes to the heaviest rank) and at least one
    multiple each where ``total`` allows, so every rank keeps a measurable
    share. A pure function of its arguments: every rank computes the same."""
    world = len(weights)
    unit = multiple if multiple > 1 and total >= world * multiple else 1
    units, rest = divmod(int(total), unit)
    w = [max(float(x), 0.0) if math.isfinite(float(x)) else 0.0 for x in weights]
    if sum(w) <= 0:
        w = [1.0] * world
    raw = [units * x / sum(w) for x in w]
    shares = [max(int(math.floor(x)), 1 if units >= world else 0) for x in raw]
    # largest remainders first, ties to the lower rank
    while sum(shares) < units:
        r = max(range(world), key=lambda i: (raw[i] - shares[i], -i))
        shares[r] += 1
    while sum(shares) > units:  # only after the floor of one unit lifted a share
        r = max((i for i in range(world) if shares[i] > 1), key=lambda i: (shares[i] - raw[i], -i))
        shares[r] -= 1
    shares = [s * unit for s in shares]
    shares[max(range(world), key=lambda i: (w[i], -i))] += rest
    return shares


def even_split(total: int, world: int, multiple: int = 1) -> list:
    return proportional_split(total, [1.0] * world, multiple)


def update_seconds(split, seconds_per_sample) -> float:
    """The predicted time of an update: its slowest rank's share."""
    return max(s * t for s, t in zip(split, seconds_per_sample))


def micro_batch_sizes(share: int, cap: int) -> list:
    """``share`` samples in as few micro-batches of at most ``cap`` as
    possible, as even as possible; one (empty) micro-batch for a share of 0,
    since every rank takes part in the update's all-reduce."""
    if share <= 0:
        return [0]
    count = -(-share // max(cap, 1))
    base, extra = divmod(share, count)
    return [base + 1] * extra + [base] * (count - extra)


def micro_batches_by_tokens(tokens, cap_tokens: int, cap_samples: int | None = None) -> list:
    """Sample counts of consecutive micro-batches of a share whose samples
    hold ``tokens`` tokens each: each micro-batch as long as it stays within
    ``cap_tokens`` tokens (and ``cap_samples`` samples, if given); a sample
    above the cap on its own. One (empty) micro-batch for an empty share."""
    sizes, count, held = [], 0, 0
    for t in (int(x) for x in tokens):
        if count and (held + t > cap_tokens or (cap_samples and count >= cap_samples)):
            sizes.append(count)
            count, held = 0, 0
        count, held = count + 1, held + t
    return sizes + [count] if count or not sizes else sizes


def pooled(a, b) -> dict:
    """Two measurements of one split (``{"s", "se", "n", "at"}``: mean
    seconds per update, its standard error, updates; ``probes``: the mean of
    each probe pooled into it) as one: their updates' mean and spread, the
    spread between the two means included. Update times that swing from one
    probe to the next (a noisy neighbour's) are not independent updates, so
    the standard error has two parts: the updates' spread over all of them,
    and the probe means' spread beyond what that spread alone would give,
    over the number of probes (a random-effects estimate), from three probes
    on (the spread of two means says too little: taken from two, it hid
    gains of 5% that four probes against two showed)."""
    n = a["n"] + b["n"]
    mean = (a["s"] * a["n"] + b["s"] * b["n"]) / n
    square = sum(e["n"] * (e["se"] ** 2 * e["n"] + e["s"] ** 2) for e in (a, b)) / n  # mean of squared seconds
    variance = max(square - mean * mean, 0.0)
    probes = a.get("probes", [a["s"]]) + b.get("probes", [b["s"]])
    swing = max(statistics.variance(probes) - variance * len(probes) / n, 0.0) if len(probes) >= 3 else 0.0
    return {**b, "s": mean, "se": math.sqrt(variance / n + swing / len(probes)), "n": n, "probes": probes}


def within_caps(split, caps) -> list:
    """``split`` within every rank's cap (None: no caps), the excess moved to
    the ranks with room, the rest kept; sums to what ``split`` summed to."""
    split = [int(s) for s in split]
    if caps is None:
        return split
    world = len(split)
    for _ in range(world):
        over = [r for r in range(world) if split[r] > caps[r]]
        if not over:
            break
        for r in over:
            excess, split[r] = split[r] - caps[r], caps[r]
            room = sorted((r2 for r2 in range(world) if split[r2] < caps[r2]), key=lambda r2: split[r2] - caps[r2])
            for r2 in room:
                moved = min(excess, caps[r2] - split[r2])
                split[r2], excess = split[r2] + moved, excess - moved
            split[r] += excess  # no rank has room: the caps cannot hold the total
    return split


def split_name(split) -> str:
    """A split as a key of the measured table: ``44+20``."""
    return "+".join(str(int(s)) for s in split)


class Balancer:
    """The split of the global batch over the ranks, and when and how it
    changes. A checkpoint part, with its search: a resume on the same world
    size, global batch and unit continues from the saved split and the
    splits measured so far; on another it starts again from an even split.
    How it searches: the module's docstring.

    Every rank calls it with the same figures (one collective), so every
    rank computes the same splits."""

    #: the proportional start is taken only where it shortens the predicted update by this fraction
    THRESHOLD = 0.05
    #: weight of the newest interval's compute figures against the smoothed ones
    NEWEST = 0.5
    #: the first exchange comes after at most this many updates
    FIRST = 10
    #: updates per tried split (at most --balance-interval): the first warms up, the rest are timed
    PROBE = 10
    #: a measured gain below this fraction of the update's time is never taken (hysteresis)
    MIN_GAIN = 0.01
    #: ... nor one below this many standard errors of the two measurements' difference (noise guard)
    Z = 3.0
    #: probes more that a neighbour faster on average, but within the noise, is timed for (pooled)
    EXTEND = 3
    #: measured splits kept (the oldest are forgotten)
    KEEP = 32
    #: why the search starts where it is when the ranks' compute times are not compared
    UNCOMPARED = ("no proportional start: under --fsdp here each rank's compute time holds its wait in FSDP's "
                  "collectives, so the search runs on whole-update time alone")

    def __init__(self, global_batch_size: int, world: int, multiple: int = 1, interval: int = 50,
                 enabled: bool = True, unit: str = "samples", caps=None):
        self.total, self.world, self.multiple = int(global_batch_size), int(world), int(multiple)
        # what the ranks' compute times measure (RankTimer.compute_is): None where they hold
        # waits for the other ranks, and the search runs on whole-update time alone
        self.speeds = RankTimer.COMPUTE
        self.unit = unit  # what the split counts: samples, or tokens (--max-tokens)
        self.interval, self.enabled = int(interval), bool(enabled)
        # each rank's largest share (None: any share, cut into micro-batches under its memory cap)
        self.caps = [int(c) if c else self.total for c in caps] if caps else None
        self.grain = multiple if multiple > 1 and self.total >= self.world * multiple else 1
        self.probe = max(2, min(self.interval, self.PROBE))
        self.next_check = self.mark_at = None
        self.reset(even_split(self.total, self.world, self.multiple))

    def reset(self, split):
        self.split = self.feasible(split)
        self.seconds_per_sample = [None] * self.world
        self.phase = "start"  # start (the first exchange), search, settled
        self.best = None  # the fastest split measured (the search's centre)
        self.tried = []  # {"split", "s" (seconds per update), "se" (its standard error), "n", "at"}
        self.queue = []  # the splits still to try in this round of the search
        self.step = self.coarse_step()
        self.rechecking = False  # a re-check round: neighbours once, no finer steps unless one is faster
        self.anchor = None  # the proportional split when the search last started from it
        self.round_start = 0  # the update where this search or re-check began
        self.last_move = None  # the move that found the best (a second one the same way doubles the step)
        self.quiet = 0  # re-checks in a row that found nothing faster
        self.waited = 0  # intervals since the last re-check's neighbours
        self.extended = 0  # probes the current split was timed on for, beyond its first (pooled)
        self.contender = None  # a split faster than the best within the noise, while the best is timed again
        self.reason = "even"

    # ---------------------------------------------------------------- steps
    def coarse_step(self) -> int:
        """The search's first step: a power of two times the grain, about
        an eighth of an even share."""
        step = self.grain
        while step * 2 <= self.total // (8 * self.world):
            step *= 2
        return step

    def widest_step(self) -> int:
        return 2 * self.coarse_step()

    def recheck_step(self) -> int:
        """The step of a re-check: one grain, so that the neighbours it
        times cost little where the best still is the best (a large move of
        the ranks' speeds is followed by the proportional shift instead)."""
        return self.grain

    def feasible(self, split) -> list:
        return within_caps(split, self.caps)

    def allowed(self, split) -> bool:
        low = self.grain if self.total >= self.world * self.grain else 0
        return sum(split) == self.total and all(
            s >= low and (self.caps is None or s <= self.caps[r]) for r, s in enumerate(split))

    def proportional(self) -> list:
        return self.feasible(proportional_split(self.total, [1.0 / t for t in self.seconds_per_sample],
                                                self.multiple))

    def neighbours(self, centre, step) -> list:
        """``centre`` with ``step`` moved between two ranks: between the
        slowest and the fastest (by predicted time of their shares) first,
        towards the fastest first, then the other pairs; splits a rank
        cannot hold left out."""
        t = [x or 1.0 for x in self.seconds_per_sample]
        load = sorted(range(self.world), key=lambda r: (-centre[r] * t[r], r))  # slowest first
        pairs = [(load[0], load[-1])] + [(a, b) for i, a in enumerate(load) for b in reversed(load[i + 1:])
                                          if (a, b) != (load[0], load[-1])][:2 * (self.world - 2)]
        out = []
        for slow, fast in pairs:
            for give, take in ((slow, fast), (fast, slow)):
                split = list(centre)
                split[give], split[take] = split[give] - step, split[take] + step
                if self.allowed(split) and split not in out:
                    out.append(split)
        return out

    # ---------------------------------------------------------------- measuring
    def start(self, num_updates: int):
        """Measuring starts (a fresh run or a resume): the first update warms
        up, the exchange after at most FIRST updates (a resume's search
        continues where it was, on a fresh probe; the best's re-timing
        against a contender as long as it is)."""
        if self.phase == "start":
            self.next_check = num_updates + min(self.FIRST, self.interval)
        elif self.phase == "settled":  # the re-check an interval on
            self.next_check = num_updates + self.interval
        elif self.contender is not None:
            self.next_check = num_updates + self.retime_length()
        else:
            self.next_check = num_updates + self.probe
        self.mark_at = num_updates + 1

    def retime_length(self) -> int:
        """Updates the best is timed again against a contender: as long as
        the contender was (its EXTEND + 1 probes), and an interval at least,
        so that going on to the contender afterwards is no second return
        within an interval."""
        return max(self.interval, self.probe * (self.EXTEND + 1))

    def fresh_for(self) -> int:
        """Updates a measurement stays fresh within a round: a split measured
        this recently is not tried again (a contender left after the best's
        re-timing among them)."""
        return max(self.interval, 4 * self.probe, self.retime_length())

    def due(self, num_updates: int) -> bool:
        return self.enabled and self.next_check is not None and num_updates >= self.next_check

    def marks(self, num_updates: int) -> bool:
        """Whether the timing of the current split starts after this update
        (the update after a new split warms up and is not timed)."""
        return self.enabled and self.mark_at == num_updates

    def measured(self, split, fresh_since=None):
        """The latest measurement of ``split`` (taken after ``fresh_since``), or None."""
        for entry in reversed(self.tried):
            if entry["split"] == list(split) and (fresh_since is None or entry["at"] >= fresh_since):
                return entry
        return None

    def record(self, walls, num_updates):
        """The current split's measured update time: each rank's (seconds,
        sum of squared seconds, count) of whole updates since the mark; the
        mean over ranks, with its standard error from the spread of updates."""
        walls = [w for w in walls if w[2] > 0]
        if not walls:
            return None
        n = min(w[2] for w in walls)
        means = [w[0] / w[2] for w in walls]
        variances = [max(w[1] / w[2] - m * m, 0.0) for w, m in zip(walls, means)]
        entry = {"split": list(self.split), "s": sum(means) / len(means),
                 "se": math.sqrt(sum(variances) / len(variances) / max(n, 1)), "n": int(n), "at": int(num_updates)}
        earlier = self.measured(self.split)
        if earlier is not None and (self.extended or self.contender is not None and self.split == self.best):
            entry = pooled(earlier, entry)  # timed on, or the best timed again: one measurement with the earlier
        kept = [e for e in self.tried if e["split"] != entry["split"]]
        while len(kept) > self.KEEP - 1:  # the oldest go, never the best's measurement (the search compares with it)
            del kept[next(i for i, e in enumerate(kept) if self.best is None or e["split"] != list(self.best))]
        self.tried = kept + [entry]
        return entry

    def faster(self, a, b) -> bool:
        """Measurement ``a`` beats ``b`` by more than MIN_GAIN and Z standard errors."""
        margin = max(self.MIN_GAIN * b["s"], self.Z * math.hypot(a["se"], b["se"]))
        return a["s"] < b["s"] - margin

    def promising(self, a, b) -> bool:
        """``a`` beats ``b`` by more than MIN_GAIN on average, not (yet) by more than the noise."""
        return a["s"] < b["s"] * (1 - self.MIN_GAIN) and not self.faster(a, b)

    def decide(self, seconds, samples, num_updates: int, walls=None):
        """Fold in each rank's compute seconds and samples since the last
        exchange and, in ``walls``, its timed whole updates on the current
        split (the same lists on every rank); the split from now on (a new
        one, or the current one where the search settles on it), or None:
        nothing to report. :attr:`reason` says why."""
        for r, (s, n) in enumerate(zip(seconds, samples)):
            if n > 0 and s > 0:
                newest = s / n
                old = self.seconds_per_sample[r]
                self.seconds_per_sample[r] = newest if old is None else \
                    self.NEWEST * newest + (1 - self.NEWEST) * old
        was_settled = self.phase == "settled"
        self.next_check = num_updates + self.probe
        entry = self.record(walls or [], num_updates)
        if any(t is None for t in self.seconds_per_sample) or entry is None:
            return self.hold(num_updates)
        extended, self.extended = self.extended, 0  # pooled once: from here on a fresh measurement
        best = self.measured(self.best) if self.best is not None else None
        if self.phase == "start":  # the search starts from the proportional split, where it pays
            proposal = self.anchor = self.proportional()
            taken = self.speeds is not None and proposal != self.split and \
                update_seconds(proposal, self.seconds_per_sample) <= \
                update_seconds(self.split, self.seconds_per_sample) * (1 - self.THRESHOLD)
            self.phase, self.best, self.round_start = "search", list(proposal if taken else self.split), num_updates
            self.queue = self.neighbours(self.best, self.step)
            if taken:
                return self.move(proposal, num_updates, "proportional to the ranks' measured speed"
                                 + ("" if self.speeds == RankTimer.COMPUTE else f" ({self.speeds})"))
            if self.speeds is None:
                return self.next_candidate(num_updates, gained=self.UNCOMPARED)
        elif self.split != self.best and best is not None and self.promising(entry, best) and \
                extended < self.EXTEND and self.shift is None:
            # faster on average, within the noise: timed on, pooled, before it is taken or left
            self.extended = extended + 1
            self.mark_at = num_updates  # no warm-up: the split stays
            self.reason = (f"{split_name(self.split)} {entry['s']:.4f} s per update against the best "
                           f"{split_name(self.best)} {best['s']:.4f} s: faster within the noise, timed on "
                           f"({self.extended} of {self.EXTEND})")
            return list(self.split)
        elif self.split != self.best and best is not None and self.promising(entry, best) and \
                self.shift is None:
            # still within the noise after its extension: the best (often one short probe) timed
            # again as long, pooled, and the two compared once more
            self.contender = list(self.split)
            self.move(self.best, num_updates, f"{split_name(self.split)} {entry['s']:.4f} s per update over "
                      f"{entry['n']} updates against the best {split_name(self.best)} {best['s']:.4f} s: faster "
                      f"within the noise; the best timed again")
            self.next_check = num_updates + self.retime_length()
            return list(self.split)
        elif self.split != self.best and best is not None and self.faster(entry, best):
            return self.take(entry, best, num_updates)
        elif self.contender is not None and self.split == self.best:  # the best re-timed against the contender
            contender, self.contender = self.measured(self.contender), None
            if contender is not None and self.faster(contender, entry) and self.shift is None:
                return self.take(contender, entry, num_updates)
            if contender is not None and self.shift is None:
                return self.next_candidate(num_updates, gained=(
                    f"{split_name(contender['split'])} {contender['s']:.4f} s per update over {contender['n']} "
                    f"updates against the best {split_name(self.best)} {entry['s']:.4f} s over {entry['n']}: "
                    f"within the noise, left"))
        elif self.split == self.best and was_settled:  # the best re-measured over the interval
            if self.shift is None and self.waited < 2 ** min(self.quiet, 2) - 1:
                # calm: the neighbours are timed every 1, 2, then 4 intervals while none was faster
                self.waited += 1
                self.next_check = num_updates + self.interval
                return self.hold(num_updates)
            self.phase, self.rechecking, self.step = "search", True, self.recheck_step()
            self.round_start, self.last_move, self.waited = num_updates, None, 0
            # two neighbours, between the slowest and the fastest rank: with many ranks,
            # timing every pair's would keep the run off the best most of the time
            self.queue = self.neighbours(self.best, self.step)[:2]
        if self.phase == "search" and self.shift is not None:
            return self.restart(num_updates)
        return self.next_candidate(num_updates)

    def take(self, entry, best, num_updates):
        """The measured ``entry`` is faster than ``best`` beyond the noise:
        its split is the best, the search goes on around it, first onward
        the way that paid."""
        gained = f"faster than {self.best} ({entry['s']:.4f} s against {best['s']:.4f} s per update)"
        move = [a - b for a, b in zip(entry["split"], self.best)]
        if self.last_move is not None and [m > 0 for m in move] == [m > 0 for m in self.last_move] and \
                [m < 0 for m in move] == [m < 0 for m in self.last_move]:
            self.step = min(self.step * 2, self.widest_step())  # the same way again: larger strides
        self.best, self.rechecking, self.last_move, self.quiet = list(entry["split"]), False, move, 0
        self.queue = self.neighbours(self.best, self.step)
        onward = [b + (self.step if m > 0 else -self.step if m < 0 else 0) for b, m in zip(self.best, move)]
        if self.allowed(onward):  # the way that paid first
            self.queue = [onward] + [c for c in self.queue if c != onward]
        return self.next_candidate(num_updates, gained=gained)

    @property
    def shift(self):
        """How far the proportional split moved since the search last
        started from it, where that is two coarse steps or more (a neighbour
        came or went, the ranks' speeds changed): else None."""
        if self.speeds is None:  # the ranks' compute times hold their waits: no measure of speed to follow
            return None
        proposal = self.proportional()
        shift = [p - a for p, a in zip(proposal, self.anchor or proposal)]
        # two steps: a noisy neighbour's own ups and downs move the proportional split by
        # about one (measured: 38..46 of 64 within one run), and each restart loses the search
        return shift if max(abs(d) for d in shift) >= 2 * self.coarse_step() else None

    def restart(self, num_updates):
        """The ranks' speeds changed: the times measured before are stale.
        The search starts again from the best moved by as much as the
        proportional split moved, at the coarse step."""
        shift, self.anchor = self.shift, self.proportional()
        moved = self.feasible([b + d for b, d in zip(self.best, shift)])
        if not self.allowed(moved):
            moved = self.anchor
        why = f"the ranks' speeds changed (proportional split now {self.anchor}): the best {self.best} moved by as much"
        self.best, self.last_move, self.quiet, self.waited, self.rechecking = list(moved), None, 0, 0, False
        self.phase, self.round_start, self.step = "search", num_updates, self.coarse_step()
        self.queue = self.neighbours(self.best, self.step)
        if moved == self.split:
            self.mark_at, self.reason = num_updates, why
            return list(self.split)
        return self.move(moved, num_updates, why)

    def next_candidate(self, num_updates, gained=None):
        """The next untried split of this round; when none is left, a finer
        step, or the best (settled until the next re-check). ``gained``: why
        the best just changed, for the reason."""
        # a split measured in this round (and recently) is not tried again in it
        fresh_since = max(self.round_start, num_updates - self.fresh_for())
        while True:
            while self.queue:
                candidate = self.queue.pop(0)
                if candidate != self.best and self.measured(candidate, fresh_since) is None:
                    return self.move(candidate, num_updates, (f"{gained}; " if gained else "")
                                     + f"trying a neighbour of the best {self.best} (step {self.step})")
            if self.rechecking or self.step <= self.grain:
                break
            self.step = max(self.grain, (self.step // 2) // self.grain * self.grain)
            self.queue = self.neighbours(self.best, self.step)
        self.quiet = self.quiet + 1 if self.rechecking else 0  # a re-check that found nothing faster
        self.phase, self.rechecking = "settled", False
        self.step = self.coarse_step()
        self.next_check = num_updates + self.interval  # a whole interval on the best before its next re-check
        best = self.measured(self.best)
        within = sorted((e for e in self.tried if e["at"] >= self.round_start and e["split"] != self.best
                         and e["s"] < best["s"]), key=lambda e: e["s"])
        why = (f"{gained}; " if gained else "") + f"the best measured ({best['s']:.4f} s per update); " + (
            f"no split tried faster beyond the noise ({split_name(within[0]['split'])} {within[0]['s']:.4f} s, "
            f"within {self.Z:g} standard errors or {self.MIN_GAIN:.0%})" if within else "no neighbour faster")
        if self.split == self.best:  # kept: reported, since the last line named it a candidate
            self.mark_at, self.reason = num_updates, why
            return list(self.split)
        return self.move(list(self.best), num_updates, why, settled=True)

    def move(self, split, num_updates, why, settled=False):
        self.split, self.reason = list(split), why
        self.mark_at = num_updates + 1  # the first update on a new split warms up
        if not settled:
            self.next_check = num_updates + self.probe
        return list(split)

    def hold(self, num_updates):
        """Nothing measured yet: keep the split, time it afresh."""
        self.mark_at = num_updates
        return None

    def table(self) -> dict:
        """The measured seconds per update of the best split and of the
        splits tried in this search or re-check: ``{"44+20": 0.0528}``."""
        return {split_name(e["split"]): round(e["s"], 5) for e in self.tried
                if e["at"] >= self.round_start or e["split"] == self.best}

    def units_per_s(self) -> list:
        """Each rank's smoothed speed, in samples (or tokens) per second."""
        return [round(1.0 / t, 1) if t else None for t in self.seconds_per_sample]

    def state_dict(self):
        return {"global_batch_size": self.total, "split": list(self.split), "unit": self.unit,
                "search": {"phase": self.phase, "best": self.best, "tried": [dict(e) for e in self.tried],
                           "queue": [list(s) for s in self.queue], "step": self.step,
                           "rechecking": self.rechecking, "anchor": self.anchor, "reason": self.reason,
                           "round_start": self.round_start, "last_move": self.last_move,
                           "quiet": self.quiet, "waited": self.waited, "extended": self.extended,
                           "contender": self.contender,
                           "seconds_per_sample": list(self.seconds_per_sample)}}

    def load_state_dict(self, state):
        split = [int(s) for s in state["split"]]
        if len(split) == self.world and self.allowed(split) and state.get("unit", "samples") == self.unit:
            search = state.get("search")
            if search is None:  # a checkpoint from before the search: its split, measured afresh
                self.reset(split)
                return
            self.split = split
            self.phase, self.best, self.step = search["phase"], search["best"], int(search["step"])
            self.tried, self.queue = [dict(e) for e in search["tried"]], [list(s) for s in search["queue"]]
            self.rechecking, self.anchor, self.reason = search["rechecking"], search["anchor"], search["reason"]
            self.round_start, self.last_move = int(search["round_start"]), search["last_move"]
            self.quiet, self.waited = int(search["quiet"]), int(search["waited"])
            self.extended, self.contender = int(search.get("extended", 0)), search.get("contender")
            self.seconds_per_sample = list(search["seconds_per_sample"])
        else:  # another world size, global batch or unit: the even split, re-measured
            self.reset(even_split(self.total, self.world, self.multiple))


# ------------------------------------------------------------------ timing
class RankTimer:
    """This rank's cumulative seconds of compute, all-reduce wait and data
    wait, and its samples and updates; whoever needs a window (log lines, the
    balancer, the run's end) keeps its own mark of :meth:`totals`.

    Compute runs from a micro-batch's forward to the moment its last
    parameter gradient exists (one autograd hook over all parameters); what
    follows in the update's last backward is DDP waiting for the other ranks.
    On CUDA the marks are events on the stream, resolved without waiting
    (:meth:`poll`) or where the host waits anyway (:meth:`totals`).

    Under --fsdp (``model`` sharded) compute runs to the end of the backward
    (:meth:`backward_done`), and on CPU the time in FSDP's all-gathers and
    reduce-scatters within it is moved from compute to wait
    (:meth:`in_collective`): :attr:`compute_is` says what compute measures."""

    #: compute_is under DDP (and one process): forward and backward to the last gradient
    COMPUTE = "compute"
    #: compute_is under --fsdp on CPU
    COMPUTE_WITHOUT_COLLECTIVES = "compute without the time in FSDP's collectives"

    def __init__(self, params, device, model=None):
        import torch
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.compute_is = self.COMPUTE if model is None else self.watch_collectives(model)
        self.compute = self.wait = self.data = 0.0
        self.samples = self.updates = 0
        # whole updates (data, compute, all-reduce, step) on the host clock:
        # what --balance minimises; the squares give its noise
        self.wall = self.wall_sq = 0.0
        self.timed = 0
        self.pending = []  # CUDA: (which total, start event, end event), in stream order
        self.started = self.grads_at = None
        self.handle = torch.autograd.graph.register_multi_grad_hook(
            [p for p in params if p.requires_grad], self.grads_done, mode="all")

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_starts(self):
        self.started = self.mark()

    def grads_done(self, _grads):
        if self.started is None:  # a backward outside training (none today)
            return
        self.grads_at = self.mark()
        self.add("compute", self.started, self.grads_at)
        self.started = None

    def watch_collectives(self, model):
        """What compute measures on ``model``: under --fsdp on CPU with one
        shard dimension (full sharding), its all-gathers and reduce-scatters
        are timed and left out; None where the waits cannot be left out:
        CUDA (collectives on their own streams, not on the host's clock), or
        a replicated mesh dimension (hybrid, none), whose gradient
        all-reduce FSDP2 issues itself, with no custom collective to time it."""
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if not units:
            return self.COMPUTE
        meshes = {p.device_mesh.ndim for p in model.parameters() if hasattr(p, "device_mesh")}
        if self.cuda or meshes != {1}:
            return None
        # FSDP2's own calls (what its DefaultAllGather and DefaultReduceScatter do), timed
        gather = TimedCollective(self, lambda output_tensor, input_tensor, group, async_op=False:
                                 dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op))
        scatter = TimedCollective(self, lambda output_tensor, input_tensor, group, op, async_op=False:
                                  dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group,
                                                             op=op, async_op=async_op))
        for unit in units:
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
        return self.COMPUTE_WITHOUT_COLLECTIVES

    def in_collective(self, seconds: float):
        """``seconds`` spent in one of FSDP's collectives: inside a
        micro-batch's compute, waiting for the other ranks (and moving the
        bytes), not computing."""
        if self.started is not None:
            self.compute -= seconds
            self.wait += seconds

    def backward_done(self):
        """After a backward whose gradients the hook cannot see: FSDP's
        sharded parameters are not in the autograd graph (their gathered
        copies are), so compute runs to the end of the backward, less its
        all-gathers and reduce-scatters where they are timed (:meth:`in_collective`)."""
        if self.started is not None:
            self.grads_done(None)

    def synced(self):
        """After the backward that all-reduced: the wait since the last gradient."""
        if self.grads_at is not None:
            self.add("wait", self.grads_at, self.mark())
            self.grads_at = None

    def add(self, which, start, end):
        if self.cuda:
            self.pending.append((which, start, end))
        else:
            setattr(self, which, getattr(self, which) + end - start)

    def count(self, samples: int):
        self.samples += int(samples)
        self.updates += 1
        if self.cuda:
            self.poll()

    def poll(self, wait=False):
        """Fold in the CUDA intervals already measured (all of them: ``wait``)."""
        while self.pending:
            which, start, end = self.pending[0]
            if wait:
                end.synchronize()
            elif not end.query():
                return
            setattr(self, which, getattr(self, which) + start.elapsed_time(end) / 1000.0)
            self.pending.pop(0)

    def update_took(self, seconds: float):
        """One whole update took ``seconds`` (from the read of its data to
        the end of its step)."""
        self.wall += seconds
        self.wall_sq += seconds * seconds
        self.timed += 1

    def host_totals(self) -> dict:
        """The whole-update figures, host counters only (no device wait)."""
        return {"wall": self.wall, "wall_sq": self.wall_sq, "timed": self.timed}

    def snapshot(self):
        return (self.compute, self.wait, self.data, self.samples, self.updates, len(self.pending))

    def restore(self, snap):
        """Forget an attempt that was redone (an out-of-memory retry)."""
        self.compute, self.wait, self.data, self.samples, self.updates, pending = snap
        del self.pending[pending:]
        self.started = self.grads_at = None

    def totals(self) -> dict:
        if self.cuda:
            self.poll(wait=True)
        return {"compute": self.compute, "wait": self.wait, "data": self.data, "samples": self.samples,
                "updates": self.updates}

    def close(self):
        self.handle.remove()


class TimedCollective:
    """One of FSDP2's collectives (``FSDPModule.set_custom_all_gather`` /
    ``set_custom_reduce_scatter``: ``collective`` is torch's own call) with
    the host's time in it given to ``timer`` (:meth:`RankTimer.in_collective`).
    On CPU FSDP2 calls them synchronously (its all-gathers are not async
    unless prefetched by hand, which the trainer does not ask for), so the
    host waits in them until every rank has joined: the wait for a slower rank."""

    def __init__(self, timer, collective):
        self.timer, self.collective = timer, collective

    def allocate(self, size, *, dtype, device):
        import torch
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, **kwargs):
        started = time.perf_counter()
        try:
            return self.collective(**kwargs)
        finally:
            self.timer.in_collective(time.perf_counter() - started)


def since(now: dict, mark: dict | None) -> dict:
    return dict(now) if mark is None else {k: now[k] - mark[k] for k in now}


def slowest_rank_line(per_rank, compute_is=RankTimer.COMPUTE) -> str:
    """The run's last line: who was waited for, and why. ``per_rank``: each
    rank's totals (compute, data, wait seconds and updates); ``compute_is``:
    what their compute measures (:attr:`RankTimer.compute_is`). Where it is
    None (--fsdp on CUDA, or with a replicated mesh dimension) each rank's
    compute holds its wait for the others, and the rank that waited most
    would read as the slowest: no rank is named, the figures are given with
    that caveat."""
    per_update = [{k: r[k] / max(r["updates"], 1) for k in ("compute", "data", "wait")} for r in per_rank]
    if compute_is is None:
        def spread(key):
            values = [p[key] for p in per_update]
            return f"{min(values):.4f}-{max(values):.4f} s {key}"
        return (f"slowest rank not named: under --fsdp here each rank's compute time holds its wait in FSDP's "
                f"collectives, so the ranks' compute times are not compared ({spread('compute')}, "
                f"{spread('data')} per update over the ranks)")
    busy = [p["compute"] + p["data"] for p in per_update]
    slow = max(range(len(busy)), key=lambda r: (busy[r], -r))
    p = per_update[slow]
    bound = "data-bound" if p["data"] > p["compute"] else "compute-bound"
    others = [per_update[r]["wait"] for r in range(len(busy)) if r != slow]
    waited = f"; the others waited {sum(others) / max(len(others), 1):.4f} s per update for it" if others else ""
    return (f"slowest rank {slow}: {bound} ({p['compute']:.4f} s compute, {p['data']:.4f} s data per update"
            f"{waited})")


# ------------------------------------------------------------------ memory
class CudaMemory:
    """The CUDA allocator's figures for this process's device (host-side
    counters: reading them does not wait for the device)."""

    def __init__(self, device):
        self.device = device

    def capacity(self) -> int:
        import torch
        return torch.cuda.mem_get_info(self.device)[1]

    def allocated(self) -> int:
        import torch
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self):
        import torch
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch
        return torch.cuda.max_memory_allocated(self.device)

    def release(self):
        import torch
        torch.cuda.empty_cache()


class UnlimitedMemory:
    """The figures of a device with no memory limit to guard (CPU), for a
    rank in a run where another rank's device has one: it takes part in the
    out-of-memory protocol's collectives and never lowers its cap."""

    def capacity(self) -> int:
        return 1 << 62

    def allocated(self) -> int:
        return 0

    def reset_peak(self):
        pass

    def peak(self) -> int:
        return 0

    def release(self):
        pass


def memory_probe(device):
    """The memory figures of ``device``: a :class:`CudaMemory` on CUDA, else
    None (CPU memory is not the limit a micro-batch cap guards)."""
    return CudaMemory(device) if getattr(device, "type", None) == "cuda" else None


class MemoryGuard:
    """A rank's micro-batch cap under its device's memory: measured once
    (peak bytes per sample, or per token, of one micro-batch, on the update
    given: the trainer's second after it starts, when the optimizer's state
    exists), and halved below a micro-batch that ran out of memory."""

    MARGIN = 0.10  # of the device's capacity, left free

    def __init__(self, probe, cap: int, measure_at_update: int = 2):
        self.probe, self.cap, self.measure_at = probe, int(cap), measure_at_update
        self.base = None
        self.per_sample = None

    def before(self, update: int):
        if update == self.measure_at and self.per_sample is None:
            self.probe.reset_peak()
            self.base = self.probe.allocated()

    def after(self, update: int, samples: int) -> int | None:
        """After the first micro-batch of ``update``: the lowered cap, if any."""
        if self.base is None or samples <= 0:
            return None
        self.per_sample = max((self.probe.peak() - self.base) / samples, 1.0)
        room = self.probe.capacity() * (1 - self.MARGIN) - self.base
        self.base = None
        fits = max(int(room // self.per_sample), 1)
        if fits < self.cap:
            self.cap = fits
            return fits
        return None

    def out_of_memory(self, failed_size: int) -> int:
        self.probe.release()
        self.cap = max(min(self.cap, max(failed_size, 1)) // 2, 1)
        return self.cap


def is_out_of_memory(exc) -> bool:
    import torch
    return isinstance(exc, torch.OutOfMemoryError)


# ------------------------------------------------------------------ test hook
def slow_rank(rank: int):
    """(seconds per sample, from update) for this rank under
    ``TEXTBOX_LIKE_SLOW_RANK``, else None."""
    text = os.environ.get(SLOW_RANK_ENV, "").strip()
    if not text:
        return None
    try:
        who, rest = text.split(":", 1)
        seconds, _, start = rest.partition("@")
        if int(who) != rank:
            return None
        return float(seconds), int(start or 0)
    except ValueError:
        from textbox_like.core.errors import UserError
        raise UserError(f"{SLOW_RANK_ENV}={text!r}: expected RANK:SECONDS_PER_SAMPLE[@FROM_UPDATE]") from None
