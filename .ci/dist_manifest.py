"""The sdist carries every C++/CUDA source and header of csrc/ and the package's data files.

    python .ci/dist_manifest.py dist/flatcomm-X.tar.gz [checkout root]

(a wheel built from an sdist without the headers fails: ``../core/codec.h: No such file``).
"""
from __future__ import annotations

import sys
import tarfile
from pathlib import Path

SOURCES = (".h", ".cuh", ".cu", ".cpp")
REQUIRED = ("pyproject.toml", "setup.py", "LICENSE", "README.md", "flatcomm/py.typed", "flatcomm/_C.pyi", "flatcomm/_version.py",
            "flatcomm/tools/bench/kernels.py")


def missing(sdist: Path, root: Path) -> list:
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = {p.relative_to(root).as_posix() for p in (root / "csrc").rglob("*") if p.suffix in SOURCES}
    return sorted((want | set(REQUIRED)) - names)


def main(argv: list) -> int:
    sdist, root = Path(argv[1]), Path(argv[2] if len(argv) > 2 else ".").resolve()
    gone = missing(sdist, root)
    if gone:
        print(f"{sdist.name} lacks {len(gone)} file(s): " + ", ".join(gone), file=sys.stderr)
        return 1
    print(f"{sdist.name}: every csrc source and header, and the package data, present")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
