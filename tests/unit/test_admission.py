import pytest

from mlxd.worker.llm_core import prefill_group_size


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
    size = prefill_group_size(lengths, slots=slots, max_prompts=max_prompts, token_budget=budget)
    assert size == expected
