"""Several sequences for one request (OpenAI's `n`, several prompts in one completion):
submitted together, read as one interleaved stream, cancelled together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from mlxd.api.common.generation import new_id, start
from mlxd.api.common.parts import Completion, Part, Parts, collect
from mlxd.api.middleware import ratelimit
from mlxd.control.routes import ModelEntry
from mlxd.runtime.engine import Engine
from mlxd.types import MAX_SEQUENCES, Finished, GenerationRequest, OverLimit

_END = object()
HANDOFF = 16  # parts between the sequences' tasks and the reader


class Interleaved:
    """Several sequences' parsed parts as one stream of `(index, part)`, in arrival order.

    Each sequence is driven by its own task from the moment it is added, so that closing
    this stream (the client left, one sequence failed, a later submission was refused)
    can cancel every one of them in the engine: a sequence whose iterator was never
    started could not be cancelled."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._first: dict[int, asyncio.Event] = {}
        self._open = 0
        self._reading = False
        self._taken = asyncio.Event()  # set whenever the reader takes a part

    def add(self, index: int, parts: Parts | AsyncGenerator[Part, None]) -> None:
        """Drive `parts` now; its parts come out tagged with `index`."""
        self._first[index] = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._pump(index, parts)))
        self._open += 1

    async def first_part(self, index: int) -> None:
        """Until sequence `index` produced its first part (its prompt is prefilled) or ended."""
        await self._first[index].wait()

    async def _pump(self, index: int, parts: Parts | AsyncGenerator[Part, None]) -> None:
        try:
            # Closed however the pump ends: a pump cancelled while held back (not inside
            # the engine's stream) must still cancel its sequence, at once.
            async with aclosing(parts):
                async for part in parts:
                    self._first[index].set()
                    self._queue.put_nowait((index, part))
                    await self._handed_over()
        except Exception as exc:  # delivered to the reader, who raises it
            self._queue.put_nowait((index, exc))
        finally:
            self._first[index].set()
            self._queue.put_nowait((index, _END))

    async def _handed_over(self) -> None:
        """Once the response is being read, wait while HANDOFF parts are unread: a reader
        that falls behind holds its sequences back, so their events wait in the engine's
        streams, where server.stream_backlog bounds them. Before that (submissions waiting
        for a leader's first part, see `start_many`) parts gather here: no reader is late."""
        while self._reading and self._queue.qsize() >= HANDOFF:
            self._taken.clear()
            await self._taken.wait()

    def __aiter__(self) -> AsyncIterator[tuple[int, Part]]:
        return self._read()

    async def _read(self) -> AsyncIterator[tuple[int, Part]]:
        self._reading = True
        try:
            while self._open:
                index, item = await self._queue.get()
                self._taken.set()
                if item is _END:
                    self._open -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel every sequence still running (a no-op once all have finished)."""
        # Two loop turns let a just-added task reach the engine's iterator (through the
        # request-timeout wrapper's own task), so its cancellation reaches the sequence.
        for _ in range(2):
            await asyncio.sleep(0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def start_many(
    entry: ModelEntry,
    engine: Engine,
    requests: list[GenerationRequest],
    *,
    per_prompt: int = 1,
    parse: bool = True,
) -> Interleaved:
    """Submit `requests`, of which each run of `per_prompt` shares one prompt (OpenAI's `n`).

    Different prompts go in together. Of one prompt's copies, the first goes first and the
    others once it has its first token: its prefill is then in the prefix cache, so theirs
    is a cache hit instead of the same prompt prefilled n times over (copies submitted
    together would each miss). Without a prefix cache they all go in together. If any
    submission is refused, those already submitted are cancelled before the error
    propagates."""
    if len(requests) > MAX_SEQUENCES:  # every dialect's fan-out (n, prompt lists) meets it here
        raise OverLimit(
            "n", f"n × prompts makes {len(requests)} sequences; at most {MAX_SEQUENCES}"
        )
    ratelimit.admit_more(len(requests) - 1)  # the HTTP request itself counted one
    streams = Interleaved()
    share = per_prompt > 1 and entry.config.cache.ram > 0
    leaders = range(0, len(requests), per_prompt) if share else range(len(requests))
    try:
        for index in leaders:
            streams.add(index, await start(entry, engine, requests[index], parse=parse))
        if share:
            for leader in leaders:
                await streams.first_part(leader)
                for index in range(leader + 1, min(leader + per_prompt, len(requests))):
                    streams.add(index, await start(entry, engine, requests[index], parse=parse))
    except BaseException:
        await streams.aclose()
        raise
    return streams


def copies(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """`n` sequences of one request (OpenAI's `n`), each with its own id and, when seeded,
    its own seed: n equal seeds would give n equal answers."""
    seed = generation.sampling.seed
    return [
        replace(
            generation,
            request_id=new_id(""),
            sampling=replace(
                generation.sampling, seed=None if seed is None else (seed + i) % 2**64
            ),
        )
        for i in range(n)
    ]


async def collect_all(streams: Interleaved, count: int) -> list[Completion]:
    """Each sequence's parts drained into its own result (non-streamed responses)."""
    parts: list[list[Part]] = [[] for _ in range(count)]
    async for index, part in streams:
        parts[index].append(part)
    return [await collect(replay(sequence)) for sequence in parts]


async def replay(parts: list[Part]) -> AsyncIterator[Part]:
    for part in parts:
        yield part


def total_usage(finished: list[Finished], per_prompt: int) -> dict[str, int]:
    """Usage of sequences submitted `per_prompt` to a prompt (n): each prompt counts once,
    every completion counts."""
    prompt = sum(f.prompt_tokens for f in finished[::per_prompt])
    completion = sum(f.completion_tokens for f in finished)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
