"""The config error classes, and the small field checks that raise them.

`ConfigError` is what a user sees: one line naming the key, the bad value and what is allowed. A
dataclass's `__post_init__` raises `FieldError` (it knows only its own field's name); the parser
(core/schema/parser.py) prefixes the key path and turns it into a `ConfigError`.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class OrchestratorError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(OrchestratorError):
    """Bad user input: a config key, a CLI argument or a YAML file. One line, names the key."""


class NameTaken(ConfigError):
    """A job is started under the name of one that has not positively ended (running, paused, slow to
    answer, or being restarted by Ray): refused, never replaced."""


class WorkloadRefused(OrchestratorError, ValueError):
    """The workload cannot be trained as configured (its data cannot be positioned, a policy cannot deal
    from it): the same in every worker, so a worker that raises it is not started again."""


class FieldError(ValueError):
    """Raised by a dataclass check; the parser prefixes the key path and turns it into ConfigError."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field_name = field_name
        self.message = message


def nearest(name: str, choices: Iterable[str]) -> str | None:
    """The choice closest to a misspelt `name` (difflib's ratio, case ignored), or None when none is close:
    what a one-line error suggests ("did you mean ...?")."""
    by_folded = {choice.lower(): choice for choice in choices}
    found = difflib.get_close_matches(name.lower(), list(by_folded), n=1, cutoff=0.6)
    return by_folded[found[0]] if found else None


def positive(obj: Any, name: str) -> None:
    if getattr(obj, name) <= 0:
        raise FieldError(name, f"must be positive, got {getattr(obj, name)}")


def at_least(obj: Any, name: str, low: int) -> None:
    if getattr(obj, name) < low:
        raise FieldError(name, f"must be at least {low}, got {getattr(obj, name)}")


DAY_S = 86400.0
"""The longest timeout, wait or interval a job's config may ask for: a collective, heartbeat, step or
sleep that long is a hang on any job this runs, and a longer one (1e300) overflows the waits it is
handed to (`timedelta`, `time.sleep`, gloo's millisecond count) in every worker instead of failing at load."""


def within(obj: Any, name: str, low: float, high: float, *, low_open: bool = False, unit: str = "") -> None:
    """`low <= value <= high` (`low < value` with `low_open`); NaN lies outside every range."""
    value = getattr(obj, name)
    if not ((low < value if low_open else low <= value) and value <= high):
        raise FieldError(name, f"must lie in {'(' if low_open else '['}{low:g}, {high:g}]{unit}, got {value:g}")
