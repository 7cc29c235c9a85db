"""Calls into the workload's own code (its factory, its `loss` with the model's forward, its `evaluate`),
and what a mistake there becomes.

An exception raised there, or a value it returns that the workload contract refuses (a loss that is not
a scalar, a metric that is not a number), leaves as a `WorkloadBug` carrying a `WorkloadFault`
(algorithms/rules/supervision.py): the error in one line, the user's file and line, the full traceback
and the step. The user's file and line is the innermost frame of the traceback in the workload's own
code: not this project's modules (its example workloads, `orchestrator/workloads/`, are workload code),
not the standard library, not an installed library such as torch. An exception that comes from this
project's code under the call (a policy's hook on the model) is not the workload's, and leaves as it came.
The coordinator decides from the fault whether the workload is at fault (`workload_bug`).
"""
from __future__ import annotations

import contextlib
import inspect
import numbers
import site
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from algorithms.rules.supervision import WorkloadFault

_ROOT = Path(__file__).resolve().parents[2]
_OURS = tuple(str(_ROOT / package) + "/" for package in ("actors", "algorithms", "core", "orchestrator", "testkit"))
_WORKLOADS = str(_ROOT / "orchestrator" / "workloads") + "/"
_LIBRARIES = tuple(sorted({str(Path(p).resolve()) + "/" for p in (
    *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
    *site.getsitepackages(), site.getusersitepackages())}))


class WorkloadBug(Exception):
    """The workload's own code failed (`fault` says how); the coordinator takes it from the worker's outcome."""

    def __init__(self, fault: WorkloadFault) -> None:
        super().__init__(fault.line)
        self.fault = fault

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by Ray from the worker to the coordinator
        return WorkloadBug, (self.fault,)


def call(kind: str, fn: Callable[..., Any], *args: Any, step: int | None = None, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, the workload's `kind` ("factory", "loss", "evaluate"); what it raises leaves
    as a WorkloadBug unless this project's code under it raised (see the module's docstring)."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # any exception of the user's code is reported as theirs
        where = _user_frame(err, fn)
        if where is None:
            raise
        raise WorkloadBug(WorkloadFault(kind, type(err).__name__, _first_line(err), where,
                                        "".join(traceback.format_exception(err)), step)) from err


@contextlib.contextmanager
def contract(kind: str, fn: Callable[..., Any], step: int | None) -> Iterator[None]:
    """Checks of what `fn` (the workload's `kind`) returned: a TypeError or ValueError raised inside, one line
    saying what is wrong, leaves as a WorkloadBug that names where `fn` is defined (no traceback: its
    frames would be the check's, not the user's)."""
    try:
        yield
    except (TypeError, ValueError) as err:
        raise WorkloadBug(WorkloadFault(kind, "", _first_line(err), defined_at(fn), "", step)) from err


def require_scalar(loss: Any) -> None:
    """TypeError unless the loss is a tensor of one element (what a backward pass starts from)."""
    import torch

    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"workload.loss returned a {type(loss).__name__}, not a tensor: return the loss as a "
                        f"scalar tensor computed from the model's output")
    if loss.numel() != 1:
        raise TypeError(f"workload.loss returned a tensor of shape {tuple(loss.shape)}, not a scalar: reduce it "
                        f"(e.g. .mean())")


def metrics_of(evaluate: Callable[..., Any], model: Any, data: Any, step: int | None) -> dict[str, float]:
    """`evaluate(model, data)` as {name: number}; a WorkloadBug for what it raises or a value that is not a number."""
    returned = call("evaluate", evaluate, model, data, step=step)
    with contract("evaluate", evaluate, step):
        if not isinstance(returned, Mapping):
            raise TypeError(f"evaluate returned a {type(returned).__name__}, not a dict of metric names to numbers")
        return {str(name): _number(name, value) for name, value in returned.items()}


def _number(name: Any, value: Any) -> float:
    """A metric's value as a float: a real number, or a tensor or array of one element (not a string,
    which float() would parse)."""
    if isinstance(value, numbers.Real):
        return float(value)
    size = getattr(value, "numel", None) or getattr(value, "size", None)
    count = size() if callable(size) else size
    if count == 1 and not isinstance(value, (str, bytes)):
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    raise TypeError(f"evaluate returned metric {name!r} = {value!r:.60} ({type(value).__name__}): metrics must be numbers")


def defined_at(fn: Callable[..., Any]) -> str:
    """`file:line` where `fn` (a function, a bound method, a callable object) is defined; "" if unknown."""
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    if not (inspect.isfunction(target) or inspect.isclass(target)):
        target = type(target)
    try:
        file = inspect.getsourcefile(target) or inspect.getfile(target)
        line = inspect.getsourcelines(target)[1]
    except (OSError, TypeError):
        return ""
    return f"{file}:{line}"


def _user_frame(err: BaseException, fn: Callable[..., Any]) -> str | None:
    """`file:line` of the innermost frame under the call that is the workload's code; where the innermost
    of ours or the workload's is this project's, None (not the workload's); where no frame under the
    call is either (it raised in a library it called directly, or at the call: its arguments), where `fn`
    is defined."""
    frames = traceback.extract_tb(err.__traceback__)[1:]  # the first is `call`'s own
    for frame in reversed(frames):
        kind = _owner(frame.filename)
        if kind == "user":
            return f"{frame.filename}:{frame.lineno}"
        if kind == "ours":
            return None
    return defined_at(fn)


def _owner(filename: str) -> str:
    """Whose code a frame's file is: "ours" (this project's), "library" (the standard library, an installed
    package, Python's own "<frozen ...>") or "user" (the workload's)."""
    if filename.startswith("<"):
        return "library"
    path = str(Path(filename).resolve())
    if path.startswith(_WORKLOADS):
        return "user"
    if path.startswith(_OURS):
        return "ours"
    return "library" if path.startswith(_LIBRARIES) else "user"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:500]
