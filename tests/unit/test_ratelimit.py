"""The sliding-minute rate limiter, on a clock the test moves."""

from __future__ import annotations

import pytest

from mlxd.api.middleware.ratelimit import RateLimiter, Remaining
from mlxd.config.server import RateLimitConfig
from mlxd.errors import Overloaded


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_slide_and_say_when_to_retry():
    clock, limit = Clock(), {"*": RateLimitConfig(requests_per_minute=2)}
    limiter = RateLimiter(clock)
    limiter.admit("a", limit)
    clock.now += 10
    limiter.admit("a", limit)
    assert limiter.remaining("a", limit) == Remaining(requests=(2, 0), tokens=None)
    with pytest.raises(Overloaded) as caught:
        limiter.admit("a", limit)
    assert caught.value.status == 429
    assert caught.value.headers["Retry-After"] == "50"  # the first request leaves at +60 s
    limiter.admit("b", limit)  # another client has its own budget
    clock.now += 50
    limiter.admit("a", limit)


def test_tokens_are_charged_when_the_request_is_done():
    clock, limit = Clock(), {"smol": RateLimitConfig(tokens_per_minute=100)}
    limiter = RateLimiter(clock)
    charge = limiter.admit("a", limit)
    limiter.admit("a", limit)  # the first one's tokens are not known yet
    charge(150)  # one request may overshoot; the next waits
    assert limiter.remaining("a", limit).tokens == (100, 0)
    with pytest.raises(Overloaded, match="100 tokens"):
        limiter.admit("a", limit)
    clock.now += 60
    limiter.admit("a", limit)


def test_the_tightest_of_several_limits_is_reported_and_enforced():
    limits = {
        "*": RateLimitConfig(requests_per_minute=10),
        "smol": RateLimitConfig(requests_per_minute=1),
    }
    limiter = RateLimiter(Clock())
    limiter.admit("a", limits)
    assert limiter.remaining("a", limits).requests == (1, 0)
    with pytest.raises(Overloaded):
        limiter.admit("a", limits)
    # The refused request was not counted against the server-wide limit.
    assert limiter.remaining("a", {"*": limits["*"]}).requests == (10, 9)


def test_idle_clients_are_forgotten_and_late_tokens_still_count():
    clock, limit = Clock(), {"*": RateLimitConfig(tokens_per_minute=100)}
    limiter = RateLimiter(clock)
    for client in range(1000):  # a stream of fresh addresses
        limiter.admit(f"addr:{client}", limit)
    long_running = limiter.admit("a", limit)
    assert limiter.tracked == 1001
    clock.now += 61
    limiter.admit("b", limit)
    assert limiter.tracked == 1  # only b's
    long_running(150)  # finished after its budget was swept: charged all the same
    with pytest.raises(Overloaded):
        limiter.admit("a", limit)
