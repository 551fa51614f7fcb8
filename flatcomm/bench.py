"""``python -m flatcomm.bench``: the benchmark CLI, :mod:`flatcomm.tools.bench` (a tool, apart from the library).

Importing this module does nothing; only running it imports the tool.
"""
if __name__ == "__main__":
    import sys

    from flatcomm.tools.bench import main

    sys.exit(main())
