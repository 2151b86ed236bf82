"""The relay's hot-path SQL on PostgreSQL: calls of the database functions that write outbox state.

Every change the relay makes (claim, outcomes, lease renewal, release,
recovery) runs inside a ``SECURITY DEFINER`` function of migration
``outbox_0015``, owned by the tables' owner: the relay's login holds EXECUTE on
them and no UPDATE on ``outbox_message`` nor INSERT on ``outbox_attempt``, and
the history rows they append carry the database's clock and that login. Each
call is one autocommit round trip, as the statements it replaced were: one per
claimed batch, one per batch of outcomes.

The claim (``outbox_claim``) is a single ``UPDATE ... WHERE id =
ANY(ARRAY(SELECT ... FOR UPDATE SKIP LOCKED)) RETURNING``:

- ``id = ANY(ARRAY(...))`` is evaluated once and probes the primary key, where
  ``id IN (subquery)`` may hash-join the batch against a sequential scan of the
  whole table;
- a lease runs from the moment its row is taken (``clock_timestamp()``), not
  from the statement's start, so a claim slowed by load never hands out leases
  that are already spent;
- a paused queue or handler (``outbox_pause``) is left out by the claim itself,
  so a pause costs no round trip and is seen by the next claim of every relay;
- the scan starts at ``(from_priority, from_id)`` in the claim index's order
  (``relay/claim_position.py`` says when that is not the front): the front is
  the smallest position there is, so one statement serves both;
- status values are literals in the function's text, so the plan PostgreSQL
  keeps for the session can use the partial indexes.

The call reads each claimed row's ``expires_at`` beside the function's rows,
and whether it had passed at the claim's ``now()`` (``expired``): the database
judges expiry by its clock, which ``outbox_complete`` checks again by its own,
never earlier, ``now()``. A flag, not the claim's time: a timestamp per row is
a timezone-aware datetime psycopg builds for every claimed message, which cost
the relay 2-3 µs a message. ``outbox_claim``'s result type is left as it was
(migration ``outbox_0018`` says why). The lookup is a scalar subquery, one
probe of the primary key per claimed row, inside ``OFFSET 0`` so the planner
cannot flatten it into a join: as a lateral join it became a hash join over a
scan of the whole table, and the drain fell by a quarter.

The outcomes (``outbox_complete``) travel as one JSON document: encoding it is
one C call, where a dozen typed arrays cost psycopg a Python loop per element.
An outcome applies only to the claim that produced it (same relay, same attempt
number); its history row is appended once, even when a batch whose COMMIT went
through but whose reply was lost is sent again.

The relay's own connections run with ``jit = off``: its statements are short,
and compiling one costs more than running it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .claim_position import FRONT, RELEASED, Position

__all__ = [
    "CLAIM",
    "FUNCTIONS_SCHEMA",
    "PENDING_QUEUES",
    "PINNED_PATH",
    "Calls",
    "calls",
    "claim_start",
]

#: The path every relay function pins. A connection already on it spares PostgreSQL a switch of
#: search path at each call and back, which cost a claim 30-40 µs (PostgreSQL 15); the relay's two
#: hot-path connections run only these calls, named with their schema, so they set it once.
PINNED_PATH = "SET search_path = pg_catalog, pg_temp"

#: The schema the relay functions live in, as the engine's search path finds them (no row: none),
#: quoted for the calls and as its NOTIFY payloads name it (outbox_0001, outbox_0023).
FUNCTIONS_SCHEMA = (
    "SELECT quote_ident(n.nspname), n.nspname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
    " WHERE p.oid = to_regprocedure("
    "'outbox_claim(text, double precision, text, text[], integer, integer, bigint, boolean)')"
)


@dataclass(frozen=True, slots=True)
class Calls:
    """The relay's calls of its database functions, each named with the functions' schema."""

    claim: str
    complete: str
    extend: str
    release: str
    #: takes back the expired leases named in ``decisions`` (JSON: id, attempt, dead, delay, note)
    recover: str
    #: the first row ``claim`` would take that sorts before a position, locking nothing (or no row)
    first_due: str
    #: tells listening relays that claims were handed back (``claim_position.RELEASED``)
    released: str
    #: the schema as NOTIFY payloads name it; None: not known, every payload is taken as this schema's
    schema_name: str | None = None


def calls(schema: str | None, schema_name: str | None = None) -> Calls:
    """The calls for functions in ``schema`` (quoted; None: found through the search path), whose
    NOTIFY payloads name ``schema_name``."""
    f = f"{schema}." if schema else ""
    released = f"{schema_name} {RELEASED}" if schema_name else RELEASED
    return Calls(
        schema_name=schema_name,
        released="SELECT pg_notify('outbox', " + "'" + released.replace("'", "''") + "')",
        claim=f"""
WITH claimed AS (
    SELECT * FROM {f}outbox_claim(
        %(me)s::text, %(lease)s::float8, %(queue)s::text, %(handlers)s::text[], %(limit)s::int,
        %(from_priority)s::int, %(from_id)s::bigint, %(block_on_dead)s::boolean)
)
SELECT r.*, coalesce(r.expires_at <= now(), false) AS expired
  FROM (SELECT c.*, (SELECT m.expires_at FROM {f}outbox_message m WHERE m.id = c.id) AS expires_at
          FROM claimed c OFFSET 0) r
""",
        complete=f"SELECT {f}outbox_complete(%(me)s::text, %(batch)s::jsonb)",
        extend=f"SELECT id FROM {f}outbox_extend(%(me)s::text, %(ids)s::bigint[], %(lease)s::float8) AS id",
        release=f"SELECT {f}outbox_release(%(me)s::text, %(ids)s::bigint[], %(attempts)s::int[])",
        recover=(
            "SELECT message_id, dead, retry_in, reason"
            f" FROM {f}outbox_recover(%(me)s::text, %(decisions)s::jsonb)"
        ),
        first_due=f"""
SELECT c.priority, c.id FROM {f}outbox_message c
 WHERE c.status = 'pending' AND c.queue = %(queue)s::text AND c.handler = ANY(%(handlers)s::text[])
   AND (c.priority, c.id) < (%(before_priority)s::int, %(before_id)s::bigint)
   AND c.available_at <= now()
   AND NOT EXISTS (SELECT 1 FROM {f}outbox_pause p WHERE p.kind = 'queue' AND p.name = %(queue)s::text)
   AND NOT EXISTS (SELECT 1 FROM {f}outbox_pause p WHERE p.kind = 'handler' AND p.name = c.handler)
   AND (c.group_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM {f}outbox_message e
         WHERE e.handler = c.handler AND e.group_key = c.group_key AND e.id < c.id
           AND (e.status IN ('pending', 'running') OR (%(block_on_dead)s::boolean AND e.status = 'dead'))))
 ORDER BY c.priority, c.id
 LIMIT 1
""",
    )


#: The calls as the search path finds the functions (scripts, EXPLAIN).
CLAIM = calls(None).claim


def claim_start(start: Position) -> dict[str, int]:
    """The claim's ``from_priority`` and ``from_id`` parameters: where its scan starts (None: the front)."""
    from_priority, from_id = start or FRONT
    return {"from_priority": from_priority, "from_id": from_id}


#: Distinct queues with pending rows: a loose index scan (one probe per queue) of the claim index.
PENDING_QUEUES = """
WITH RECURSIVE q(queue) AS (
    SELECT min(queue) FROM outbox_message WHERE status = 'pending'
    UNION ALL
    SELECT (SELECT min(queue) FROM outbox_message WHERE status = 'pending' AND queue > q.queue)
      FROM q WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL
"""
