"""Prefill groups as the scheduler forms them: how many waiting prompts start together."""

import pytest

from mlxd.scheduler import Budget, Running, Waiting, schedule


@pytest.mark.parametrize(
    ("lengths", "slots", "max_prompts", "budget", "expected"),
    [
        ([], 32, 32, 1024, 0),
        ([40] * 40, 32, 32, 2048, 32),  # bounded by free slots
        ([40] * 40, 32, 8, 2048, 8),  # bounded by prefill_batch_size
        ([40] * 40, 32, 32, 400, 10),  # bounded by the token budget
        ([40] * 40, 0, 32, 1024, 0),  # no free slot
        ([5000, 10, 10], 32, 32, 1024, 1),  # a long prompt goes alone, in chunks
        ([10, 5000, 10], 32, 32, 1024, 1),  # and is not joined by the ones before it
        ([300, 300, 300, 300], 32, 32, 1024, 3),  # the group never exceeds the budget
    ],
)
def test_prefill_group_size(lengths, slots, max_prompts, budget, expected):
    # Rows taken by decoding requests; prompts sampled from their prefill (every token counts).
    running = [Running(-1 - i, 5, 5) for i in range(32 - slots)]
    waiting = [Waiting(i, length) for i, length in enumerate(lengths)]
    limits = Budget(32, max_prompts, budget, max_queue=100, sample_in_prefill=True)
    assert len(schedule(waiting, running, limits).admitted) == expected
