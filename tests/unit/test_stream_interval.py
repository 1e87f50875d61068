"""stream_interval: runs of N tokens' deltas become one delta, whatever the dialect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from mlxd.api.common.event_flow import in_runs
from mlxd.types import Delta, Event, Finished, TokenLogprob


async def events(*items: Event) -> AsyncGenerator[Event, None]:
    for item in items:
        yield item


def runs(interval: int, *items: Event) -> list[Event]:
    async def read() -> list[Event]:
        return [event async for event in in_runs(interval, events(*items))]

    return asyncio.run(read())


def test_deltas_are_merged_in_runs_and_the_rest_goes_out_before_finished():
    done = Finished("stop", 3, 5)
    deltas = [Delta(c, [i]) for i, c in enumerate("abcde")]
    assert runs(2, *deltas, done) == [
        Delta("ab", [0, 1]),
        Delta("cd", [2, 3]),
        Delta("e", [4]),
        done,
    ]


def test_a_delta_of_several_tokens_counts_them_all():
    done = Finished("length", 1, 4)
    merged = runs(3, Delta("a", [1, 2]), Delta("b", [3]), Delta("c", [4]), done)
    assert merged == [Delta("ab", [1, 2, 3]), Delta("c", [4]), done]


def test_logprobs_are_kept_in_order():
    first, second = TokenLogprob("a", -0.1, []), TokenLogprob("b", -0.2, [])
    merged = runs(2, Delta("a", [1], [first]), Delta("b", [2], [second]), Finished("stop", 1, 2))
    assert merged[0] == Delta("ab", [1, 2], [first, second])
