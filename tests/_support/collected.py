"""A pytest plugin for tests/test_markers.py (``-p _support.collected``): after collection, one
line per test, ``KEPT`` or ``DROPPED`` by the ``-m`` expression, with its node id and markers."""
from __future__ import annotations


def _line(tag: str, item) -> str:
    return f"{tag} {item.nodeid} {','.join(sorted({m.name for m in item.iter_markers()}))}"


def pytest_deselected(items):
    for item in items:
        print(_line("DROPPED", item))


def pytest_collection_finish(session):
    for item in session.items:
        print(_line("KEPT", item))
