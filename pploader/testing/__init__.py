"""Test hooks (fault injection): the CLI imports them only if PPLOADER_FAULT is set."""
