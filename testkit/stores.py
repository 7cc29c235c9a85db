"""A storage (actors/runs/storage.py) with a test's hook before each write: a slow store (the hook waits on
an event), a hung one, a failing one (the hook raises), or one that dies between two writes."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class HookedStore:
    """Everything as `inner` does it, but `before_write(key, data)` runs first (it may block or raise)."""

    def __init__(self, inner: Any, before_write: Callable[[str, bytes], None]) -> None:
        self.inner, self.before_write = inner, before_write

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self, key: str, data: bytes) -> None:
        self.before_write(key, data)
        self.inner.write(key, data)


def failing(times: list[int], error: str = "AWS Error SERVICE_UNAVAILABLE during PutObject operation") -> Callable:
    """A hook that raises OSError(error) while `times[0]` > 0, counting it down (the test may raise it again)."""
    def hook(key: str, data: bytes) -> None:
        if times[0] > 0:
            times[0] -= 1
            raise OSError(error)
    return hook
