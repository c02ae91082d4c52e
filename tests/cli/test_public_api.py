"""The public API (issue 14): ``pploader.__all__`` is exactly the list documented in
docs/integration.md ("Public API"), every documented name imports, and the internals that
left the top level stay reachable through their subpackages."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import pploader

DOC = Path(__file__).resolve().parents[2] / "docs" / "integration.md"


def documented_names() -> list[str]:
    """The names listed in the "Public API" section, in order (each as `name`)."""
    text = DOC.read_text()
    start = text.index("## Public API")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else None]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "`" in ln]
    return [n for row in rows for n in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`",
                                                   row.split("|")[2])]


def test_all_is_the_documented_list() -> None:
    names = documented_names()
    assert len(names) == len(set(names)), "a name is listed twice"
    assert pploader.__all__ == ["__version__", *names]
    assert pploader.__all__ == ["__version__", *pploader._EXPORTS]


def test_every_documented_name_imports() -> None:
    for name in documented_names():
        value = getattr(importlib.import_module("pploader"), name)
        assert value is not None, name
        module = importlib.import_module(f"pploader.{pploader._EXPORTS[name]}")
        assert getattr(module, name) is value, name
    namespace: dict = {}
    exec("from pploader import *", namespace)  # noqa: S102 - the star import users write
    assert set(pploader.__all__) <= set(namespace)


def test_internals_stay_reachable_through_their_subpackages() -> None:
    from pploader.io.read import Reader
    from pploader.planning.checkpoint import TensorEntry, parse_header
    from pploader.planning.plan import plan_all, plan_mtp, plan_rank
    assert all((Reader, TensorEntry, parse_header, plan_all, plan_mtp, plan_rank))
    for name in ("parse_header", "TensorEntry", "plan_mtp", "plan_rank", "Reader"):
        assert name not in pploader.__all__
        with pytest.raises(AttributeError):
            getattr(pploader, name)


def test_public_api_lists_and_lazy_exports_agree() -> None:
    assert pploader.__all__ == ["__version__", *pploader._EXPORTS]
    for name in pploader._EXPORTS:
        assert getattr(pploader, name) is not None
