"""Per-client rate limits: `server.rate_limit` (a client's requests to any model together) and
`models.<name>.rate_limit` (to that model), in requests and tokens per minute.

A client is its API key, or its address when the daemon is open (no keys configured). Windows
slide over the last 60 s. A request is admitted while the client is under every limit that
applies; its tokens (prompt + completion, known once it finishes) are charged afterwards, so
one request may overshoot a token limit and the next waits. Over a limit: 429 in the caller's
dialect with `Retry-After`; every limited response carries the OpenAI and Anthropic
`…ratelimit…` headers of the tightest limit. State is in memory: a restart forgets it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from quart import Quart, Response, g, request

from mlxd.api.common.context import current_app
from mlxd.api.common.dialect import requested_models
from mlxd.api.middleware.auth import OPEN_PATHS, presented_key
from mlxd.api.middleware.window import IdleSweep, Window
from mlxd.config.server import RateLimitConfig
from mlxd.errors import Overloaded


@dataclass
class Budget:
    """One client's use of one limit."""

    limit: RateLimitConfig
    requests: Window = field(default_factory=Window)
    tokens: Window = field(default_factory=Window)

    def idle(self, now: float) -> bool:
        return self.requests.idle(now) and self.tokens.idle(now)


@dataclass(frozen=True)
class Remaining:
    requests: tuple[int, int] | None  # (limit, remaining)
    tokens: tuple[int, int] | None


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._budgets: dict[tuple[str, str], Budget] = {}
        self._sweep = IdleSweep()

    @property
    def tracked(self) -> int:
        """How many (limit, client) budgets are held."""
        return len(self._budgets)

    def admit(
        self, client: str, limits: dict[str, RateLimitConfig], count: int = 1
    ) -> Callable[[int], None]:
        """Count `count` requests against each of `limits` ({scope: limit}) or raise
        Overloaded. Returns the function that charges their tokens when they are done."""
        now = self.clock()
        self._sweep(self._budgets, now, lambda budget: budget.idle(now))
        budgets = [self._budget(scope, client, limit) for scope, limit in limits.items()]
        for budget in budgets:
            budget.requests.prune(now)
            budget.tokens.prune(now)
            self._refuse_if_over(budget, now, count)
        for budget in budgets:
            budget.requests.add(now, count)

        def charge(tokens: int) -> None:
            # Looked up again: a request that ran past the window may find its budget swept.
            for scope, limit in limits.items():
                self._budget(scope, client, limit).tokens.add(self.clock(), tokens)

        return charge

    def remaining(self, client: str, limits: dict[str, RateLimitConfig]) -> Remaining:
        """The tightest limit's figures for the response headers."""
        requests = tokens = None
        for scope, limit in limits.items():
            budget = self._budget(scope, client, limit)
            if limit.requests_per_minute is not None:
                left = max(limit.requests_per_minute - budget.requests.total, 0)
                if requests is None or left < requests[1]:
                    requests = (limit.requests_per_minute, left)
            if limit.tokens_per_minute is not None:
                left = max(limit.tokens_per_minute - budget.tokens.total, 0)
                if tokens is None or left < tokens[1]:
                    tokens = (limit.tokens_per_minute, left)
        return Remaining(requests, tokens)

    def _budget(self, scope: str, client: str, limit: RateLimitConfig) -> Budget:
        budget = self._budgets.get((scope, client))
        if budget is None or budget.limit != limit:  # new, or the limit changed on reload
            budget = self._budgets[scope, client] = Budget(limit)
        return budget

    def _refuse_if_over(self, budget: Budget, now: float, count: int) -> None:
        rpm, tpm = budget.limit.requests_per_minute, budget.limit.tokens_per_minute
        if rpm is not None and budget.requests.total + count > rpm:
            wait, what = budget.requests.free_in(now, rpm), f"{rpm} requests"
        elif tpm is not None and budget.tokens.total >= tpm:
            wait, what = budget.tokens.free_in(now, tpm), f"{tpm} tokens"
        else:
            return
        retry = max(math.ceil(wait), 1)
        raise Overloaded(
            f"rate limit: at most {what} per minute; retry in {retry}s",
            headers={"Retry-After": str(retry)},
        )


def install(app: Quart) -> None:
    """After auth (which identifies the caller) and the request record (which learns the
    token counts): admit or refuse, charge tokens when the record closes, add headers."""
    limiter = app.extensions["mlxd_rate_limiter"] = RateLimiter()

    @app.before_request
    async def limit_rate() -> None:
        if request.path in OPEN_PATHS:
            return
        limits = await _limits()
        if not limits:
            return
        client = _client()
        g.rate_limits = (client, limits)
        try:
            charge = limiter.admit(client, limits)
        except Overloaded as exc:
            exc.headers = {**exc.headers, **_headers(limiter.remaining(client, limits))}
            raise
        record = g.get("record")
        if record is not None:
            record.on_close.append(lambda r: charge(r.prompt_tokens + r.completion_tokens))

    @app.after_request
    async def rate_limit_headers(response: Response) -> Response:
        if (limited := g.get("rate_limits")) is not None:
            response.headers.update(_headers(limiter.remaining(*limited)))
        return response


def admit_more(count: int) -> Callable[[int], None]:
    """Count `count` more requests for the current HTTP request, which runs several (OpenAI's
    `n` and prompt lists, batch items), to the same client and limits, or raise 429. Returns
    what charges their tokens, for work that finishes after this request's record closes."""
    limited = g.get("rate_limits")
    if limited is None or count <= 0:
        return lambda tokens: None
    limiter: RateLimiter = current_app.extensions["mlxd_rate_limiter"]
    client, limits = limited
    try:
        return limiter.admit(client, limits, count)
    except Overloaded as exc:
        exc.headers = {**exc.headers, **_headers(limiter.remaining(client, limits))}
        raise


async def _limits() -> dict[str, RateLimitConfig]:
    """{scope: limit} for this request: the server's, and each named model's own."""
    daemon = current_app.daemon
    found = [daemon.routes.name_of(model_id) for model_id in await requested_models()]
    names = [name for name in found if name is not None]
    if not names:
        return {}
    limits = {}
    if daemon.config.server.rate_limit is not None:
        limits["*"] = daemon.config.server.rate_limit
    for name in names:
        entry = daemon.routes.models.get(name)
        if entry is not None and entry.config.rate_limit is not None:
            limits[name] = entry.config.rate_limit
    return limits


def _client() -> str:
    """The API key the request presented, or the client's address when the daemon is open
    (any key passes then: counting by key would let a client pick a fresh one per request)."""
    daemon = current_app.daemon
    keyed = daemon.config.server.api_keys or any(
        entry.config.api_keys for entry in daemon.routes.models.values()
    )
    key = presented_key(request.headers)
    return f"key:{key}" if keyed and key else f"addr:{request.remote_addr}"


def _headers(remaining: Remaining) -> dict[str, str]:
    headers = {}
    for kind, figures in (("requests", remaining.requests), ("tokens", remaining.tokens)):
        if figures is None:
            continue
        limit, left = map(str, figures)
        headers[f"x-ratelimit-limit-{kind}"] = limit
        headers[f"x-ratelimit-remaining-{kind}"] = left
        headers[f"anthropic-ratelimit-{kind}-limit"] = limit
        headers[f"anthropic-ratelimit-{kind}-remaining"] = left
    return headers
