"""Which writes Kopf retries, and what event handlers do with a refused one.

Kopf retries change handlers (create/update/delete/resume), timers and daemons when they raise
`kopf.TemporaryError`; an `@kopf.on.event` handler's error is only logged. So writes in event handlers
are a fast path: a refusal is logged here, and the timer named in the log converges the object
(index says what is missing; the write is retried with the error's delay until it is accepted).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterator
from contextlib import contextmanager

import kopf

from gpuslice.kubehttp import ApiError
from gpuslice.logs import get
from gpuslice.operator.kube import error_message

log = get(__name__)


@contextmanager
def refusal_is_temporary(what: str, delay: float) -> Iterator[None]:
    """An API server refusal inside becomes a TemporaryError (with the server's message), which Kopf
    retries after `delay` in a timer or change handler."""
    try:
        yield
    except ApiError as exc:
        raise kopf.TemporaryError(f"{what}: {error_message(exc)}", delay=delay) from exc


async def fast_path(work: Awaitable[None], retried_by: str) -> None:
    try:
        await work
    except kopf.TemporaryError as exc:
        log.warning("write refused; retried by a timer", error=str(exc), retried_by=retried_by)
