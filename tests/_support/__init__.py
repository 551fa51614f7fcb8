"""Helpers the test modules share (imported as ``_support.<topic>``; tests/ is on sys.path under
pytest and in the ranks that flatcomm.tools.spawn starts)."""
