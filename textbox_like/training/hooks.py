"""The test-only hooks, read from the environment once at build time and
injected into the trainer as one object: nothing in the loop reads the
environment. Each is off (None, 0) in a real run."""
from __future__ import annotations

import time

from textbox_like.training.balance import slow_rank
from textbox_like.core.faults import limit_address_space, memory_limit_hook, test_delay


class TestHooks:
    """``TEXTBOX_LIKE_SLOW_RANK`` (a slower device), ``TEXTBOX_LIKE_TEST_DELAY``
    (a slow file system at start, at each save and at the run's end) and
    ``TEXTBOX_LIKE_TEST_MEMORY_LIMIT`` (allocations that really fail);
    ``TEXTBOX_LIKE_TEST_SAMPLE_LOG=PATH``: a streamed run's ranks write the
    ids of the samples each step hands them to PATH.rankR (what trained)."""
    __test__ = False  # not a pytest class, whatever its name

    def __init__(self, rank: int):
        self.slow = slow_rank(rank)           # (seconds per sample, from update) or None
        self.start_delay = test_delay("start")
        self.save_delay = test_delay("save")
        self.finish_delay = test_delay("finish")
        self.memory_limit = memory_limit_hook()  # (megabytes, from update) or None
        import os
        log = os.environ.get("TEXTBOX_LIKE_TEST_SAMPLE_LOG")
        self.sample_log = f"{log}.rank{rank}" if log else None

    def slow_down(self, update: int, samples: int):
        """A slower device: sleep per sample of a micro-batch, from the given update on."""
        if self.slow is not None and update >= self.slow[1]:
            time.sleep(self.slow[0] * samples)

    def limit_memory(self, num_updates: int):
        """From its update on, the process may grow by so many megabytes (faults.limit_address_space)."""
        if self.memory_limit is not None and num_updates == self.memory_limit[1]:
            limit_address_space(self.memory_limit[0])
