"""Several sequences for one request (OpenAI's `n`, several prompts in one completion):
submitted together, read as one interleaved stream, cancelled together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from mlxd.api.generation import Completion, Part, collect, new_id, start
from mlxd.engines.base import Engine
from mlxd.registry.routes import ModelEntry
from mlxd.types import Finished, GenerationRequest

_END = object()


class Interleaved:
    """Several sequences' parsed parts as one stream of `(index, part)`, in arrival order.

    Each sequence is driven by its own task from the moment it is added, so that closing
    this stream (the client left, one sequence failed, a later submission was refused)
    can cancel every one of them in the engine: a sequence whose iterator was never
    started could not be cancelled."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = 0

    def add(self, parts: AsyncIterator[Part]) -> None:
        index = len(self._tasks)
        self._tasks.append(asyncio.create_task(self._pump(index, parts)))
        self._open += 1

    async def _pump(self, index: int, parts: AsyncIterator[Part]) -> None:
        try:
            async for part in parts:
                self._queue.put_nowait((index, part))
        except Exception as exc:  # delivered to the reader, who raises it
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, _END))

    def __aiter__(self) -> AsyncIterator[tuple[int, Part]]:
        return self._read()

    async def _read(self) -> AsyncIterator[tuple[int, Part]]:
        try:
            while self._open:
                index, item = await self._queue.get()
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
    entry: ModelEntry, engine: Engine, requests: list[GenerationRequest], *, parse: bool = True
) -> Interleaved:
    """Submit `requests` together (n > 1, several prompts): they join one batch, and equal
    prompts share their prefill through the prefix cache. If any submission is refused,
    those already submitted are cancelled before the error propagates."""
    streams = Interleaved()
    try:
        for request in requests:
            streams.add(await start(entry, engine, request, parse=parse))
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
