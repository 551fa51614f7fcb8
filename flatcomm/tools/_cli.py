"""What the command-line tools share: argparse types that turn bad values into usage errors (not
tracebacks), ``--version``, sizes written as 64K / 1M / 25M, and progress on stderr (stdout carries
the tables, so ``python -m flatcomm.bench ... > table.txt`` holds only results)."""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, Iterable, List

_UNITS = (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"1.5M"`` -> 1572864, ``"1000"`` -> 1000 (K/M/G are powers of 1024)."""
    s = text.strip().upper()
    mult = dict(_UNITS).get(s[-1:], 1)
    number = s[:-1] if mult > 1 else s
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (a number with an optional K, M or G suffix)") from None
    n = value * mult
    if not (math.isfinite(n) and n >= 1 and n == int(n)):
        raise ValueError(f"{text!r} is not a positive whole number of elements")
    return int(n)


def format_size(n: int) -> str:
    """The inverse of :func:`parse_size` where exact (65536 -> ``64K``); otherwise 3 digits in the largest
    unit below ``n`` (25_000_000 -> ``23.8M``)."""
    for unit, size in _UNITS:
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    for unit, size in _UNITS:
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def sizes(text: str) -> List[int]:
    """argparse type: ``"64K,1M,25M"`` -> element counts."""
    try:
        out = [parse_size(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out:
        raise argparse.ArgumentTypeError("no sizes given")
    return out


def names(allowed: Callable[[], Iterable[str]], what: str) -> Callable[[str], List[str]]:
    """argparse type: a comma-separated list, each name one of ``allowed()`` (called when parsing, so
    the list can come from the library)."""

    def parse(text: str) -> List[str]:
        choices = list(allowed())
        out = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in out if s not in choices]
        if bad or not out:
            hint = [f"{s!r}: did you mean {s.lower()!r}?" for s in bad if s.lower() in choices]  # names are lower case
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad)) or '(none given)'} "
                                             f"(choose from {', '.join(choices)})" + "".join(f"; {h}" for h in hint))
        return out

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def positive(kind: type) -> Callable[[str], object]:
    """argparse type: an int or float > 0."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n int' if kind is int else ' number'}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return v

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def codecs() -> tuple:
    from flatcomm.ops.codecs import CODECS

    return CODECS


def add_version(ap: argparse.ArgumentParser) -> None:
    from flatcomm._version import __version__

    ap.add_argument("--version", action="version", version=f"%(prog)s (flatcomm {__version__})")


def say(prog: str, msg: str) -> None:
    """Progress and notes: stderr, flushed (stdout holds the results)."""
    print(f"[{prog}] {msg}", file=sys.stderr, flush=True)
