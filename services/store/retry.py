"""Retries with backoff for transient store errors (tenacity does the work)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from services.store.mongo import TRANSIENT_ERRORS

P = ParamSpec("P")
R = TypeVar("R")


def with_retries(fn: Callable[P, R]) -> Callable[P, R]:
    """Retry a store call on transient errors for up to 10 s (only for idempotent calls)."""
    wrapped = retry(
        retry=retry_if_exception_type(TRANSIENT_ERRORS),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        stop=stop_after_delay(10),
        reraise=True,
    )(fn)
    return wrapped
