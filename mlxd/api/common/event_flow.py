"""Wrappers around an engine's event stream on its way to the parsers: the request's
deadline, and runs of `stream_interval` tokens merged into one delta."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from mlxd.errors import RequestTimedOut
from mlxd.types import Delta, Event, Finished


async def until(
    deadline: float, timeout: float, events: AsyncGenerator[Event, None]
) -> AsyncGenerator[Event, None]:
    """`events` until `deadline`; then the sequence is cancelled (its slot freed) and the
    request fails with 408 (an error event once a stream has started)."""
    loop = asyncio.get_running_loop()
    timed_out = RequestTimedOut(
        f"request did not finish within server.request_timeout ({timeout:g}s)"
    )
    try:
        while True:
            # A reader slower than decoding finds events queued, and a queued event is taken
            # without a wait the timeout could cancel: the deadline is checked first (closing
            # `events` below cancels the sequence).
            if loop.time() >= deadline:
                raise timed_out
            try:
                # Timing out cancels the wait inside the engine's stream, which cancels the
                # sequence. Not asyncio.wait_for: on Python 3.11 it drops a cancel (a client
                # that left) landing as an event arrives, and the sequence runs on.
                async with asyncio.timeout_at(deadline):
                    event = await anext(events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise timed_out from None
            yield event
    finally:
        await events.aclose()


async def in_runs(
    interval: int, events: AsyncGenerator[Event, None]
) -> AsyncGenerator[Event, None]:
    """`events` with each run of `interval` tokens' deltas merged into one (stream_interval):
    fewer, bigger chunks in every dialect. What is pending goes out before the Finished."""
    pending: list[Delta] = []
    tokens = 0
    try:
        async for event in events:
            if isinstance(event, Delta):
                pending.append(event)
                tokens += len(event.token_ids)
                if tokens < interval:
                    continue
            if pending:
                yield _merged(pending)
                pending, tokens = [], 0
            if isinstance(event, Finished):
                yield event
    finally:
        await events.aclose()


def _merged(deltas: list[Delta]) -> Delta:
    if len(deltas) == 1:
        return deltas[0]
    logprobs = [item for d in deltas for item in d.logprobs or []]
    return Delta(
        "".join(d.text for d in deltas),
        [t for d in deltas for t in d.token_ids],
        logprobs if any(d.logprobs for d in deltas) else None,
    )
