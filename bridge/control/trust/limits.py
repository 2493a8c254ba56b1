"""Abuse limits of the controller: request rates, in-flight leases, token lifetime.

Workers are other people's machines (DESIGN.md, trust boundary), so none of them may take
more than its share of the controller, however it behaves:

- **Rates.** A token bucket per (worker id, endpoint) for every authenticated endpoint
  (`rate_limit_per_s` sustained, `rate_limit_burst` at once) and one per (client IP,
  "register") for registration, which is the one endpoint that creates rows without a
  token (`register_rate_per_s`, `register_burst`; a wrong join secret costs a token too,
  so guessing secrets is slow), and one per registering identity, a credential or a remote
  host, once the join secret has named it (`register_identity_rate_per_s`,
  `register_identity_burst`; the operator's own machine is exempt: identity.py). A request
  over its bucket is answered 429 with
  `Retry-After` (whole seconds, RFC 9110) and `retry_after_s` (exact) in the body, before
  any body is parsed or any lock taken, and counted in `fleet/rate_limited`.
  The defaults are 10x what an honest worker does at the demo's pace: it heartbeats every
  5 s, polls `/v1/lease` every `retry_after_s` = 0.5 s while there is no work, and
  submits once per lease. `ControllerClient` waits out a 429 and retries, so an honest
  client that bursts is slowed down, not failed.
- **In-flight leases.** A worker holding `max_leases_per_worker` active leases gets no
  new one (reason "lease_limit") until it submits or releases one; with
  `max_groups_per_lease` this bounds the groups one worker can sit on.
- **Token lifetime.** A token expires `token_ttl_s` after its worker's last contact with
  the controller (a heartbeat, lease or submission; heartbeats every
  `heartbeat_interval_s` keep a live worker's token alive forever), so a token of a worker
  that went away is dead after a while even if it leaked. Sliding rather than a fixed
  lifetime plus a refresh endpoint: the worker's existing heartbeat is the refresh, and no
  client has to track a deadline. An expired token gets 401 like a revoked one, and the
  worker's session (rollout_gpu/session.py) registers again.

Join-secret rotation is bridge/control/trust/join_secret.py.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable

# Bucket keys are (who, endpoint); any other path shares one bucket, so a client cannot
# grow the table by inventing paths.
ENDPOINTS = frozenset(
    """/v1/register /v1/heartbeat /v1/lease /v1/submit /v1/release /v1/leave /v1/version
    /v1/status""".split()
)


class RateLimiter:
    """Token buckets by key: `rate_per_s` refill, `burst` capacity; rate <= 0: no limit.

    Thread-safe (the service calls it from the event loop, tests from threads). A full
    bucket is the same as none, so the table is pruned of full ones when it grows past
    `max_keys`: memory stays bounded by the clients active within burst / rate seconds.
    """

    def __init__(
        self,
        rate_per_s: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 65536,
    ):
        self.rate, self.burst = float(rate_per_s), max(1.0, float(burst))
        self.clock, self.max_keys = clock, max_keys
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: Hashable, cost: float = 1.0) -> float:
        """Spend `cost` tokens of `key`'s bucket (at most a full one): 0.0 if it had them,
        else the seconds until it has (the request is refused and nothing is spent)."""
        if self.rate <= 0:
            return 0.0
        cost = min(float(cost), self.burst)
        with self._lock:
            now = self.clock()
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens < cost:
                self._buckets[key] = (tokens, now)
                return (cost - tokens) / self.rate
            self._buckets[key] = (tokens - cost, now)
            if len(self._buckets) > self.max_keys:
                self._prune(now)
            return 0.0

    def _prune(self, now: float) -> None:
        full = [
            k for k, (t, at) in self._buckets.items() if t + (now - at) * self.rate >= self.burst
        ]
        for k in full:
            del self._buckets[k]
        if len(self._buckets) > self.max_keys:  # a flood of fresh keys: forget the oldest
            for k in sorted(self._buckets, key=lambda k: self._buckets[k][1])[: self.max_keys // 2]:
                del self._buckets[k]


class Limits:
    """The service's rate limits, built from a `ControllerConfig`; `rate_limited` counts
    refused requests (in memory: a counter of abuse must not cost a database write)."""

    def __init__(self, config, clock: Callable[[], float] = time.monotonic):
        self.workers = RateLimiter(config.rate_limit_per_s, config.rate_limit_burst, clock)
        self.register = RateLimiter(config.register_rate_per_s, config.register_burst, clock)
        self.registrant = RateLimiter(
            config.register_identity_rate_per_s, config.register_identity_burst, clock
        )
        self.rate_limited = 0
        self.by_endpoint: dict[str, int] = {}

    def check(self, who: Hashable, path: str, registration: bool = False) -> float:
        """0.0 if `who` (a worker id; a client IP for registration) may call `path` now,
        else the seconds to wait (counted as rate limited)."""
        endpoint = path if path in ENDPOINTS else "other"
        limiter = self.register if registration else self.workers
        wait = limiter.take((who, endpoint))
        if wait > 0:
            self.rate_limited += 1  # racy under threads by at most a count: a metric
            self.by_endpoint[endpoint] = self.by_endpoint.get(endpoint, 0) + 1
        return wait

    def check_registrant(self, identity: str) -> float:
        """0.0 if `identity` (identity.py) may register one more worker now, else the
        seconds to wait (counted as rate limited). The caller exempts `local`."""
        wait = self.registrant.take(identity)
        if wait > 0:
            self.rate_limited += 1
            self.by_endpoint["/v1/register"] = self.by_endpoint.get("/v1/register", 0) + 1
        return wait

    def stats(self) -> dict:
        return {"fleet/rate_limited": self.rate_limited}


def retry_after_header(wait_s: float) -> str:
    """`Retry-After` takes whole seconds; round up so a client that obeys it succeeds."""
    return str(max(1, math.ceil(wait_s)))


def token_alive(last_seen: float, now: float, ttl_s: float) -> bool:
    """A token is alive while its worker was heard from within `ttl_s` (<= 0: forever)."""
    return ttl_s <= 0 or now - last_seen <= ttl_s
