# Type stub of the compiled extension flatcomm._C (csrc/): it registers torch.ops.flatcomm.* and
# exposes a few helpers (build_info, default_headroom, ...). Typed loosely: its functions are
# reached through flatcomm's typed wrappers.
from typing import Any

def __getattr__(name: str) -> Any: ...
