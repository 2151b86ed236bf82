"""A nats-server with JetStream of a test's own, for faults the machine's shared server must not suffer.

A test that kills or restarts a server kills and restarts this one: its own process, on a free
port, with its store in a directory of the test's. The shared server on 4222 is never touched.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

SERVER = "/usr/sbin/nats-server"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class NatsServer:
    """``nats-server -js`` on 127.0.0.1 at a free port, its JetStream store under ``directory``.

    The port is chosen once: a restart comes back on the same port with the same store, as a
    restarted production server would. Use it as a context manager so the process is killed
    whatever the test does.
    """

    def __init__(self, directory: Path) -> None:
        self.store = directory / "jetstream"
        self.log = directory / "nats-server.log"
        self.port = _free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and return once its port answers."""
        if self._proc is not None:
            raise RuntimeError("this nats-server is already running")
        command = [SERVER, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)]
        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not _answers(self.port):
            if self._proc.poll() is not None:
                self._proc = None
                raise RuntimeError(f"nats-server exited at start; see {self.log}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"nats-server did not answer on port {self.port} within {timeout}s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no goodbye to clients; JetStream recovers the stream from its files at the next start."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.kill()
