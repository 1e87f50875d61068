"""Several sequences of one request: interleaved, and cancelled together."""

from __future__ import annotations

import asyncio

import pytest

from mlxd.api.common.sequences import Interleaved, copies, total_usage
from mlxd.errors import MlxdError
from mlxd.types import Finished, GenerationRequest, SamplingParams


def _sequence(name: str, log: list[str], *, fail_after: int | None = None, length: int = 3):
    async def parts():
        try:
            for i in range(length):
                await asyncio.sleep(0.01)
                if fail_after is not None and i == fail_after:
                    raise MlxdError(f"{name} failed")
                yield f"{name}{i}"
            yield Finished("stop", 5, length)
        finally:
            log.append(f"{name} closed")

    return parts()


def test_parts_arrive_tagged_with_their_sequence():
    async def run():
        log: list[str] = []
        streams = Interleaved()
        for index, name in enumerate("ab"):
            streams.add(index, _sequence(name, log))
        return [item async for item in streams], log

    items, log = asyncio.run(run())
    assert [p for i, p in items if i == 0][:3] == ["a0", "a1", "a2"]
    assert [p for i, p in items if i == 1][:3] == ["b0", "b1", "b2"]
    assert sorted(log) == ["a closed", "b closed"]


def test_one_failure_cancels_the_others():
    async def run():
        log: list[str] = []
        streams = Interleaved()
        streams.add(0, _sequence("long", log, length=1000))
        streams.add(1, _sequence("bad", log, fail_after=1))
        with pytest.raises(MlxdError, match="bad failed"):
            async for _ in streams:
                pass
        return log

    assert sorted(asyncio.run(run())) == ["bad closed", "long closed"]


def test_closing_before_reading_cancels_every_sequence():
    async def run():
        log: list[str] = []
        streams = Interleaved()
        for index, name in enumerate("xyz"):
            streams.add(index, _sequence(name, log, length=1000))
        await streams.aclose()  # e.g. a later submission was refused
        return log

    assert sorted(asyncio.run(run())) == ["x closed", "y closed", "z closed"]


def test_copies_get_their_own_ids_and_seeds():
    request = GenerationRequest("r", "m", 8, SamplingParams(seed=2**64 - 1))
    made = copies(request, 3)
    assert len({c.request_id for c in made}) == 3
    assert [c.sampling.seed for c in made] == [2**64 - 1, 0, 1]
    assert all(c.sampling.seed is None for c in copies(GenerationRequest("r", "m", 8), 2))


def test_usage_counts_each_prompt_once():
    # n=2 of one 10-token prompt: the prompt once, both completions.
    finished = [Finished("stop", 10, 3), Finished("stop", 10, 4), Finished("stop", 6, 5)]
    assert total_usage(finished[:2], 2) == {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
    }
    # Three prompts, n=1 each: every prompt counts.
    assert total_usage(finished, 1)["prompt_tokens"] == 26


def counting(produced: list[int], count: int = 200):
    async def parts():
        for i in range(count):
            produced.append(i)
            yield f"p{i}"

    return parts()


def test_parts_gather_unbounded_until_the_reader_starts():
    # start_many waits for a leader's first part before it returns the stream to be read:
    # meanwhile the leader must not be held back (its events would pile up in the engine).
    produced: list[int] = []

    async def run():
        streams = Interleaved()
        streams.add(0, counting(produced))
        for _ in range(300):
            await asyncio.sleep(0)
        gathered = len(produced)
        return gathered, [item async for item in streams]

    gathered, items = asyncio.run(run())
    assert gathered == 200 and len(items) == 200


def test_a_stalled_reader_holds_its_sequences_back():
    from mlxd.api.common.sequences import HANDOFF

    produced: list[int] = []

    async def run():
        streams = Interleaved()
        reader = aiter(streams)
        streams.add(0, counting(produced))
        await anext(reader)  # reading, then stalled
        for _ in range(300):
            await asyncio.sleep(0)
        held = len(produced)
        return held, [item async for item in reader]

    held, rest = asyncio.run(run())
    assert held <= HANDOFF + 2  # what the reader took, HANDOFF unread, one in flight
    assert len(rest) == 199
