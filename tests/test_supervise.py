"""A relay's background loop that fails is restarted, and its log line carries the real traceback."""

from __future__ import annotations

import asyncio
import logging

import pytest

from outbox.relay.run_context import supervise


def test_a_failing_background_loop_is_logged_with_its_own_traceback(caplog: pytest.LogCaptureFixture):
    runs = 0

    async def flaky_loop() -> None:
        nonlocal runs
        runs += 1
        raise LookupError("the recoverer's query broke")

    async def main() -> None:
        task = asyncio.create_task(supervise("outbox-recoverer", flaky_loop, relay_id="r1"))
        while runs < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.ERROR, logger="outbox.relay"):
        asyncio.run(main())
    assert runs >= 2, "the loop was restarted after it failed"
    record = next(r for r in caplog.records if getattr(r, "action", None) == "task_restart")
    assert record.exc_info is not None and record.exc_info[0] is LookupError
    assert "the recoverer's query broke" in caplog.text and "NoneType: None" not in caplog.text
