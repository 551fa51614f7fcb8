"""The error for a codec name that is not one: "did you mean" for another case or a dtype name."""
from __future__ import annotations

from typing import Sequence

__all__ = ["unknown_codec"]

# Names people write for a codec (torch's dtype names): the error suggests the codec.
_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def unknown_codec(name: object, codecs: Sequence[str]) -> str:
    """The error for a codec name that is not one, with "did you mean" for another case or a dtype name
    (names are matched exactly, in lower case, everywhere a codec is named).

    Args:
        name: what was given.
        codecs: the codec names there are.
    """
    msg = f"flatcomm: unknown codec {name!r}; expected one of {', '.join(codecs)}"
    key = name.strip().lower() if isinstance(name, str) else ""
    guess = key if key in codecs else _ALIASES.get(key)
    if guess:
        msg += f" (did you mean {guess!r}? codec names are lower case)" if guess == key else f" (did you mean {guess!r}?)"
    elif key == "auto":
        msg += " ('auto', in lower case, where the API chooses the codec for you)"
    return msg
