"""Rank 0's step commands to every rank, over the group's own mx.distributed link.

Every rank must make the same BatchGenerator calls in the same order, or their collective ops
(tensor parallel all_sum, pipeline send/recv) pair up wrongly and hang. Rank 0 alone talks to
the daemon; once per step it broadcasts what happened (new sequences with their prompt ids and
sampling, aborts) and every rank applies it.

MLX has no broadcast op, so this is an all_sum in which only rank 0 contributes: first the
payload's length, then its bytes as uint8 (the other ranks add zeros). Two collectives per
step, whatever the payload; on the CPU ring backend each costs a round of the ring.
"""

from __future__ import annotations

import pickle
from typing import Any, TypeVar

import mlx.core as mx

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


def broadcast_bytes(data: bytes | None, group: mx.distributed.Group | None = None) -> bytes:
    """Rank 0's `data` on every rank (the others pass None). Every rank must call it."""
    group = group_or_world(group)
    if group.size() == 1:
        return data or b""
    leader = group.rank() == 0
    if leader and data is None:
        raise ValueError("rank 0 must pass the bytes to broadcast")
    # The CPU backend runs collectives on its own stream; pin them there so a caller inside
    # `with mx.stream(gpu)` (Metal) still works.
    with mx.stream(mx.cpu):
        length = mx.array([len(data) if leader else 0], dtype=mx.int64)
        length = int(mx.distributed.all_sum(length, group=group).item())
        if length == 0:
            return b""
        if leader:
            payload = mx.array(memoryview(data), dtype=mx.uint8)  # type: ignore[arg-type]
        else:
            payload = mx.zeros((length,), dtype=mx.uint8)
        payload = mx.distributed.all_sum(payload, group=group)
        mx.eval(payload)
    return bytes(memoryview(payload))


def broadcast_object(obj: T | None, group: mx.distributed.Group | None = None) -> T:
    """Rank 0's picklable `obj` on every rank (the others pass None). Every rank must call
    it, in the same order. Only for ranks of one trusted group: this unpickles what rank 0
    sent."""
    group = group_or_world(group)
    if group.size() == 1:
        return obj  # type: ignore[return-value]
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if group.rank() == 0 else None
    result: Any = pickle.loads(broadcast_bytes(data, group))
    return result
