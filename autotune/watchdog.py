"""Bound user code that runs in the tuner's own process (importing the model file, the check forward) by a deadline.

A model whose forward sleeps, loops or waits would otherwise hang the command forever. Two layers:

    deadline ──SIGALRM──▶ the handler raises inside the user's frame ──▶ HangError: the file, the call, its stack
    deadline + BACKSTOP_S ──▶ faulthandler dumps every thread's stack and exits 1 (code stuck in C never returns
                              to the interpreter, so no Python handler can run there)

The alarm needs the main thread; elsewhere only the backstop applies.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from autotune.errors import HangError

BACKSTOP_S = 15.0
"""After the deadline, how long the alarm gets to end the call before faulthandler ends the process."""
MODEL_CHECK = "the model check (import, make_batch, build_model, a 2-sample forward and loss_fn)"
"""What the tuner runs of the model file in its own process before any trial, as error messages name it."""
STACK_FRAMES = 6
"""Innermost frames quoted in the message."""


class _Expired(BaseException):
    """Raised by the alarm inside the user's code: a BaseException, so that the user's own `except Exception` (and
    autotune's) does not swallow it on its way out."""

    def __init__(self, frame: FrameType | None) -> None:
        super().__init__()
        self.stack = traceback.extract_stack(frame) if frame is not None else traceback.StackSummary()


@contextlib.contextmanager
def time_limit(seconds: float | None, *, path: Path, what: str, flag: str = "--timeout") -> Iterator[None]:
    """Run the body within `seconds` (None: unbounded). On expiry raise HangError naming `path`, `what` was running
    and where it hung (the innermost frame of `path`, and the stack), and the fix (`flag`)."""
    if seconds is None or seconds <= 0:
        yield
        return
    main = threading.current_thread() is threading.main_thread()
    previous: Any = None
    done = False
    if main:

        def expire(signum: int, frame: FrameType | None) -> None:
            if not done:  # an alarm that lands after the body returned is void
                raise _Expired(frame)

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:  # the process's own stderr: a captured one (pytest, CliRunner) may have no file descriptor
        faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True, file=sys.__stderr__ or sys.stderr)
    except (AttributeError, ValueError, OSError):
        pass  # no descriptor to write the stacks to: the alarm alone bounds the call
    try:
        yield
        done = True
    except _Expired as expired:
        raise HangError(_message(expired.stack, seconds, path, what, flag)) from None
    finally:
        done = True
        faulthandler.cancel_dump_traceback_later()
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def _message(stack: traceback.StackSummary, seconds: float, path: Path, what: str, flag: str) -> str:
    resolved = path.resolve()
    frames = [f for f in stack if Path(f.filename).name != Path(__file__).name]
    own = [f for f in frames if Path(f.filename).resolve() == resolved]
    hung = own[-1] if own else (frames[-1] if frames else None)
    where = f" at {path}:{hung.lineno} in {hung.name}()" if hung is not None else ""
    code = f" ({hung.line.strip()})" if hung is not None and hung.line else ""
    chain = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-STACK_FRAMES:]))
    return (
        f"{path}: {what} did not return within {seconds:g} s, hung{where}{code}; stack, innermost first: {chain}; "
        f"fix the hang in the model file, or pass {flag} with more seconds if it is only slow"
    )
