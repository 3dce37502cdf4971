"""Tests that register mixers or architectures restore the library's tables afterwards."""

from __future__ import annotations

import sys


class SavedTables:
    """``memory_mixer.RULES``, ``models.MIXERS`` and each of ``extra`` (dicts or lists) as they are now;
    :meth:`restore` puts them back in place and forgets the ``modules`` imported meanwhile (the state of a
    new process). As a context manager it restores on exit."""

    def __init__(self, *extra, modules=()):
        from lineage_jax.layers.memory_mixer import RULES
        from lineage_jax.models import MIXERS

        self.saved = [(t, t.copy()) for t in (RULES, MIXERS, *extra)]
        self.modules = tuple(modules)

    def restore(self) -> None:
        for table, items in self.saved:
            if isinstance(table, dict):
                table.clear()
                table.update(items)
            else:
                table[:] = items
        for module in self.modules:
            sys.modules.pop(module, None)

    def __enter__(self) -> "SavedTables":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
