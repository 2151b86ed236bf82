"""The inbox: the consuming side, where at-least-once delivery becomes exactly-once effects.

Read it in the order a message travels:

- ``message``: what a source hands in (:class:`InboxMessage`) and what it gets
  back (:class:`Processed`), plain data;
- ``checks``: an incoming message's id, type, source and time checked at the edge;
- ``markers``: the marker, one INSERT in the caller's transaction that tells a
  first delivery from a duplicate, on PostgreSQL and SQLite;
- ``handlers``: ``@inbox.handler(pattern)`` and which handlers an event type reaches;
- ``process``: one message end to end (marker, handlers, commit, acknowledgement),
  sync and async, and what a failure becomes;
- ``dead``: dead letters, written with the message's marker;
- ``requeued``: a dead letter an operator requeued, as its consumer reads, takes
  and puts back;
- ``requeue``: ``process_requeued``, each requeued dead letter's second try;
- ``offsets``: a partitioned log's positions, stored with the effects;
- ``inbox``: the :class:`~outbox.Inbox` that holds the settings and joins these.
"""
