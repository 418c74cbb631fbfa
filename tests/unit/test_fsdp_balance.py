"""--balance under --fsdp (review of issue 32, item 2): FSDP2 all-gathers and
reduce-scatters inside every unit's forward and backward, so a fast rank
waits for a slow one inside its own compute. On CPU that time is timed in
FSDP's collectives and left out of compute, so the ranks' measured speeds
differ as their devices do and the split moves samples away from a slow
rank; where it cannot be left out (CUDA, a replicated mesh dimension) the
search runs on whole-update time alone and says so.

Multi-rank runs are two real processes over gloo; the slow rank is made with
the test-only TEXTBOX_LIKE_SLOW_RANK (balance.py)."""
from __future__ import annotations

import pytest

from textbox_like.training.balance import Balancer

from test_balance import oscillations_per_interval, simulate


def convex(optimum, curvature=0.0001, base=0.05):
    return lambda split, update: base + curvature * (split[0] - optimum) ** 2


@pytest.mark.parametrize("seed", range(3))
def test_uncompared_speeds_search_on_whole_update_time_alone(seed):
    """Where the ranks' compute times hold their waits (--fsdp on CUDA, or
    with a replicated mesh dimension: RankTimer.compute_is None), they do not
    move the split: no proportional start (the figures say 44/20), no
    restart when they move, and the search on measured update times still
    ends within one step of the optimum (48/16)."""
    b = Balancer(64, 2, multiple=4, interval=50)
    b.speeds = None
    reasons = []
    decide = b.decide

    def recording(*args, **kwargs):
        new = decide(*args, **kwargs)
        reasons.append(b.reason)
        return new
    b.decide = recording
    # compute figures that would say 44/20, then move by far more than a coarse step
    trace = simulate(b, convex(48), 400, seed=seed,
                     speeds=lambda update: [0.001, 0.0022] if update < 200 else [0.001, 0.005])
    assert trace[10] != [44, 20] and reasons[0].startswith(Balancer.UNCOMPARED), (trace[10], reasons[0])
    assert not any(r.startswith("the ranks' speeds changed") for r in reasons)
    assert abs(b.best[0] - 48) <= 4 and abs(trace[-1][0] - 48) <= 4, (b.best, b.tried)
    assert max(oscillations_per_interval(trace, 50)) <= 1
