"""The batch scheduler: one step's admission, prefill chunks and decode rows, as tables."""

from __future__ import annotations

import pytest

from mlxd.scheduler import Budget, Chunk, Running, StepPlan, Waiting, schedule

BUDGET = Budget(max_batch_size=4, prefill_batch_size=2, prefill_step_size=100, max_queue=8)
SAMPLING = Budget(
    max_batch_size=4, prefill_batch_size=2, prefill_step_size=100, max_queue=8,
    sample_in_prefill=True,
)  # fmt: skip


def W(id: int, prompt: int, cached: int = 0) -> Waiting:
    return Waiting(id, prompt, cached)


def R(id: int, prompt: int, computed: int) -> Running:
    return Running(id, prompt, computed)


CASES = {
    "an empty step": ([], [], BUDGET, StepPlan()),
    "one short prompt: all but its last token": (
        [W(1, 10)], [], BUDGET, StepPlan(admitted=(1,), prefill=(Chunk(1, 0, 9),)),
    ),
    "one short prompt, sampled from the prefill: every token": (
        [W(1, 10)], [], SAMPLING, StepPlan(admitted=(1,), prefill=(Chunk(1, 0, 10),)),
    ),
    "admission up to the prefill group size": (
        [W(1, 10), W(2, 10), W(3, 10)], [], BUDGET,
        StepPlan(admitted=(1, 2), prefill=(Chunk(1, 0, 9), Chunk(2, 0, 9))),
    ),
    "admission up to the free rows": (
        [W(5, 10), W(6, 10)], [R(1, 5, 4), R(2, 5, 4), R(3, 5, 4)], BUDGET,
        StepPlan(admitted=(5,), prefill=(Chunk(5, 0, 9),), decode=(1, 2, 3)),
    ),
    "a full batch admits nobody": (
        [W(5, 10)], [R(1, 5, 4), R(2, 5, 4), R(3, 5, 4), R(4, 5, 4)], BUDGET,
        StepPlan(decode=(1, 2, 3, 4)),
    ),
    "a long prompt goes alone, its first chunk the whole budget": (
        [W(1, 250), W(2, 5)], [], BUDGET, StepPlan(admitted=(1,), prefill=(Chunk(1, 0, 100),)),
    ),
    "a long prompt's middle chunk, nobody admitted meanwhile": (
        [W(2, 5)], [R(1, 250, 100)], BUDGET, StepPlan(prefill=(Chunk(1, 100, 100),)),
    ),
    "a long prompt's last chunk stops before its last token": (
        [W(2, 5)], [R(1, 250, 200)], BUDGET, StepPlan(prefill=(Chunk(1, 200, 49),)),
    ),
    "a long prompt's last chunk, sampled from the prefill": (
        [W(2, 5)], [R(1, 250, 200)], SAMPLING, StepPlan(prefill=(Chunk(1, 200, 50),)),
    ),
    "decode and a new prefill in one step": (
        [W(2, 30)], [R(1, 20, 19)], BUDGET,
        StepPlan(admitted=(2,), prefill=(Chunk(2, 0, 29),), decode=(1,)),
    ),
    "decode beside a long prompt's chunk": (
        [], [R(1, 20, 19), R(2, 300, 100)], BUDGET,
        StepPlan(prefill=(Chunk(2, 100, 100),), decode=(1,)),
    ),
    "the token cap ends the group": (
        [W(1, 60), W(2, 60)], [], BUDGET, StepPlan(admitted=(1,), prefill=(Chunk(1, 0, 59),)),
    ),
    "prompts that fit the token cap together": (
        [W(1, 51), W(2, 51)], [], BUDGET,
        StepPlan(admitted=(1, 2), prefill=(Chunk(1, 0, 50), Chunk(2, 0, 50))),
    ),
    "FIFO: a short prompt does not overtake one that does not fit": (
        [W(1, 80), W(2, 90), W(3, 5)], [], BUDGET,
        StepPlan(admitted=(1,), prefill=(Chunk(1, 0, 79),)),
    ),
    "a prefix-cache hit shortens the prompt to its uncached rest": (
        [W(1, 200, cached=150), W(2, 40)], [], BUDGET,
        StepPlan(admitted=(1, 2), prefill=(Chunk(1, 150, 49), Chunk(2, 0, 39))),
    ),
    "a prompt cached but for its last token needs no prefill": (
        [W(1, 64, cached=63)], [], BUDGET, StepPlan(admitted=(1,)),
    ),
    "… unless the prefill samples: then its last token is the chunk": (
        [W(1, 64, cached=64)], [], SAMPLING, StepPlan(admitted=(1,), prefill=(Chunk(1, 63, 1),)),
    ),
    "a prefill just finished decodes the very next step, and a new group starts": (
        [W(3, 10)], [R(1, 10, 9), R(2, 20, 19)], BUDGET,
        StepPlan(admitted=(3,), prefill=(Chunk(3, 0, 9),), decode=(1, 2)),
    ),
    "a prefill sampled in the last step decodes the very next step": (
        [], [R(1, 10, 10)], SAMPLING, StepPlan(decode=(1,)),
    ),
    "a one-token prompt needs no prefill of its own": (
        [W(1, 1)], [], BUDGET, StepPlan(admitted=(1,)),
    ),
    "past max_queue the newest waiting are turned away": (
        [W(i, 10) for i in range(1, 13)], [], BUDGET,
        StepPlan(
            admitted=(1, 2), prefill=(Chunk(1, 0, 9), Chunk(2, 0, 9)), rejected=(11, 12)
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize(("waiting", "running", "budget", "expected"), CASES.values(), ids=CASES)
def test_schedule(
    waiting: list[Waiting], running: list[Running], budget: Budget, expected: StepPlan
) -> None:
    assert schedule(waiting, running, budget) == expected


def test_cancelling_a_waiting_request_lets_the_next_one_in() -> None:
    queue = [W(1, 90), W(2, 50), W(3, 40)]
    assert schedule(queue, [], BUDGET).admitted == (1,)
    del queue[0]  # cancelled while waiting: the caller drops it from its queue
    assert schedule(queue, [], BUDGET).admitted == (2, 3)


def test_cancelling_a_running_request_frees_its_row_and_its_chunk() -> None:
    running = [R(1, 5, 4), R(2, 5, 4), R(3, 5, 4), R(4, 300, 100)]
    plan = schedule([W(5, 10)], running, BUDGET)
    assert (plan.admitted, plan.prefill) == ((), (Chunk(4, 100, 100),))
    plan = schedule([W(5, 10)], running[:3], BUDGET)  # the long prompt was cancelled
    assert plan == StepPlan(admitted=(5,), prefill=(Chunk(5, 0, 9),), decode=(1, 2, 3))


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes() -> None:
    """Step by step, as the engine applies each plan: chunks never exceed the budget, a new
    group waits until the long prompt is done, and the prompt decodes right after."""
    queue = [W(1, 250), W(2, 30)]
    prompts = {w.id: w.prompt_tokens for w in queue}
    waiting, running, plans = list(queue), list[Running](), []
    for _ in range(5):
        plan = schedule(waiting, running, BUDGET)
        plans.append(plan)
        assert plan.prefill_tokens <= BUDGET.prefill_step_size
        waiting = [w for w in waiting if w.id not in plan.admitted]
        running += [R(i, prompts[i], 0) for i in plan.admitted]
        ends = {chunk.id: chunk.end for chunk in plan.prefill}
        running = [R(r.id, r.prompt_tokens, ends.get(r.id, r.computed_tokens)) for r in running]
    assert [p.prefill for p in plans] == [
        (Chunk(1, 0, 100),),
        (Chunk(1, 100, 100),),
        (Chunk(1, 200, 49),),
        (Chunk(2, 0, 29),),
        (),
    ]
    assert [p.decode for p in plans] == [(), (), (), (1,), (1, 2)]
    assert [p.admitted for p in plans] == [(1,), (), (), (2,), ()]
