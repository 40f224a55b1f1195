"""Per-API-key rate limits and token quotas on the public endpoint.

Each client key has its own token bucket for requests (``--rate-limit-rps`` refilled per second,
``--rate-limit-burst`` at most) and its own completion-token quota (``--token-quota`` tokens per
``--quota-window-s``, charged the request's ``max_tokens`` when it is admitted, so a quota bounds
what a key can make the fleet compute). Over either limit the client gets 429 in the OpenAI error
shape with ``Retry-After``: ``rate_limit_exceeded`` for the rate, ``insufficient_quota`` for the
quota. Without API keys every client shares the one anonymous allowance.

Keys are held as SHA-256 digests, never as text, so nothing here can leak one into a log.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.coordinator.errors import ApiError, too_many_requests
from shared.log import get_logger

log = get_logger("coordinator.ratelimit")
#: most keys tracked at once; the least recently seen are forgotten first (they start afresh)
MAX_KEYS = 100_000


@dataclass
class _Allowance:
    tokens: float  # request bucket level
    refilled_at: float
    window_start: float
    used: int = 0  # completion tokens charged in the current quota window


class RateLimiter:
    """Request rate and token quota per client key; 0 switches a limit off."""

    def __init__(self, rps: float = 0.0, burst: int = 0, token_quota: int = 0, quota_window_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rps < 0 or burst < 0 or token_quota < 0 or quota_window_s <= 0:
            raise ValueError("rate limits must be >= 0 and the quota window > 0")
        self.rps = rps
        self.burst = float(burst or max(1, math.ceil(rps)))
        self.token_quota = token_quota
        self.quota_window_s = quota_window_s
        self._clock = clock
        self._keys: dict[str, _Allowance] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.rps or self.token_quota)

    def _allowance(self, key: str) -> _Allowance:
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = self._clock()
        entry = self._keys.pop(digest, None)
        if entry is None:
            if len(self._keys) >= MAX_KEYS:
                self._keys.pop(next(iter(self._keys)))
            entry = _Allowance(self.burst, now, now)
        self._keys[digest] = entry  # most recently seen last
        return entry

    def admit(self, key: str) -> None:
        """Take one request from ``key``'s bucket, or raise 429 rate_limit_exceeded."""
        if not self.rps:
            return
        entry = self._allowance(key)
        now = self._clock()
        entry.tokens = min(self.burst, entry.tokens + (now - entry.refilled_at) * self.rps)
        entry.refilled_at = now
        if entry.tokens < 1.0:
            wait = max(1, math.ceil((1.0 - entry.tokens) / self.rps))
            log.info("request refused: rate limit", rps=self.rps, burst=self.burst)
            raise too_many_requests(
                f"Rate limit reached for this API key: {self.rps:g} requests per second (bursts of "
                f"{self.burst:g}). Retry after {wait} s, or ask the operator to raise --rate-limit-rps.", wait)
        entry.tokens -= 1.0

    def charge(self, key: str, max_tokens: int) -> None:
        """Charge ``max_tokens`` to ``key``'s quota, or raise 429 insufficient_quota (nothing charged)."""
        if not self.token_quota:
            return
        entry = self._allowance(key)
        now = self._clock()
        if now - entry.window_start >= self.quota_window_s:
            entry.window_start, entry.used = now, 0
        if entry.used + max_tokens > self.token_quota:
            wait = max(1, math.ceil(entry.window_start + self.quota_window_s - now))
            left = self.token_quota - entry.used
            log.info("request refused: token quota", quota=self.token_quota, window_s=self.quota_window_s)
            raise ApiError(
                429,
                f"This API key's token quota is spent: {self.token_quota} completion tokens per "
                f"{self.quota_window_s:g} s, {left} left, and this request asks for up to {max_tokens} "
                f"(max_tokens). Ask for fewer tokens, retry after {wait} s, or ask the operator to raise "
                "--token-quota.",
                "insufficient_quota", None, "insufficient_quota", retry_after=wait)
        entry.used += max_tokens

    def refund(self, key: str, max_tokens: int) -> None:
        """Give back a charge for a request that was refused before any work was done."""
        if self.token_quota:
            entry = self._allowance(key)
            entry.used = max(0, entry.used - max_tokens)
