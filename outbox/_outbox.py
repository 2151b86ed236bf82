"""The Outbox: an application's routes and settings, and where they are installed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ._backoff import Backoff
from ._exceptions import ConfigurationError
from ._routes import Route, Transform, check_name, check_plain_callable, check_priority, handler_name
from ._topic import is_topic_pattern
from ._write.install import install as install_listeners
from ._write.install import uninstall as uninstall_listeners
from ._write.payload import DEFAULT_DEPTH_LIMIT, DEFAULT_PAYLOAD_LIMIT, MAX_DEPTH_LIMIT, JsonDefault
from ._write.settings import DedupeCounter

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

__all__ = ["Outbox"]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_MAX_ATTEMPTS = 10
DEFAULT_TIMEOUT = 30.0
DEFAULT_QUEUE = "default"
DEFAULT_PRIORITY = 0
#: Event types whose routes an Outbox with patterns remembers; past it, it starts over.
_RESOLVED_LIMIT = 4096


class Outbox:
    """Routes (event type -> handlers) plus settings; one per application.

    Routes are what make an emit valid: an event type with no route is refused at
    emit time. The relay process imports the same object (``--app module:ob``) and
    claims only the routes it holds.

    ``json_default`` converts payload values JSON has no type for, as
    ``json.dumps(default=...)`` does: ``outbox.json_default`` handles Decimal,
    datetime, date, UUID, Enum, dataclasses and Pydantic models.

    ``trace_context``, ``trace_baggage``, ``trace_parent`` and
    ``tracer_provider`` shape the OpenTelemetry traces from ``emit()`` to each
    delivery (docs/tracing.md); without the ``[otel]`` extra they do nothing.
    """

    def __init__(
        self,
        *,
        payload_limit: int = DEFAULT_PAYLOAD_LIMIT,
        payload_depth_limit: int = DEFAULT_DEPTH_LIMIT,
        default_max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        default_timeout: float = DEFAULT_TIMEOUT,
        default_queue: str = DEFAULT_QUEUE,
        default_priority: int = DEFAULT_PRIORITY,
        default_backoff: Backoff | None = None,
        pipeline_writes: bool = True,
        json_default: JsonDefault | None = None,
        trace_context: bool = True,
        trace_baggage: bool = False,
        trace_parent: Literal["link", "child"] = "link",
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        if isinstance(payload_limit, bool) or not isinstance(payload_limit, int) or payload_limit < 1:
            raise ConfigurationError(
                f"payload_limit must be a positive number of bytes, got {payload_limit!r}"
            )
        self.payload_limit = payload_limit
        if (
            isinstance(payload_depth_limit, bool)
            or not isinstance(payload_depth_limit, int)
            or not 1 <= payload_depth_limit <= MAX_DEPTH_LIMIT
        ):
            raise ConfigurationError(
                f"payload_depth_limit must be a number of levels from 1 to {MAX_DEPTH_LIMIT}, "
                f"got {payload_depth_limit!r}"
            )
        #: Levels of objects and arrays a payload may nest, the payload itself being 1 (see emit()).
        self.payload_depth_limit = payload_depth_limit
        self.default_max_attempts = default_max_attempts
        self.default_timeout = default_timeout
        self.default_queue = check_name("default_queue", default_queue)
        self.default_priority = check_priority(default_priority, "default_priority", ConfigurationError)
        self.default_backoff = Backoff() if default_backoff is None else default_backoff
        if not isinstance(pipeline_writes, bool):
            raise ConfigurationError(f"pipeline_writes must be True or False, got {pipeline_writes!r}")
        #: On psycopg, send the commit's INSERT with the COMMIT (see ``outbox._write.pipeline``).
        #: False keeps it an ordinary statement that SQLAlchemy's events see.
        self.pipeline_writes = pipeline_writes
        if json_default is not None:
            check_plain_callable(json_default, "json_default")
        #: Converts what a payload holds that JSON has no type for (see ``outbox.json_default``).
        self.json_default = json_default
        # Tracing (docs/tracing.md); every one of these is inert without the [otel] extra.
        for flag, value in (("trace_context", trace_context), ("trace_baggage", trace_baggage)):
            if not isinstance(value, bool):
                raise ConfigurationError(f"{flag} must be True or False, got {value!r}")
        if trace_parent not in ("link", "child"):
            raise ConfigurationError(f"trace_parent must be 'link' or 'child', got {trace_parent!r}")
        #: Store the emitting request's trace context in each event's headers.
        self.trace_context = trace_context
        #: Store its baggage too: user data, written to the database and seen by every handler.
        self.trace_baggage = trace_baggage
        #: The relay's span for an attempt links to the emitting span, or is its child.
        self.trace_parent: Literal["link", "child"] = trace_parent
        #: Where the relay's spans go; None: the global provider, looked up when the relay starts.
        self.tracer_provider = tracer_provider
        self._dedupe_counter = DedupeCounter()
        self._routes: dict[str, Route] = {}
        self._by_event: dict[str, tuple[Route, ...]] = {}
        #: The routes of each event type emitted so far (see routes_for); rebuilt when a route is added.
        self._resolved: dict[str, tuple[Route, ...]] = {}
        self._has_patterns = False

    def __repr__(self) -> str:
        return f"<Outbox routes={len(self._routes)}>"

    # -- routes -------------------------------------------------------------

    def route(
        self,
        event_type: str,
        handler: Callable[..., Any],
        *,
        name: str | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,
        queue: str | None = None,
        priority: int | None = None,
        backoff: Backoff | None = None,
        transform: Transform | None = None,
        expires_after: timedelta | None = None,
    ) -> Route:
        """Subscribe ``handler`` to ``event_type``; every emit then stores one message for it.

        ``transform(payload) -> payload``, a plain function, makes this route's
        payload from the event's at emit time; the result is checked like any
        payload, stored in this route's row and handed to its handler. A handler
        with ``outbox_validate(payload)`` has it called at emit with that payload.

        ``expires_after``, a positive timedelta: a message of this route that no
        relay handed to the handler within this long of its being stored (by the
        database's clock) is never handed to it: it is recorded ``expired`` and
        ends ``discarded``. ``emit(..., expires_at=...)`` can make it sooner.
        """
        route = Route(
            event_type=event_type,
            name=name if name is not None else handler_name(handler),
            handler=handler,
            max_attempts=self.default_max_attempts if max_attempts is None else max_attempts,
            timeout=self.default_timeout if timeout is None else timeout,
            queue=self.default_queue if queue is None else queue,
            priority=self.default_priority if priority is None else priority,
            backoff=self.default_backoff if backoff is None else backoff,
            transform=transform,
            expires_after=expires_after,
        )
        existing = self._routes.get(route.name)
        if existing is not None:
            raise ConfigurationError(
                f"route name {route.name!r} is already used (for {existing.event_type!r}); "
                "route names identify stored messages, so each must be unique: pass name=..."
            )
        self._routes[route.name] = route
        self._by_event[event_type] = (*self._by_event.get(event_type, ()), route)
        self._has_patterns = self._has_patterns or route.pattern
        self._resolved = {}  # a new dict, not clear(): an emit in another thread may be reading the old
        return route

    def handler(
        self,
        event_type: str,
        *,
        name: str | None = None,
        max_attempts: int | None = None,
        timeout: float | None = None,
        queue: str | None = None,
        priority: int | None = None,
        backoff: Backoff | None = None,
        transform: Transform | None = None,
        expires_after: timedelta | None = None,
    ) -> Callable[[F], F]:
        """Decorator form of :meth:`route`; returns the function unchanged."""

        def register(fn: F) -> F:
            self.route(
                event_type,
                fn,
                name=name,
                max_attempts=max_attempts,
                timeout=timeout,
                queue=queue,
                priority=priority,
                backoff=backoff,
                transform=transform,
                expires_after=expires_after,
            )
            return fn

        return register

    def routes_for(self, event_type: str) -> tuple[Route, ...]:
        """The routes an event of ``event_type`` is stored for, in the order they were registered.

        Exact routes and every pattern that matches, each route once. The answer
        is kept per event type, so an emit pays for the matching only the first
        time it meets an event type. A wildcard event type (``order.*``) is a
        pattern, not an event: it has no routes here.
        """
        found = self._resolved.get(event_type)
        if found is None:
            found = self._resolve(event_type)
        return found

    def _resolve(self, event_type: str) -> tuple[Route, ...]:
        if not self._has_patterns:
            found = self._by_event.get(event_type, ())
        elif not isinstance(event_type, str) or is_topic_pattern(event_type):
            return ()
        else:
            found = tuple(route for route in self._routes.values() if route.matches(event_type))
        if not found:  # an unrouted emit raises; its type is not worth a place
            return found
        resolved = self._resolved
        if len(resolved) >= _RESOLVED_LIMIT:  # event types made up at run time must not grow it forever
            resolved = self._resolved = {}
        resolved[event_type] = found
        return found

    def get_route(self, name: str) -> Route:
        try:
            return self._routes[name]
        except KeyError:
            raise ConfigurationError(f"no route named {name!r}; known: {sorted(self._routes)}") from None

    @property
    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes.values())

    @property
    def event_types(self) -> tuple[str, ...]:
        """The event types and patterns routes subscribe to, in the order first registered."""
        return tuple(self._by_event)

    @property
    def deduplicated(self) -> dict[str, int]:
        """Messages not stored because their route already held their key, per route, since start-up.

        Counted once the emitting transaction commits, in this process (the
        relay never sees them). Each is also announced by the
        ``event_deduplicated`` signal and a DEBUG log line.
        """
        return self._dedupe_counter.snapshot()

    def __iter__(self) -> Iterator[Route]:
        return iter(self.routes)

    # -- sessions -----------------------------------------------------------

    def install(self, target: Any) -> None:
        """Write this outbox's events from sessions made by ``target``.

        ``target`` is a Session (sub)class, a ``sessionmaker``, a
        ``scoped_session``, the ``AsyncSession`` class (or a subclass) or an
        ``async_sessionmaker``. Installing the same target twice is harmless.
        """
        install_listeners(self, target)

    def uninstall(self, target: Any) -> None:
        """Undo :meth:`install`; sessions from ``target`` can no longer emit."""
        uninstall_listeners(self, target)
