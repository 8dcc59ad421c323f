"""How soon a watch of the product's own client tries again after the API server went away: the
agents' ResourceSlices and the operator's pod views wait on it after an outage."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from gpuslice import kubehttp


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_watch_of_an_api_server_down_for_minutes_tries_again_within_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing listens on the port: every try is a real refused connection. The waits are recorded
    # instead of slept, so five minutes of outage take no time here.
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(delay: float, *args: Any) -> None:
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(kubehttp.asyncio, "sleep", recorded)
    client = kubehttp.Client(kubehttp.Config(f"http://127.0.0.1:{closed_port()}", False))
    watch = kubehttp.watch_forever(client, "/api/v1/pods")

    async def consume() -> None:
        async for _ in watch:
            pytest.fail("nothing to list: the server is down")

    task = asyncio.create_task(consume())
    while sum(waits) < 300:
        await real_sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.close()
    assert waits[0] <= 1.0  # the first failure is tried again at once
    # After minutes down, the next try is at most WATCH_RETRY_MAX_SECONDS away, and the waits are not
    # all equal (agents of many nodes do not come back in step).
    assert max(waits) <= kubehttp.WATCH_RETRY_MAX_SECONDS <= 10.0
    assert len(set(waits[-5:])) > 1
