"""An ``argparse.ArgumentParser`` whose usage errors are one line (``prog: problem (see --help)``), exit 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """The standard parser, minus the usage block printed before every error."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    def format_help(self) -> str:
        # module docstrings (used as descriptions) quote names in reST ``double backticks``; plain text here
        return super().format_help().replace("``", "")

    def format_usage(self) -> str:
        return super().format_usage().replace("``", "")
