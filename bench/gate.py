"""Worker processes started first and told GO together: the peers' timing barrier.

A peer worker is timed from GO to the last process's exit, so start-up
(interpreter, imports, connecting) stays out of the figure while the exit,
which in drain mode is the proof that the queue is empty, stays in. Each
child announces it is ready by creating a file and then blocks reading its
stdin; the parent writes ``go`` to every child and closes the pipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .harness import REPO_ROOT
from .verify import Unverified

__all__ = ["READY_ENV", "GatedProcess", "gated", "run_gated", "wait_for_go", "wait_ready"]

#: The environment variable naming the file a child creates once it is ready for GO.
READY_ENV = "BENCH_READY_FILE"


def wait_for_go() -> None:
    """In the child: say ready, then block until the parent says GO (or closes stdin)."""
    Path(os.environ[READY_ENV]).touch()
    sys.stdin.readline()


class GatedProcess:
    """One child process, its output in a log file, held at the barrier until :meth:`go`."""

    def __init__(self, command: Sequence[str], *, workdir: Path, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.ready_path = workdir / f"{name}.ready"
        self.log_path = workdir / f"{name}.log"
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "BENCH_", "PG"))}
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), environ.get("PYTHONPATH")) if p)
        environ[READY_ENV] = str(self.ready_path)
        environ.update(env)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                list(command),
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environ,
                cwd=workdir,
            )

    def ready(self) -> bool:
        return self.ready_path.exists()

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, lines: int = 15) -> str:
        body = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return f"--- {self.name} (pid {self.proc.pid}) log tail:\n{body}"


@contextmanager
def gated(
    commands: Sequence[Sequence[str]], *, workdir: Path, envs: Sequence[dict[str, str]]
) -> Iterator[list[GatedProcess]]:
    """Start one child per command, each with its own environment; kill any left at the end."""
    procs: list[GatedProcess] = []
    try:
        for i, (command, env) in enumerate(zip(commands, envs, strict=True)):
            procs.append(GatedProcess(command, workdir=workdir, name=f"worker{i + 1}", env=env))
        yield procs
    finally:
        for proc in procs:
            proc.kill()


def wait_ready(procs: Sequence[GatedProcess], *, timeout: float = 60.0) -> None:
    """Until every child is ready for GO; one that exits first, or a wait past ``timeout``, is unverified."""
    deadline = time.monotonic() + timeout
    while not all(p.ready() for p in procs):
        dead = [p for p in procs if p.proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = "a worker exited" if dead else f"timed out after {timeout:g}s"
            raise Unverified(f"{why} before GO\n" + "\n".join(p.tail() for p in procs))
        time.sleep(0.02)


def run_gated(procs: Sequence[GatedProcess], *, timeout: float, ready_timeout: float = 60.0) -> float:
    """Wait until every child is ready, say GO, wait for every exit; seconds from GO to the last exit.

    A child that exits before GO or with a non-zero code, or that outlives
    ``timeout``, makes the run unverified.
    """
    wait_ready(procs, timeout=ready_timeout)
    began = time.perf_counter()
    for proc in procs:
        proc.go()
    for proc in procs:
        remaining = max(0.1, timeout - (time.perf_counter() - began))
        try:
            proc.proc.wait(remaining)
        except subprocess.TimeoutExpired:
            raise Unverified(
                f"{proc.name} still running {timeout:g}s after GO\n" + "\n".join(p.tail() for p in procs)
            ) from None
    seconds = time.perf_counter() - began
    failed = [p for p in procs if p.proc.returncode != 0]
    if failed:
        raise Unverified(
            ", ".join(f"{p.name} exited {p.proc.returncode}" for p in failed)
            + "\n"
            + "\n".join(p.tail() for p in failed)
        )
    return seconds
