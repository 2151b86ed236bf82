"""A connection cut exactly at the COMMIT's answer: just after it, or just before it.

A proxy between the application and PostgreSQL reads the server's messages
and, once armed, closes both sides of the connection at the COMMIT's
CommandComplete: after forwarding it (the server confirmed the COMMIT, then
the connection was lost) or before (the server committed, and its answer never
arrived).

- Answer arrived: ``commit()`` returns, the rows are stored, and the pool
  replaces the lost connection by itself (no ``pool_pre_ping``).
- No answer: ``commit()`` raises, and whether the transaction committed is
  unknown to the application. Here it did, and the business row and the event
  are stored together: both or neither, never one without the other.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from invoices import Base, Invoice, stored
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from outbox import Outbox, emit
from outbox._write import pipeline as _pipeline

#: CommandComplete for a COMMIT that committed.
COMMIT_COMPLETE = b"C" + struct.pack("!i", 4 + len(b"COMMIT\0")) + b"COMMIT\0"


class CommitCut:
    """Forwards connections to PostgreSQL; once armed, cuts the next one that answers a COMMIT.

    ``arm("after")`` forwards the COMMIT's CommandComplete and then closes both
    sides; ``arm("before")`` closes them instead of forwarding it. Connections
    must not ask for TLS or GSS encryption (the proxy reads the messages).
    """

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._armed: str | None = None
        self._lock = threading.Lock()
        self.cuts = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, where: str) -> None:
        assert where in ("after", "before")
        self._armed = where

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._to_server, args=(client, server), daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                server.sendall(data)
        except OSError:
            pass
        _close(client, server)

    def _to_client(self, server: socket.socket, client: socket.socket) -> None:
        unread = b""
        try:
            while data := server.recv(65536):
                unread += data
                sendable = 0
                while len(unread) - sendable >= 5:
                    (length,) = struct.unpack("!i", unread[sendable + 1 : sendable + 5])
                    end = sendable + 1 + length
                    if end > len(unread):
                        break
                    if unread[sendable:end] == COMMIT_COMPLETE and (where := self._take()) is not None:
                        client.sendall(unread[: end if where == "after" else sendable])
                        _close(client, server)
                        return
                    sendable = end
                client.sendall(unread[:sendable])
                unread = unread[sendable:]
        except OSError:
            pass
        _close(client, server)

    def _take(self) -> str | None:
        with self._lock:
            where, self._armed = self._armed, None
            if where is not None:
                self.cuts += 1
            return where


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


@pytest.fixture
def cut(pg_url: str) -> Iterator[CommitCut]:
    url = make_url(pg_url)
    proxy = CommitCut((url.host or "127.0.0.1", url.port or 5432))
    yield proxy
    proxy.close()


def through(pg_url: str, cut: CommitCut, **connect_args: object) -> Engine:
    url = make_url(pg_url).set(
        host="127.0.0.1", port=cut.port, query={"sslmode": "disable", "gssencmode": "disable"}
    )
    return create_engine(url, connect_args=connect_args)


PIPELINED = ["pipelined, first commit", "pipelined, prepared"]

#: How the measured commit's INSERT goes out, by path.
SENT_BY = {"pipelined, first commit": ["_PsycopgBatch"], "pipelined, prepared": ["DirectBatch"], "plain": []}


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ways the commits' INSERTs went out, in order: psycopg's Pipeline or straight through libpq."""
    ways: list[str] = []
    for name in ("DirectBatch", "_PsycopgBatch"):
        real = getattr(_pipeline, name)

        def make(*args: object, _real: type = real, _name: str = name) -> object:
            ways.append(_name)
            return _real(*args)

        monkeypatch.setattr(_pipeline, name, make)
    return ways


def sessions(engine: Engine, path: str) -> sessionmaker[Session]:
    ob = Outbox(pipeline_writes=path != "plain")
    ob.route("invoice.issued", lambda message: None, name="mail")
    factory = sessionmaker(engine)
    ob.install(factory)
    if path == "pipelined, prepared":
        # With prepare_threshold=0 psycopg prepares the INSERT at its first run,
        # and the next emitting commit on the connection sends it through libpq.
        with factory() as s, s.begin():
            emit(s, "invoice.issued", {"number": "warm-up"})
    return factory


def commit_one(factory: sessionmaker[Session], number: str) -> int:
    """An emitting commit; the backend's pid it ran on."""
    with factory() as s:
        pid: int = s.execute(text("SELECT pg_backend_pid()")).scalar_one()
        s.add(Invoice(number=number))
        emit(s, "invoice.issued", {"number": number})
        s.commit()
    return pid


@pytest.mark.parametrize("path", PIPELINED)
def test_a_commit_whose_answer_arrived_returns_and_the_pool_replaces_the_connection(
    pg_engine, pg_url, cut, path, caplog, sent
):
    Base.metadata.create_all(pg_engine)
    engine = through(pg_url, cut, **({"prepare_threshold": 0} if path == "pipelined, prepared" else {}))
    factory = sessions(engine, path)
    caplog.set_level(logging.INFO)
    with pg_engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox_message"))

    cut.arm("after")
    sent.clear()
    first = commit_one(factory, "1")  # returns: PostgreSQL said COMMIT
    assert sent == SENT_BY[path]

    assert cut.cuts == 1
    assert stored(pg_engine) == (1, 1)
    lost = [r for r in caplog.records if getattr(r, "action", None) == "commit_connection_lost"]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING
    # The next request gets a new connection from the pool, without pool_pre_ping.
    second = commit_one(factory, "2")
    assert second != first
    assert stored(pg_engine) == (2, 2)
    # The pool never reset the dead connection (it would log an error with a traceback).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    engine.dispose()


@pytest.mark.parametrize("path", [*PIPELINED, "plain"])
def test_a_commit_whose_answer_never_came_raises_and_stores_both_or_neither(
    pg_engine, pg_url, cut, path, sent
):
    Base.metadata.create_all(pg_engine)
    engine = through(pg_url, cut, **({"prepare_threshold": 0} if path == "pipelined, prepared" else {}))
    factory = sessions(engine, path)
    with pg_engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox_message"))

    cut.arm("before")
    sent.clear()
    with pytest.raises(OperationalError) as caught:
        commit_one(factory, "1")
    assert sent == SENT_BY[path]

    assert cut.cuts == 1
    assert caught.value.connection_invalidated
    # commit() could not know; PostgreSQL had committed, and stored both rows together.
    assert stored(pg_engine) == (1, 1)
    commit_one(factory, "2")  # the pool reconnects
    assert stored(pg_engine) == (2, 2)
    engine.dispose()
