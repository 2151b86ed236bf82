"""The idempotency keys of copies: requeue's ``~requeue:<old id>``, resend's ``~resend:<new id>``.

A copy shares its route with the original, whose row keeps its key, and
(route, key) is unique: so a copy's key is the original's with a suffix. Two
rules hold at every key length. A copy's key is unique for its route. And a
key is never cut short: :func:`root_key` of any copy's key is the
original's, which is what a handler may derive an identity from (the email
handler's ``Message-ID``).
"""

from __future__ import annotations

import hashlib
import re

from ._base import KEY_LIMIT, MAX_ID

__all__ = ["ROOT_KEY_LIMIT", "requeued_key", "resent_key", "root_key"]

_REQUEUE_MARK = "~requeue:"
_RESEND_MARK = "~resend:"
_COPY_SUFFIXES = re.compile(r"(?:~(?:requeue|resend):[0-9]+)+$")
#: The longest key a copy repeats whole: room is kept for ``~requeue:`` (the longer mark) and
#: the 19 digits of the largest id (BIGINT), so whatever id a suffix names, it fits after it.
ROOT_KEY_LIMIT = KEY_LIMIT - max(len(_REQUEUE_MARK), len(_RESEND_MARK)) - len(str(MAX_ID))
_DIGEST_MARK = "~sha256:"
_DIGEST_LENGTH = 32


def root_key(key: str) -> str:
    """What the key of a message and the keys of all its copies have in common.

    ``key`` without its ``~requeue:<id>`` and ``~resend:<id>`` suffixes, in any
    mix: the original message's key. One longer than :data:`ROOT_KEY_LIMIT`
    (227) characters, which a copy could not repeat whole next to a suffix for
    a 19-digit id, stands for itself shortened to exactly that length: its
    first 187 characters, ``~sha256:`` and 32 hex digits of the SHA-256 of the
    whole. Applied to a copy's key it gives the same string as applied to the
    original's, so a handler that derives a side effect's identity from it
    (the email handler's ``Message-ID``) treats every copy as the same delivery.
    """
    stem = _COPY_SUFFIXES.sub("", key)
    if len(stem) <= ROOT_KEY_LIMIT:
        return stem
    digest = hashlib.sha256(stem.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_LENGTH]
    return f"{stem[: ROOT_KEY_LIMIT - len(_DIGEST_MARK) - _DIGEST_LENGTH]}{_DIGEST_MARK}{digest}"


def _suffixed(key: str, suffix: str) -> str:
    """``key`` and ``suffix``; when that would not fit the column, :func:`root_key` of ``key`` and it."""
    if len(key) + len(suffix) <= KEY_LIMIT:
        return key + suffix
    return root_key(key) + suffix


def requeued_key(key: str | None, old_id: int) -> str | None:
    """The idempotency key of the requeued copy of message ``old_id`` whose key is ``key``.

    ``<key>~requeue:<old id>``; when that would not fit the column, the suffix
    follows :func:`root_key` of ``key`` instead (the original's key, or its
    stand-in, without the earlier copies' suffixes). A key is never simply cut
    short: its :func:`root_key`, which handlers may derive identities from, is
    the original's at any length.
    The suffix names the message copied, and a message is requeued at most
    once, so the copy's key is unique for its route (it never equals the
    original's), and a copy of a copy gets its own suffix in turn.
    """
    return None if key is None else _suffixed(key, f"{_REQUEUE_MARK}{old_id}")


def resent_key(key: str | None, new_id: int) -> str | None:
    """The idempotency key of copy ``new_id`` that resending a message whose key is ``key`` made.

    ``<key>~resend:<new id>``, or :func:`root_key` of ``key`` and that suffix
    when the whole would not fit the column, as in :func:`requeued_key`. The
    suffix names the copy itself, not the message copied: a message may be
    resent any number of times, and each copy needs a key of its own. An id is
    never handed out twice, so no two copies share a key, however often one
    message is resent and at any key length.
    """
    return None if key is None else _suffixed(key, f"{_RESEND_MARK}{new_id}")
