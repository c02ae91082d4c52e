"""Integrations of pploader with modeling libraries.

``pploader.integrations.hf``: build one pipeline stage of a transformers model (meta device,
only the stage's layers materialised), load it through pploader and run a pipeline forward.
Importing this package does not import transformers; import the submodule you need.
"""
from __future__ import annotations

__all__: list[str] = []
