"""A throwaway PostgreSQL cluster from ``initdb``/``pg_ctl``, for tests that stop and start the server.

Also the harness's fallback when ``OUTBOX_TEST_DATABASE_URL`` is unset. PostgreSQL
refuses to run as root, so under root the cluster runs as the ``postgres`` user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

__all__ = ["Cluster", "available"]


def _tool(name: str) -> str | None:
    return shutil.which(name)


def available() -> bool:
    return _tool("pg_ctl") is not None and _tool("initdb") is not None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run(
            [
                _tool("initdb") or "initdb",
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
        )
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.root}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 200\n"
            )

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, cmd: list[str]) -> None:
        subprocess.run([*self._as, *cmd], check=True, capture_output=True, cwd=self.root)

    def start(self) -> None:
        self._run(
            [_tool("pg_ctl") or "pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "start"]
        )

    def stop(self, mode: str = "fast") -> None:
        self._run([_tool("pg_ctl") or "pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop"])

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)
