"""The argument parser both commands use.

argparse answers a bad flag with its whole usage block and then the problem;
in a terminal or a log collector the problem is what matters, so it gets one
line that also says where the full usage is.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
