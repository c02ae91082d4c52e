"""argparse types made from the option table (pploader/arguments.py).

Shared by the CLI's parser (cli_args.py) and ``pploader bench``'s (bench/command.py) without a
cycle between them; imports nothing heavy (``--help`` never imports torch).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from .arguments import BY_FLAG, Spec
from .errors import ArgumentError

__all__ = ["typed", "text"]


def typed(flag: str, row: Optional[Spec] = None) -> Callable[[str], Any]:
    """The argparse ``type`` of ``flag`` from the option table (pploader/arguments.py): the
    text parsed and range-checked there; a bad value is one line naming the accepted range."""
    row = row or BY_FLAG[flag]

    def parse(value: str) -> Any:
        try:
            return row.parse(value)  # type: ignore[union-attr]
        except ArgumentError as exc:
            detail = exc.detail.removeprefix(f"{flag}=").removeprefix(f"{flag}: ")
            detail = detail.removeprefix(f"{row.name}=")  # type: ignore[union-attr]
            raise argparse.ArgumentTypeError(detail) from None
    parse.__name__ = row.name
    parse.spec = row  # type: ignore[attr-defined]  # the generated option test reads it
    return parse


def text(what: str) -> Callable[[str], str]:
    """A non-empty value (a path or a name; whether it exists is checked by its command)."""
    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{value!r}: empty; give {what}")
        return value
    parse.__name__ = "text"
    return parse
