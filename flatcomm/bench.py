"""``python -m flatcomm.bench``: the benchmark CLI, :mod:`flatcomm.tools.bench` (a tool, apart from the library).

Importing this module does nothing; only running it imports the tool.
"""
__all__: list = []  # a command-line entry point: nothing to import
if __name__ == "__main__":
    import sys

    from flatcomm.tools.bench import main

    sys.exit(main())
