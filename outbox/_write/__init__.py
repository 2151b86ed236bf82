"""The write path: from ``emit()`` in a request to ``outbox_message`` rows in its commit.

Read it in the order an event travels:

- ``emit`` (and ``mixin``, ``OutboxMixin.emit``): checks the event at the edge
  and buffers one row per route; ``payload`` holds the payload and header checks,
  ``keys`` the key placeholders and the refusal of an id not assigned yet;
- ``pending``: the per-session buffer, tagged by transaction and savepoint;
- ``install``: the session listeners that write the buffer at flush and commit;
- ``rows``: buffered events turned into one INSERT; ``dedupe``: the rows it
  dropped as duplicates of a stored key, announced once the transaction commits;
- ``pipeline`` (with ``direct_pipeline`` and ``pipeline_hooks``): on psycopg,
  the commit's INSERT sent with the COMMIT and its reply read there;
- ``settings``: what all of these read from the :class:`~outbox.Outbox`, which
  sits above this package and installs it.
"""
