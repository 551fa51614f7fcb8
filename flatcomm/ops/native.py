"""Loads the native extension and registers the fake (meta) kernels of every flatcomm op.

The ops themselves are defined in C++ (csrc/registration.cpp); the fake kernels here only compute
output shapes and dtypes, so that torch.compile and torch.library.opcheck can trace through them.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

__all__ = ["extension", "ops"]

try:
    from .. import _C  # noqa: F401  (registers torch.ops.flatcomm.*)
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    raise ImportError(
        "flatcomm's native extension flatcomm._C could not be imported "
        f"({exc}). Build it first: `make build` (or `pip install --no-build-isolation -e .`), "
        "with the same torch version it will run against."
    ) from exc

extension = _C  # the compiled module: wire_bytes, constants, build_info, ...
ops = torch.ops.flatcomm

SIMD_SETS = ("baseline", "avx2", "avx512")  # the kernel builds FLATCOMM_SIMD can name (csrc/cpu/dispatch.cpp)
_simd_warned = False


def simd_setting_warning(requested: Optional[str], info: dict) -> Optional[str]:
    """Why ``FLATCOMM_SIMD=requested`` is not what runs, and what runs instead; None when it is honoured.

    Args:
        requested: the variable's value (None or empty: unset, the best supported set runs).
        info: ``extension.build_info()``: ``simd`` (the set in use), ``simd_supported`` (comma separated).
    """
    want = (requested or "").strip()
    if not want or want == info["simd"]:
        return None
    supported = info["simd_supported"].split(",")
    if want in SIMD_SETS:
        why = f"not supported by this CPU / build (supported: {', '.join(supported)})"
    else:
        close = [s for s in SIMD_SETS if s == want.lower()]
        why = (f"not a kernel set (did you mean {close[0]!r}?)" if close else
               f"not a kernel set of this build (one of {', '.join(SIMD_SETS)}; this CPU: {', '.join(supported)})")
    return f"flatcomm: FLATCOMM_SIMD={want!r} is {why}: the {info['simd']!r} kernels run instead"


def warn_ignored_simd() -> None:
    """Warn (once per process) when $FLATCOMM_SIMD names kernels that do not run; the C++ falls back silently."""
    global _simd_warned
    msg = simd_setting_warning(os.environ.get("FLATCOMM_SIMD"), _C.build_info())
    if msg and not _simd_warned:
        _simd_warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=2)


warn_ignored_simd()


def _same_device(ref: torch.Tensor, *named) -> None:
    """The device check of the C++ ops (ops_common.h check_same_device), in the fake kernels too.

    A mix such as a CPU input with a meta residual dispatches to these fake kernels (the meta key
    wins), which would otherwise return an uninitialised result or leave ``out`` untouched.
    """
    for what, t in named:
        if t is not None and t.device != ref.device:
            raise RuntimeError(f"flatcomm: {what} is on {t.device} but the input is on {ref.device}")


@torch.library.register_fake("flatcomm::encode")
def _encode_fake(x, codec, block_size, k, residual, stochastic, seed):
    _same_device(x, ("residual", residual))
    return x.new_empty((_C.wire_bytes(codec, x.numel(), block_size, k),), dtype=torch.uint8)


@torch.library.register_fake("flatcomm::decode")
def _decode_fake(payload, codec, numel, block_size, k, dtype):
    _C.wire_bytes(codec, numel, block_size, k)  # the real op's argument checks
    return payload.new_empty((numel,), dtype=dtype)


@torch.library.register_fake("flatcomm::decode_sum")
def _decode_sum_fake(payloads, codec, numel, block_size, k, scale):
    _C.wire_bytes(codec, numel, block_size, k)  # the real op's argument checks
    return payloads.new_empty((numel,), dtype=torch.float32)


@torch.library.register_fake("flatcomm::decode_sum_encode")
def _decode_sum_encode_fake(
    payloads, codec, numel, block_size, k, scale, out_codec, out_block_size, residual, stochastic, seed
):
    _same_device(payloads, ("residual", residual))
    nbytes = _C.wire_bytes(out_codec, numel, out_block_size, 0)
    return payloads.new_empty((nbytes,), dtype=torch.uint8)


@torch.library.register_fake("flatcomm::encode_into")
def _encode_into_fake(x, codec, block_size, k, residual, stochastic, seed, payload):
    _same_device(x, ("residual", residual), ("payload", payload))
    return None


@torch.library.register_fake("flatcomm::decode_into")
def _decode_into_fake(payload, codec, numel, block_size, k, out):
    _same_device(payload, ("out", out))
    return None


@torch.library.register_fake("flatcomm::decode_rows_into")
def _decode_rows_into_fake(payloads, codec, row_numel, block_size, out):
    _same_device(payloads, ("out", out))
    _, row_bytes = _C.decode_rows_layout(codec, row_numel, block_size)  # the real op's checks
    if payloads.dim() != 2 or payloads.shape[1] != row_bytes:
        raise RuntimeError(f"flatcomm: payloads must be [rows, {row_bytes}] for codec '{codec}' with row_numel "
                           f"{row_numel}, got shape {list(payloads.shape)}")
    _C.check_rows_cover(payloads.shape[0], row_numel, out.numel())
    return None


@torch.library.register_fake("flatcomm::decode_sum_into")
def _decode_sum_into_fake(payloads, codec, numel, block_size, k, scale, out):
    _same_device(payloads, ("out", out))
    return None


@torch.library.register_fake("flatcomm::decode_sum_encode_into")
def _decode_sum_encode_into_fake(
    payloads, codec, numel, block_size, k, scale, out_codec, out_block_size, residual, stochastic,
    seed, payload,
):
    _same_device(payloads, ("residual", residual), ("payload", payload))
    return None


@torch.library.register_fake("flatcomm::ordered_sum")
def _ordered_sum_fake(x):
    return x.new_empty((x.shape[-1],), dtype=torch.float32)


@torch.library.register_fake("flatcomm::exact_exponents")
def _exact_exponents_fake(x, block_size):
    n = x.shape[-1]
    return x.new_empty(((n + block_size - 1) // block_size,), dtype=torch.int32)


@torch.library.register_fake("flatcomm::to_exact")
def _to_exact_fake(x, exponents, block_size, headroom):
    _same_device(x, ("exponents", exponents))
    return x.new_empty((x.numel(),), dtype=torch.int64)


@torch.library.register_fake("flatcomm::from_exact")
def _from_exact_fake(acc, exponents, block_size, headroom):
    _same_device(acc, ("exponents", exponents))
    return acc.new_empty((acc.numel(),), dtype=torch.float32)


@torch.library.register_fake("flatcomm::exact_sum")
def _exact_sum_fake(x, block_size, headroom):
    return x.new_empty((x.shape[-1],), dtype=torch.float32)


@torch.library.register_fake("flatcomm::p2p_sum_all_reduce_")
def _p2p_sum_all_reduce_fake(flat, scratch, group, pieces, chunks, scale, tag_base=0, *grid):
    _same_device(flat, ("scratch", scratch))
    return None
