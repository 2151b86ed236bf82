"""Earlier revisions' modules, for a migration that restores or edits the SQL they wrote.

A revision's function bodies are frozen in its module: a later revision that
changes one function of a large body, or a downgrade that puts one back,
reads it from there instead of copying it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

__all__ = ["earlier"]

_VERSIONS = Path(__file__).parent / "versions"


def earlier(number: str) -> ModuleType:
    """The module of revision ``number`` (``"0021"``), loaded from its file apart from alembic's own."""
    path = next(_VERSIONS.glob(f"{number}_*.py"))
    spec = importlib.util.spec_from_file_location(f"_outbox_{number}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
