"""The argument parser both commands use.

argparse answers a bad flag with its whole usage block and then the problem;
in a terminal or a log collector the problem is what matters, so it gets one
line that also says where the full usage is.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineParser", "shown"]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def shown(value: str) -> str:
    """A command-line value quoted for an error line: cut short, bytes that are not UTF-8 as ``\\xff``."""
    try:  # argv bytes that are not UTF-8 arrive as lone surrogates: show the bytes themselves
        raw = value[:40].encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = value[:40].encode("utf-8", "backslashreplace")
    return f"'{raw.decode('utf-8', 'backslashreplace')}'" + ("..." if len(value) > 40 else "")
