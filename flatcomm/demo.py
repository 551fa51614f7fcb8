"""``python -m flatcomm.demo``: the training demo, :mod:`flatcomm.tools.demo` (a tool, apart from the library).

Importing this module does nothing; only running it imports the tool.
"""
__all__: list = []  # a command-line entry point: nothing to import
if __name__ == "__main__":
    import sys

    from flatcomm.tools.demo import main

    sys.exit(main())
