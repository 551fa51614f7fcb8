"""Module paths of earlier releases, importable for one more release: ``import flatcomm.codecs``
gives :mod:`flatcomm.ops.codecs` itself (the same module object, so patches and ``isinstance``
agree) and a ``DeprecationWarning`` naming the new path.

The package was flat until 0.x; its modules now live in subpackages by layer
(``docs/architecture.md``). Each old path is an alias resolved on import by a finder on
``sys.meta_path``; nothing is imported before someone asks for it. Nothing in the package, its
tests, docs or examples uses an old path (``tests/test_old_paths.py`` scans for them).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import Optional

__all__ = ["MOVED", "install"]

# old name (under flatcomm) -> where it lives now
MOVED = {
    "codecs": "ops.codecs",
    "sums": "ops.sums",
    "reference": "ops.reference",
    "cupy_backend": "ops.cupy_backend",
    "topology": "comm.topology",
    "costmodel": "autotune.costmodel",
    "autotune_tiers": "autotune.tiers",
    "ddp_accordion": "ddp.accordion",
    "ddp_adapt": "_training.adapt",
    "ddp_checkpoint": "ddp.checkpoint",
    "ddp_stats": "ddp.stats",
    "fsdp1": "fsdp.fsdp1",
    "fsdp_adapt": "fsdp.adapt",
    "fsdp_hybrid": "fsdp.hybrid",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, name = fullname.rpartition(".")
        if package != __package__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = f"{__package__}.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(f"{spec.name} is deprecated and goes away in the next release: import {new}",
                      DeprecationWarning, stacklevel=2)  # warnings skips the import machinery's frames
        module = importlib.import_module(new)
        module.__dict__["_flatcomm_spec"] = module.__spec__  # exec_module restores it
        return module

    def exec_module(self, module) -> None:
        # The module is the real one, already executed: only recorded under its old name too. The
        # import system has just set its __spec__ to the alias's; give it back its own (reload and
        # pickling by name read it).
        module.__spec__ = module.__dict__.pop("_flatcomm_spec", module.__spec__)


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` once (``import flatcomm`` calls it)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
