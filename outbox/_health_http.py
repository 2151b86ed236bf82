"""The small HTTP endpoint a long-running process serves: ``/metrics``, ``/healthz``, ``/readyz``.

Shared by ``outbox-relay`` and ``outbox-consumer`` so both answer probes the
same way: ``/healthz`` says the process answers, ``/readyz`` says whether it
can do its work (503 and the reason when not), ``/metrics`` is the process's
own Prometheus registry. It runs in a daemon thread, so a busy event loop
never makes a probe time out. Needs ``prometheus-client`` (the metrics extra).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ._exceptions import ConfigurationError

__all__ = ["HealthServer"]


class HealthServer:
    def __init__(self, registry: Any, ready: Callable[[], tuple[bool, str]]) -> None:
        self._registry = registry
        self._ready = ready
        self._server: ThreadingHTTPServer | None = None

    def serve(self, host: str, port: int) -> int:
        """Start answering in a daemon thread; returns the bound port (useful with port 0)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry, ready = self._registry, self._ready

        class Endpoint(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._reply(200, b"ok\n", "text/plain")
                elif path == "/readyz":
                    ok, why = ready()
                    self._reply(200 if ok else 503, f"{why}\n".encode(), "text/plain")
                else:
                    self._reply(404, b"not found\n", "text/plain")

            def _reply(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Endpoint)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="outbox-metrics", daemon=True).start()
        return int(self._server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
