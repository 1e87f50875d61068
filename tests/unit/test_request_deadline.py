"""`until`: a request's deadline over its event stream, and the cancel of a client that left."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from mlxd.api.common.event_flow import until
from mlxd.errors import RequestTimedOut
from mlxd.types import Delta, Event


class Stream:
    """An engine's stream: events as they are put, and whether its reader cancelled it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False

    async def events(self) -> AsyncGenerator[Event, None]:
        try:
            while True:
                yield await self.queue.get()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def test_a_cancel_that_arrives_with_an_event_ends_the_stream():
    # A client's disconnect cancels the task writing its response. When that cancel lands
    # between an event's arrival and the writer's wake-up, asyncio.wait_for (Python 3.11)
    # returned the event and dropped the cancel: the sequence ran on to max_tokens.
    async def scenario() -> None:
        stream = Stream()
        received: list[Event] = []

        async def writer() -> None:
            loop = asyncio.get_running_loop()
            async for event in until(loop.time() + 60, 60, stream.events()):
                received.append(event)

        task = asyncio.create_task(writer())
        for token in range(3):
            await asyncio.sleep(0)  # the writer waits for the next event
            stream.queue.put_nowait(Delta("x", [token]))
            await asyncio.sleep(0)  # the event is taken, the writer not yet woken
            if token == 1:
                task.cancel()
        await asyncio.wait([task], timeout=10)
        assert task.cancelled()
        assert stream.cancelled and len(received) <= 2

    asyncio.run(scenario())


def test_the_deadline_cancels_the_stream_and_times_the_request_out():
    async def scenario() -> None:
        stream = Stream()
        loop = asyncio.get_running_loop()
        events = until(loop.time() + 0.05, 0.05, stream.events())
        stream.queue.put_nowait(Delta("a", [1]))
        assert await anext(events) == Delta("a", [1])
        with pytest.raises(RequestTimedOut, match=r"request_timeout \(0.05s\)"):
            await anext(events)
        assert stream.cancelled

    asyncio.run(scenario())


def test_the_deadline_holds_for_a_reader_slower_than_the_stream():
    # Events always queued: each is taken without a wait, so only the deadline's own check
    # can end the request; the stream is closed (which cancels the sequence).
    async def scenario() -> None:
        closed = False

        async def busy() -> AsyncGenerator[Event, None]:
            nonlocal closed
            try:
                while True:
                    yield Delta("x", [0])
            finally:
                closed = True

        loop = asyncio.get_running_loop()
        events = until(loop.time() + 0.05, 0.05, busy())
        with pytest.raises(RequestTimedOut):
            async with asyncio.timeout(10):  # a generous bound: without the check, never
                async for _ in events:
                    await asyncio.sleep(0.01)  # the reader is slower than the stream
        await events.aclose()
        assert closed

    asyncio.run(scenario())
