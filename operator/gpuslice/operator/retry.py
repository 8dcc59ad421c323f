"""Which writes Kopf retries, and what event handlers do with a refused one.

Kopf retries change handlers (create/update/delete/resume), timers and daemons when they raise
`kopf.TemporaryError`; an `@kopf.on.event` handler's error is only logged. So writes in event handlers
are a fast path: a refusal is logged here, and the timer named in the log converges the object
(index says what is missing; the write is retried with the error's delay until it is accepted).
"""

from __future__ import annotations

from collections.abc import Awaitable

import kopf

from gpuslice.logs import get

log = get(__name__)


async def fast_path(work: Awaitable[None], retried_by: str) -> None:
    try:
        await work
    except kopf.TemporaryError as exc:
        log.warning("write refused; retried by a timer", error=str(exc), retried_by=retried_by)
