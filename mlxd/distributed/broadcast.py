"""Rank 0's step commands to every rank, over the group's own mx.distributed link.

Every rank must make the same BatchGenerator calls in the same order, or their collective ops
(tensor parallel all_sum, pipeline send/recv) pair up wrongly and hang. Rank 0 alone talks to
the daemon; once per step it broadcasts what happened (new sequences with their prompt ids and
sampling, aborts) and every rank applies it.

MLX has no broadcast op, so this is an all_sum in which only rank 0 contributes: first the
payload's length, then its bytes as uint8 (the other ranks add zeros). Two collectives per
step, whatever the payload; on the CPU ring backend each costs a round of the ring.

The broadcast must run on the stream the model's own collectives run on (the BatchGenerator's
`stream`). BatchGenerator evaluates step t+1 asynchronously before returning step t; on
another stream the broadcast's all_sum could overlap step t+1's all_sums in a different order
on different ranks, and the bytes arrive mixed with hidden states (seen here: unpickling
garbage on the second step). mlx_lm.server shares one stream for the same reason.
"""

from __future__ import annotations

import os
import pickle
from typing import TYPE_CHECKING, Any, TypeVar, cast

import mlx.core as mx
from mlx_lm.generate import generation_stream

if TYPE_CHECKING:
    from typing_extensions import Buffer

T = TypeVar("T")


def group_or_world(group: mx.distributed.Group | None = None) -> mx.distributed.Group:
    """`group`, or the world group of this process (size 1 when not launched by mlx.launch)."""
    return group if group is not None else mx.distributed.init()


def rank(group: mx.distributed.Group | None = None) -> int:
    return group_or_world(group).rank()


def size(group: mx.distributed.Group | None = None) -> int:
    return group_or_world(group).size()


def is_leader(group: mx.distributed.Group | None = None) -> bool:
    """Whether this process is rank 0: the one that talks to the daemon."""
    return rank(group) == 0


def broadcast_bytes(
    data: bytes | None,
    group: mx.distributed.Group | None = None,
    *,
    stream: mx.Stream | None = None,
) -> bytes:
    """Rank 0's `data` on every rank (the others pass None). Every rank must call it, on the
    stream its model computes on (`stream`, default mlx-lm's generation stream)."""
    group = group_or_world(group)
    if group.size() == 1:
        return data or b""
    leader = group.rank() == 0
    if not leader:
        own = b""  # the other ranks contribute zeros
    elif data is None:
        raise ValueError("rank 0 must pass the bytes to broadcast")
    else:
        own = data
    with mx.stream(stream if stream is not None else generation_stream):
        sent = mx.array([len(own)], dtype=mx.int64)
        length = mx.distributed.all_sum(sent, group=group).item()
        assert isinstance(length, int)  # item() is typed as any scalar; int64 gives an int
        if length == 0:
            return b""
        if leader:
            # mx.array reads any buffer; its stub does not list the buffer protocol.
            payload = mx.array(cast(Any, memoryview(own)), dtype=mx.uint8)
        else:
            payload = mx.zeros((length,), dtype=mx.uint8)
        payload = mx.distributed.all_sum(payload, group=group)
        mx.eval(payload)
    # mx.array has the buffer protocol; its stub does not declare it.
    return bytes(memoryview(cast("Buffer", payload)))


def broadcast_object(
    obj: T | None,
    group: mx.distributed.Group | None = None,
    *,
    stream: mx.Stream | None = None,
) -> T:
    """Rank 0's picklable `obj` on every rank (the others pass None). Every rank must call
    it, in the same order, on its model's stream (see broadcast_bytes). Only for ranks of one
    trusted group: this unpickles what rank 0 sent."""
    group = group_or_world(group)
    if group.size() == 1:
        return obj  # type: ignore[return-value]
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if group.rank() == 0 else None
    result: Any = pickle.loads(broadcast_bytes(data, group, stream=stream))
    return result


def shared_seed(
    group: mx.distributed.Group | None = None, *, stream: mx.Stream | None = None
) -> int:
    """Rank 0's random seed, for every rank to `mx.random.seed` with: samplers at temperature
    > 0 must draw the same numbers on every rank or the ranks pick different tokens."""
    seed = int.from_bytes(os.urandom(8), "little") if is_leader(group) else None
    return broadcast_object(seed, group, stream=stream)


def gather_object(
    obj: T, group: mx.distributed.Group | None = None, *, stream: mx.Stream | None = None
) -> list[T]:
    """Every rank's picklable `obj`, in rank order, on every rank (e.g. each rank's pid for
    rank 0 to report). Every rank must call it, in the same order as its other collectives."""
    group = group_or_world(group)
    if group.size() == 1:
        return [obj]
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    with mx.stream(stream if stream is not None else generation_stream):
        sizes = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int64), group=group)
        lengths = cast(list[int], sizes.tolist())
        width = max(lengths)
        # all_gather needs equal shapes: every rank pads its bytes to the longest.
        own = mx.array(cast(Any, memoryview(data + bytes(width - len(data)))), dtype=mx.uint8)
        stacked = mx.distributed.all_gather(own, group=group)
        mx.eval(stacked)
    raw = bytes(memoryview(cast("Buffer", stacked)))
    return [pickle.loads(raw[i * width : i * width + n]) for i, n in enumerate(lengths)]
