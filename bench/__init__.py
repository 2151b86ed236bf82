"""Benchmarks for sqlalchemy-outbox: ``python -m bench --database-url URL [--quick] [--json PATH]``.

Never timed tests: each mode measures one thing, verifies its own result
(every message delivered exactly once, one history row per attempt) and
refuses to report a figure otherwise. ``docs/performance.md`` has today's figures and
how to read them; ``bench/RESULTS.md`` the log of every run, newest first.
"""
