"""A bounded chaos test: three relays deliver 5,000 messages while a driver breaks things at random.

Real ``outbox-relay`` subprocesses serve ``tests/apps/chaos_app.py`` against a
throwaway PostgreSQL cluster of the test's own (it restarts the server, so it
never uses the shared one). Every 0.5 to 2 seconds a seeded driver picks one
fault:

- ``kill``: SIGKILL one relay and start a replacement, half the time with the
  killed relay's ``--relay-id`` (operators are told to keep relay ids stable);
- ``terminate``: ``pg_terminate_backend`` every connection of one relay (each
  relay connects with an ``application_name`` of its own, so they can be told
  apart in ``pg_stat_activity``);
- ``restart``: stop the server and start it again, at most a few times per run;
  the stop is ``fast`` (clean) or ``immediate`` (a crash: the server recovers
  from its WAL, and keeps every commit a client saw succeed, since the test
  turns ``synchronous_commit`` back on; a connection that turns it off for
  itself gives that guarantee up).

Messages are emitted in several commits, some before the relays start and the
rest during the chaos (with idempotency keys, so a commit retried across a
server restart cannot store anything twice); one in twenty fails its first
attempt. Then a quiet phase lets everything drain, under a hard deadline.

The handler appends ``message_id attempt relay_id pid`` to a file, with fsync,
before it returns: the evidence of each delivery survives both the relays and
the server, and owes nothing to the outbox tables. At the end, with plain SQL
against ``outbox_message`` and ``outbox_attempt`` plus that file:

a. nothing is lost: every emitted message is ``delivered`` and in the log;
b. every duplicate delivery is explained: each delivery other than the final
   one belongs to an attempt the history records as ``lease_expired``, naming
   the relay that made it;
c. the history has one row per attempt: no row twice; attempts 1..N each have
   a row and none beyond N (N = ``outbox_message.attempts``); an attempt has two
   rows only when one is ``lease_expired`` (a late outcome after recovery);
d. the control: every kind of fault was injected (and hit something), and at
   least one lease was recovered, so the test cannot pass by doing nothing;
e. no relay exited on its own once started, and all stop cleanly at the end.

``OUTBOX_CHAOS_SECONDS`` lengthens the fault phase (default 35 s; the message
count scales with it) and ``OUTBOX_CHAOS_SEED`` replays a run: see CONTRIBUTING.md.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pgcluster
import pytest
from relayproc import APPS, RelayProcess
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker

import outbox
from outbox import emit

sys.path.insert(0, str(APPS))
import chaos_app  # noqa: E402  (tests/apps is what the relay subprocesses import it from, too)

T = TypeVar("T")

FAULT_SECONDS = float(os.environ.get("OUTBOX_CHAOS_SECONDS") or 35)
#: 5,000 for the default run; a longer run keeps the same emit rate.
MESSAGES = int(5000 * max(1.0, FAULT_SECONDS / 35))
PRELOAD = MESSAGES // 5  # committed before any relay starts
EMIT_BATCH = 25
FAIL_EVERY = 20  # every 20th message fails its first attempt
RELAYS = 3
MAX_RESTARTS = max(3, int(FAULT_SECONDS / 12))
#: How long everything may take to drain once the faults stop, before the test gives up.
QUIET_DEADLINE = 60.0 + FAULT_SECONDS / 10
RELAY_OPTIONS = (
    *("--app", "chaos_app:ob"),  # replaces relayproc's default app: the last --app given wins
    *("--lease", "2", "--poll-interval", "0.2", "--concurrency", "10", "--grace-period", "5"),
    *("--log-level", "INFO"),
)
FAULTS = ("kill", "terminate", "restart")


def _needs_a_cluster() -> None:
    if pgcluster.available():
        return
    if os.environ.get("CI"):
        pytest.fail("the chaos test needs pg_ctl and initdb on the PATH (it restarts a server of its own)")
    pytest.skip("needs pg_ctl and initdb on the PATH for a throwaway server it can restart")


def _retrying(
    what: str, action: Callable[[], T], *, seconds: float = 30.0, on_retry: Callable[[], None] | None = None
) -> T:
    """Run a short database action, retrying while the server restarts."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return action()
        except DBAPIError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: the database stayed unavailable for {seconds:g}s") from exc
            if on_retry is not None:
                on_retry()
            time.sleep(0.2)


# -- the relays ----------------------------------------------------------------------------------------


@dataclass
class Relay:
    relay_id: str
    app_name: str
    proc: RelayProcess

    def started(self) -> bool:
        return bool(self.proc.actions("start"))


@dataclass
class Fleet:
    """The relay processes: three kept running; every one ever started is killed at teardown."""

    base_url: str
    directory: Path
    delivery_log: Path
    running: list[Relay] = field(default_factory=list)
    every: list[Relay] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)
    exits_while_starting: int = 0  # e.g. the server went down under its start-up check: replaced
    serial: int = 0

    def spawn(self, relay_id: str) -> Relay:
        self.serial += 1
        app_name = f"chaos-relay-{self.serial}"
        url = f"{self.base_url}?application_name={app_name}"
        proc = RelayProcess(
            url,
            (*RELAY_OPTIONS, "--relay-id", relay_id),
            log_path=self.directory / f"relay-{self.serial:03d}-{relay_id}.log",
            env={
                "CHAOS_DELIVERY_LOG": str(self.delivery_log),
                "CHAOS_RELAY_ID": relay_id,
                "CHAOS_SLEEP_MS": "200",
            },
        )
        relay = Relay(relay_id, app_name, proc)
        self.running.append(relay)
        self.every.append(relay)
        return relay

    def supervise(self) -> None:
        """Replace any relay that exited without being killed; one that had started counts against it."""
        for relay in list(self.running):
            if relay.proc.alive():
                continue
            self.running.remove(relay)
            if relay.started():
                self.unexpected_exits.append(relay.proc.tail(10))
            else:
                self.exits_while_starting += 1
            self.spawn(relay.relay_id)

    def kill(self, relay: Relay) -> None:
        self.running.remove(relay)
        relay.proc.signal(signal.SIGKILL)
        relay.proc.kill()  # reaps it and closes its log

    def stop_all(self) -> dict[str, int | None]:
        for relay in self.running:
            if relay.proc.alive():
                relay.proc.signal(signal.SIGTERM)
        codes: dict[str, int | None] = {}
        for relay in self.running:
            try:
                codes[relay.app_name] = relay.proc.wait(30)
            except Exception:
                codes[relay.app_name] = None
        return codes

    def teardown(self) -> None:
        for relay in self.every:
            try:
                relay.proc.kill()
            except Exception:
                pass


# -- the emitter ---------------------------------------------------------------------------------------


class Emitter:
    """Commits ``chaos.deliver`` events with idempotency keys, retrying commits a restart cut off."""

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url, pool_pre_ping=True)
        self.factory = sessionmaker(self.engine)
        chaos_app.ob.install(self.factory)
        self.retries = 0
        self.emitted = 0
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def emit_range(self, start: int, stop: int) -> None:
        def commit() -> None:
            with self.factory() as s, s.begin():
                for n in range(start, stop):
                    emit(s, chaos_app.EVENT, {"n": n, "fail_once": n % FAIL_EVERY == 0}, key=f"chaos:{n}")

        def count_retry() -> None:
            self.retries += 1

        _retrying(f"emitting messages {start}..{stop - 1}", commit, on_retry=count_retry)
        self.emitted += stop - start

    def emit_during(self, start: int, stop: int, seconds: float) -> None:
        """Emit ``start..stop`` in batches spread over ``seconds``, on a thread of its own."""

        def run() -> None:
            began = time.monotonic()
            batches = list(range(start, stop, EMIT_BATCH))
            try:
                for i, first in enumerate(batches):
                    due = began + seconds * i / max(1, len(batches))
                    if self._stop.wait(max(0.0, due - time.monotonic())):
                        return
                    self.emit_range(first, min(first + EMIT_BATCH, stop))
            except BaseException as exc:
                self.error = exc

        self._thread = threading.Thread(target=run, name="chaos-emitter", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise AssertionError(f"the emitter had not finished {timeout:g}s after the fault phase")
        if self.error is not None:
            raise AssertionError(f"the emitter failed: {self.error!r}") from self.error

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        chaos_app.ob.uninstall(self.factory)
        self.engine.dispose()


# -- the driver ----------------------------------------------------------------------------------------


class Driver:
    """Injects one random fault at a time, and counts what each one hit."""

    def __init__(self, rng: random.Random, cluster: pgcluster.Cluster, fleet: Fleet, admin: Engine) -> None:
        self.rng = rng
        self.cluster = cluster
        self.fleet = fleet
        self.admin = admin
        self.injected: Counter[str] = Counter()
        self.effective: Counter[str] = Counter()  # faults that hit something
        self.killed_in_flight = 0
        self.same_id_restarts = 0
        self.connections_terminated = 0
        self.restart_modes: Counter[str] = Counter()
        self.timeline: list[str] = []
        self.began = time.monotonic()
        self._next_relay = RELAYS + 1

    def note(self, event: str) -> None:
        self.timeline.append(f"{time.monotonic() - self.began:6.1f}s {event}")

    def choose(self, elapsed: float) -> str:
        allowed = [f for f in FAULTS if f != "restart" or self.injected["restart"] < MAX_RESTARTS]
        if elapsed > FAULT_SECONDS / 2:  # the control must not depend on luck: each kind at least once
            missing = [f for f in allowed if not self.effective[f]]
            if missing:
                return missing[0]
        weights = {"kill": 0.42, "terminate": 0.42, "restart": 0.16}
        return self.rng.choices(allowed, weights=[weights[f] for f in allowed])[0]

    def inject(self, kind: str) -> None:
        self.injected[kind] += 1
        getattr(self, f"_{kind}")()

    def _running_by_relay(self) -> dict[str, int]:
        def count() -> dict[str, int]:
            with self.admin.connect() as conn:
                query = text(
                    "SELECT locked_by, count(*) FROM outbox_message"
                    " WHERE status = 'running' GROUP BY locked_by"
                )
                return {relay_id: n for relay_id, n in conn.execute(query)}

        return _retrying("counting the relays' claims", count)

    def _kill(self) -> None:
        held_by = self._running_by_relay()
        # Evidence first: a relay holding claims, when there is one, so the kill interrupts work.
        busy = [r for r in self.fleet.running if held_by.get(r.relay_id)]
        victim = self.rng.choice(busy or self.fleet.running)
        held = held_by.get(victim.relay_id, 0)
        self.fleet.kill(victim)
        same = self.rng.random() < 0.5
        if same:
            relay_id = victim.relay_id
            self.same_id_restarts += 1
        else:
            relay_id = f"r{self._next_relay}"
            self._next_relay += 1
        self.fleet.spawn(relay_id)
        self.killed_in_flight += held
        if held:
            self.effective["kill"] += 1
        self.note(f"SIGKILL {victim.app_name} ({victim.relay_id}, {held} running); started {relay_id}")

    def _terminate(self) -> None:
        up = [r for r in self.fleet.running if r.started()]  # one still starting has nothing to lose
        victim = self.rng.choice(up or self.fleet.running)

        def terminate() -> int:
            with self.admin.connect() as conn:
                query = text(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))"
                    " FROM pg_stat_activity WHERE application_name = :app"
                )
                return int(conn.execute(query, {"app": victim.app_name}).scalar_one())

        n = _retrying("terminating a relay's connections", terminate)
        self.connections_terminated += n
        if n:
            self.effective["terminate"] += 1
        self.note(f"pg_terminate_backend: {n} connection(s) of {victim.app_name} ({victim.relay_id})")

    def _restart(self) -> None:
        mode = self.rng.choice(["fast", "immediate"])
        down = self.rng.uniform(0.0, 2.5)  # longer than the lease, sometimes: leases lapse under live relays
        self.cluster.stop(mode)
        time.sleep(down)
        self.cluster.start()
        self.admin.dispose()
        self.restart_modes[mode] += 1
        self.effective["restart"] += 1
        self.note(f"server restart ({mode}, down {down:.1f}s + start)")


# -- reading it all back -------------------------------------------------------------------------------


@dataclass
class Delivery:
    message_id: int
    attempt: int
    relay_id: str
    pid: int


def read_delivery_log(path: Path) -> tuple[list[Delivery], list[str]]:
    found, malformed = [], []
    if not path.exists():
        return found, malformed
    for line in path.read_text().splitlines():
        parts = line.split()
        try:
            mid, att, relay_id, pid = parts
            found.append(Delivery(int(mid), int(att), relay_id, int(pid)))
        except ValueError:
            malformed.append(line)
    return found, malformed


def statuses(engine: Engine) -> Counter[str]:
    def read() -> Counter[str]:
        with engine.connect() as conn:
            query = text("SELECT status, count(*) FROM outbox_message GROUP BY status")
            return Counter({s: n for s, n in conn.execute(query)})

    return _retrying("reading statuses", read)


def check(
    messages: list[Any], history: list[Any], log: list[Delivery], malformed: list[str]
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Every assertion of the module docstring's a, b and c; returns problems with evidence, and counts."""
    problems: dict[str, list[str]] = defaultdict(list)
    by_id = {r.id: r for r in messages}
    rows = defaultdict(list)  # (message id, attempt) -> history rows
    for h in history:
        rows[h.message_id, h.attempt].append(h)
    lines = defaultdict(list)
    for d in log:
        lines[d.message_id].append(d)

    # a. nothing lost
    keys = {r.idempotency_key for r in messages}
    for n in range(MESSAGES):
        if f"chaos:{n}" not in keys:
            problems["a: emitted but not stored"].append(f"key chaos:{n}")
    if len(messages) != MESSAGES:
        problems["a: emitted but not stored"].append(f"{len(messages)} rows for {MESSAGES} keys")
    for r in messages:
        if r.status != "delivered":
            problems["a: not delivered"].append(
                f"#{r.id} status={r.status} attempts={r.attempts} locked_by={r.locked_by} "
                f"last_error={r.last_error!r}"
            )
        elif not lines[r.id]:
            problems["a: delivered but never in the delivery log"].append(f"#{r.id}")
    for line in malformed:
        problems["log: malformed delivery-log line"].append(repr(line))

    # The log's faithfulness: each delivered row is a handler that returned, so it wrote its line.
    for h in history:
        if h.outcome == "delivered" and not any(
            d.attempt == h.attempt and d.relay_id == h.relay_id for d in lines[h.message_id]
        ):
            problems["log: delivered row without a delivery-log line"].append(_row(h))

    # b. every delivery but the final one is a crashed (lease_expired) attempt of the relay that made it
    duplicates = 0
    for mid, found in lines.items():
        r = by_id.get(mid)
        if r is None:
            problems["b: delivery of an unknown message"].append(f"#{mid}: {found}")
            continue
        duplicates += len(found) - 1
        final_seen = False
        for d in sorted(found, key=lambda d: d.attempt):
            outcomes = [h.outcome for h in rows[mid, d.attempt]]
            final = r.status == "delivered" and d.attempt == r.attempts and "delivered" in outcomes
            if final and not final_seen:
                final_seen = True
                continue
            if not any(
                h.outcome == "lease_expired" and h.relay_id == d.relay_id for h in rows[mid, d.attempt]
            ):
                problems["b: duplicate delivery without a crashed attempt in the history"].append(
                    f"#{mid} delivered by {d.relay_id} (pid {d.pid}) in attempt {d.attempt}; "
                    f"message attempts={r.attempts} status={r.status}; deliveries at attempts "
                    f"{sorted(x.attempt for x in found)}; "
                    f"history: {_rows(h for h in history if h.message_id == mid)}"
                )

    # c. one history row per attempt
    seen = Counter((h.message_id, h.attempt, h.started_at, h.outcome) for h in history)
    for key, n in seen.items():
        if n > 1:
            problems["c: the same history row more than once"].append(
                f"#{key[0]} attempt {key[1]} {key[3]} started {key[2].isoformat()}: {n} rows"
            )
    attempts_of = defaultdict(set)
    for h in history:
        attempts_of[h.message_id].add(h.attempt)
    for r in messages:
        present = attempts_of[r.id]
        expected = set(range(1, r.attempts + 1))
        if present != expected:
            problems["c: attempts without history, or history beyond outbox_message.attempts"].append(
                f"#{r.id} attempts={r.attempts} status={r.status}: history has attempts {sorted(present)}; "
                f"{_rows(h for h in history if h.message_id == r.id)}"
            )
    for (mid, att), found in rows.items():
        if len(found) == 1:
            continue
        kinds = sorted(h.outcome for h in found)
        if len(found) > 2 or kinds.count("lease_expired") != 1:
            problems["c: an attempt with two rows, neither of them lease_expired (or more than two)"].append(
                f"#{mid} attempt {att}: {_rows(found)}"
            )

    outcomes = Counter(h.outcome for h in history)
    counts = {
        "deliveries": len(log),
        "duplicates": duplicates,
        "messages delivered more than once": sum(1 for found in lines.values() if len(found) > 1),
        "history rows": len(history),
        "outcomes": dict(outcomes),
    }
    return problems, counts


def _row(h: Any) -> str:
    return f"(#{h.message_id} att {h.attempt} {h.outcome} {h.relay_id} started {h.started_at:%H:%M:%S.%f})"


def _rows(found: Any) -> str:
    return "[" + ", ".join(_row(h) for h in sorted(found, key=lambda h: h.id)) + "]"


# -- the test ------------------------------------------------------------------------------------------


def test_chaos_three_relays_lose_nothing(tmp_path: Path) -> None:
    _needs_a_cluster()
    seed = int(os.environ.get("OUTBOX_CHAOS_SEED") or random.SystemRandom().randrange(2**32))
    rng = random.Random(seed)
    print(
        f"\nchaos: seed {seed} (replay with OUTBOX_CHAOS_SEED={seed}), {FAULT_SECONDS:g}s of faults, "
        f"{MESSAGES} messages"
    )
    began = time.monotonic()
    cluster = pgcluster.Cluster()
    # The cluster turns synchronous_commit off for speed; an immediate stop could then lose commits
    # the client saw succeed, and the test would blame the outbox for the server's shortcut.
    with (cluster.data / "postgresql.conf").open("a") as conf:
        conf.write("synchronous_commit = on\n")
    fleet: Fleet | None = None
    emitter: Emitter | None = None
    admin: Engine | None = None
    try:
        cluster.start()
        url = cluster.url
        outbox.upgrade(url)
        admin = create_engine(url, pool_pre_ping=True)
        delivery_log = tmp_path / "deliveries.log"
        fleet = Fleet(url, tmp_path, delivery_log)
        emitter = Emitter(url)
        emitter.emit_range(0, PRELOAD)
        for n in range(1, RELAYS + 1):
            fleet.spawn(f"r{n}")
        # Evidence before the first fault: every relay is up and deliveries are flowing.
        deadline = time.monotonic() + 30
        while not (all(r.started() for r in fleet.running) and delivery_log.exists()):
            fleet.supervise()
            assert time.monotonic() < deadline, "relays did not start delivering:\n" + "\n".join(
                r.proc.tail() for r in fleet.running
            )
            time.sleep(0.1)

        driver = Driver(rng, cluster, fleet, admin)
        emitter.emit_during(PRELOAD, MESSAGES, FAULT_SECONDS * 0.9)
        faults_began = time.monotonic()
        while (elapsed := time.monotonic() - faults_began) < FAULT_SECONDS:
            pause_until = time.monotonic() + rng.uniform(0.5, 2.0)
            while time.monotonic() < pause_until:
                fleet.supervise()
                time.sleep(0.05)
            driver.inject(driver.choose(elapsed))
        fault_phase = time.monotonic() - faults_began

        emitter.join(30)
        quiet_began = time.monotonic()
        drained = False
        while time.monotonic() - quiet_began < QUIET_DEADLINE:
            fleet.supervise()
            if statuses(admin) == Counter(delivered=MESSAGES):
                drained = True
                break
            time.sleep(0.2)
        quiet_phase = time.monotonic() - quiet_began
        # A replacement still importing would die of SIGTERM before its handlers exist: wait for it.
        wait_started = time.monotonic() + 30
        while not all(r.started() for r in fleet.running) and time.monotonic() < wait_started:
            fleet.supervise()
            time.sleep(0.1)
        exit_codes = fleet.stop_all()

        with admin.connect() as conn:
            messages = list(
                conn.execute(
                    text(
                        "SELECT id, idempotency_key, status, attempts, locked_by, locked_until, last_error"
                        " FROM outbox_message ORDER BY id"
                    )
                )
            )
            history = list(
                conn.execute(
                    text(
                        "SELECT id, message_id, attempt, outcome, started_at, relay_id, error_type"
                        " FROM outbox_attempt ORDER BY id"
                    )
                )
            )
        log, malformed = read_delivery_log(delivery_log)
        problems, counts = check(messages, history, log, malformed)

        # d. the control, e. the relays themselves
        for kind in FAULTS:
            if not driver.effective[kind]:
                problems["d: a kind of fault never hit anything"].append(
                    f"{kind}: injected {driver.injected[kind]}, effective {driver.effective[kind]}"
                )
        if not counts["outcomes"].get("lease_expired"):
            problems["d: no lease was ever recovered"].append("no lease_expired row in outbox_attempt")
        if not drained:
            problems["a: not drained before the deadline"].append(
                f"{QUIET_DEADLINE:g}s after the faults: {dict(statuses(admin))}"
            )
        problems["e: a relay exited on its own"].extend(fleet.unexpected_exits)
        for app_name, code in exit_codes.items():
            if code != 0:
                problems["e: a relay did not stop cleanly on SIGTERM"].append(f"{app_name}: exit {code}")
        problems = {k: v for k, v in problems.items() if v}

        total = time.monotonic() - began
        summary = "\n".join(
            [
                f"chaos summary (seed {seed}; replay with OUTBOX_CHAOS_SEED={seed}):",
                f"  run {total:.1f}s: faults {fault_phase:.1f}s, drain {quiet_phase:.1f}s; "
                f"{MESSAGES} messages, {emitter.retries} emit retries",
                f"  faults injected {dict(driver.injected)}, effective {dict(driver.effective)}; "
                f"{driver.killed_in_flight} running messages held by killed relays, "
                f"{driver.same_id_restarts} replacements reused the killed relay's id, "
                f"{driver.connections_terminated} connections terminated, "
                f"restarts {dict(driver.restart_modes)}",
                f"  relays started {len(fleet.every)} ({fleet.exits_while_starting} exited while starting "
                f"and were replaced); deliveries {counts['deliveries']}, duplicates "
                f"{counts['duplicates']} ({100 * counts['duplicates'] / max(1, MESSAGES):.2f}% of messages; "
                f"{counts['messages delivered more than once']} messages more than once)",
                f"  history rows {counts['history rows']}: {counts['outcomes']}",
                *(f"  {line}" for line in driver.timeline),
            ]
        )
        print(summary)
        if problems:
            details = []
            for name, evidence in problems.items():
                details.append(f"{name}: {len(evidence)}")
                details.extend(f"    {e}" for e in evidence[:8])
                if len(evidence) > 8:
                    details.append(f"    ... and {len(evidence) - 8} more")
            pytest.fail(summary + "\nFAILED CHECKS:\n" + "\n".join(details), pytrace=False)
    finally:
        if fleet is not None:
            fleet.teardown()
        if emitter is not None:
            emitter.close()
        if admin is not None:
            admin.dispose()
        cluster.destroy()
