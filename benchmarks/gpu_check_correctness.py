"""benchmarks/gpu_check.py's correctness sweep: every op, codec, dtype, block and size on the device
against the CPU, bit for bit (Sweep), and the harness's own negative controls."""
from __future__ import annotations

import time
import traceback
from typing import List, Tuple

import torch

import flatcomm as fc
from gpu_check_common import (BLOCKWISE, CODECS, SPARSE, DT_NAME, DTYPES, REENCODE, STOCHASTIC, Checker, Config,
                              ContextBroken, Interrupted, make_residual, make_x)

HEADROOM = int(fc.ops.sums.DEFAULT_HEADROOM)


class Sweep:
    def __init__(self, ck: Checker, cfg: Config, seed: int) -> None:
        self.ck = ck
        self.cfg = cfg
        self.g = torch.Generator().manual_seed(seed)
        self.counter = 0

    def next_misalign(self) -> bool:
        self.counter += 1
        return self.counter % 3 == 2

    def seed(self) -> int:
        return int(torch.randint(0, 1 << 62, (1,), generator=self.g))

    # encode / encode_into -------------------------------------------------------------------------
    def encode(self, x, codec, b, ratio, residual, stochastic, desc) -> torch.Tensor:
        """Returns the CPU payload (for the decode cases); None if the reference failed."""
        ck = self.ck
        seed = self.seed()
        mis = self.next_misalign()
        kw = dict(block_size=b, ratio=ratio, stochastic=stochastic, seed=seed)
        desc = f"{desc} res={'y' if residual is not None else 'n'} stoch={'y' if stochastic else 'n'}" \
               f"{' misaligned' if mis else ''} seed={seed}"
        n = x.numel()
        k = fc.resolve(codec, b, ratio).k(n)
        lay = (n, codec, b, k)
        out: List[torch.Tensor] = []

        def case():
            ck.at("encode", "cpu reference")
            r_ref = residual.clone() if residual is not None else None
            p_ref = fc.encode(x, codec, residual=r_ref, **kw)
            out.append(p_ref)
            ck.at("encode")
            xd = ck.to_dev(x, mis)
            rd = ck.to_dev(residual, mis)
            ck.prepoison(p_ref.numel())
            p = fc.encode(xd, codec, residual=rd, **kw)
            ck.check("encode", desc, "payload", p_ref, p, lay)
            if residual is not None:
                ck.check("encode", desc, "residual", r_ref, rd)
            ck.check("encode", desc, "x unchanged", x, xd)
            ck.at("encode_into")
            rd2 = ck.to_dev(residual, mis)
            buf = ck.poisoned(p_ref.numel(), torch.uint8, mis)
            ret = fc.encode(xd, codec, residual=rd2, out=buf, **kw)
            if ret.data_ptr() != buf.data_ptr():
                ck.fail("encode_into", desc, "out= did not return the out tensor")
            ck.check("encode_into", desc, "payload (poisoned out)", p_ref, buf, lay)
            if residual is not None:
                ck.check("encode_into", desc, "residual", r_ref, rd2)

        ck.run("encode", desc, case)
        return out[0] if out else None

    # decode / decode_into -------------------------------------------------------------------------
    def decode(self, p_ref, codec, n, b, ratio, dtype, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        kw = dict(block_size=b, ratio=ratio)
        desc = f"{desc} -> {DT_NAME[dtype]}{' misaligned' if mis else ''}"

        def case():
            ck.at("decode", "cpu reference")
            ref = fc.decode(p_ref, codec, n, dtype=dtype, **kw)
            ck.at("decode")
            pd = ck.to_dev(p_ref, mis)
            ck.prepoison(ref.numel() * ref.element_size())
            ck.check("decode", desc, "values", ref, fc.decode(pd, codec, n, dtype=dtype, **kw))
            ck.at("decode_into")
            out = ck.poisoned(n, dtype, mis)
            fc.decode(pd, codec, n, out=out, **kw)
            ck.check("decode_into", desc, "values (poisoned out)", ref, out)
            ck.check("decode", desc, "payload unchanged", p_ref, pd)

        ck.run("decode", desc, case)

    # decode_sum / decode_sum_into ------------------------------------------------------------------
    def decode_sum(self, P, codec, n, b, ratio, scale, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        kw = dict(block_size=b, ratio=ratio, scale=scale)
        desc = f"{desc} W={P.shape[0]} scale={scale:g}{' misaligned' if mis else ''}"

        def case():
            ck.at("decode_sum", "cpu reference")
            ref = fc.decode_sum(P, codec, n, **kw)
            ck.at("decode_sum")
            Pd = ck.to_dev(P, mis)
            ck.prepoison(4 * n)
            ck.check("decode_sum", desc, "sum", ref, fc.decode_sum(Pd, codec, n, **kw))
            ck.at("decode_sum_into")
            out = ck.poisoned(n, torch.float32, mis)
            fc.decode_sum(Pd, codec, n, out=out, **kw)
            ck.check("decode_sum_into", desc, "sum (poisoned out)", ref, out)

        ck.run("decode_sum", desc, case)

    # decode_sum_encode / _into ---------------------------------------------------------------------
    def decode_sum_encode(self, P, codec, n, b, ratio, scale, rc, rb, residual, stochastic, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        seed = self.seed()
        kw = dict(block_size=b, ratio=ratio, scale=scale, reencode=rc, reencode_block_size=rb,
                  stochastic=stochastic, seed=seed)
        desc = (f"{desc} W={P.shape[0]} scale={scale:g} -> {rc} B{rb} res={'y' if residual is not None else 'n'} "
                f"stoch={'y' if stochastic else 'n'}{' misaligned' if mis else ''} seed={seed}")
        lay = (n, rc, rb, 0)

        def case():
            ck.at("decode_sum_encode", "cpu reference")
            r_ref = residual.clone() if residual is not None else None
            ref = fc.decode_sum(P, codec, n, residual=r_ref, **kw)
            ck.at("decode_sum_encode")
            Pd = ck.to_dev(P, mis)
            rd = ck.to_dev(residual, mis)
            ck.prepoison(ref.numel())
            got = fc.decode_sum(Pd, codec, n, residual=rd, **kw)
            ck.check("decode_sum_encode", desc, "payload", ref, got, lay)
            if residual is not None:
                ck.check("decode_sum_encode", desc, "residual", r_ref, rd)
            ck.at("decode_sum_encode_into")
            rd2 = ck.to_dev(residual, mis)
            buf = ck.poisoned(ref.numel(), torch.uint8, mis)
            fc.decode_sum(Pd, codec, n, residual=rd2, out=buf, **kw)
            ck.check("decode_sum_encode_into", desc, "payload (poisoned out)", ref, buf, lay)
            if residual is not None:
                ck.check("decode_sum_encode_into", desc, "residual", r_ref, rd2)

        ck.run("decode_sum_encode", desc, case)

    # ordered_sum ----------------------------------------------------------------------------------
    def ordered_sum(self, X, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        desc = f"{desc} W={X.shape[0]}{' misaligned' if mis else ''}"

        def case():
            ck.at("ordered_sum", "cpu reference")
            ref = fc.ordered_sum(X)
            ck.at("ordered_sum")
            Xd = ck.to_dev(X, mis)
            ck.prepoison(4 * X.shape[1])
            ck.check("ordered_sum", desc, "sum", ref, fc.ordered_sum(Xd))

        ck.run("ordered_sum", desc, case)

    # exact family ---------------------------------------------------------------------------------
    def exact(self, X, eb, headroom, desc) -> None:
        ck = self.ck
        mis = self.next_misalign()
        W, n = X.shape
        desc = f"{desc} W={W} eblock={eb} headroom={headroom}{' misaligned' if mis else ''}"
        nb = -(-n // eb)

        def case():
            ck.at("exact_exponents", "cpu reference")
            E = fc.exact_exponents(X, eb)
            ck.at("exact_exponents")
            Xd = ck.to_dev(X, mis)
            ck.prepoison(4 * nb)
            ck.check("exact_exponents", desc, "exponents [W, n]", E, fc.exact_exponents(Xd, eb))
            ck.check("exact_exponents", desc, "exponents row 0",
                     fc.exact_exponents(X[0], eb), fc.exact_exponents(Xd[0], eb))
            Ed = ck.to_dev(E, mis)
            parts = []
            for r in range(W):
                ck.at("to_exact", f"row {r} cpu reference")
                ref = fc.to_exact(X[r], E, eb, headroom)
                parts.append(ref)
                ck.at("to_exact", f"row {r}")
                ck.prepoison(8 * n)
                ck.check("to_exact", desc, f"row {r}", ref, fc.to_exact(Xd[r], Ed, eb, headroom))
            acc = torch.stack(parts).sum(0)
            accd = ck.to_dev(acc, mis)
            ck.at("from_exact", "cpu reference")
            ref = fc.from_exact(acc, E, eb, headroom)
            ck.at("from_exact")
            ck.prepoison(4 * n)
            ck.check("from_exact", desc, "values", ref, fc.from_exact(accd, Ed, eb, headroom))
            ck.at("exact_sum", "cpu reference")
            ref = fc.exact_sum(X, eb, headroom)
            ck.at("exact_sum")
            ck.prepoison(4 * n)
            ck.check("exact_sum", desc, "sum", ref, fc.exact_sum(Xd, eb, headroom))

        ck.run("exact_exponents", desc, case)

    # the sweep ------------------------------------------------------------------------------------
    def codec_configs(self) -> List[Tuple[str, int, float]]:
        out = []
        for codec in CODECS:
            if codec in BLOCKWISE or codec in SPARSE:  # sparse: `b` is the chunk (keep min(64, b))
                out += [(codec, b, 0.01) for b in self.cfg.blocks]
            elif codec == "topk":
                out += [(codec, 256, r) for r in self.cfg.topk_ratios]
            else:
                out.append((codec, 256, 0.01))
        return out

    def run(self) -> None:
        cfg = self.cfg
        for n in cfg.sizes:
            t0 = time.monotonic()
            cases0 = self.ck.cases
            variants = ("nonfinite",) if n >= cfg.big_n else cfg.variants
            for dtype in cfg.dtypes:
                for variant in variants:
                    self.run_group(n, dtype, variant)
            print(f"  n={n:<8} {self.ck.cases - cases0:5d} cases in {time.monotonic() - t0:6.1f} s; "
                  f"{sum(self.ck.failed.values())} failed checks so far", flush=True)

    def run_group(self, n: int, dtype, variant: str) -> None:
        cfg, g = self.cfg, self.g
        big = n >= cfg.big_n
        base = f"n={n} {DT_NAME[dtype]} {variant}"
        rot = 0
        for codec, b, ratio in self.codec_configs():
            if self.ck.broken or self.ck.out_of_time():
                self.ck.skipped_cases += 1
                continue
            cdesc = f"{base} {codec}" + (f" B{b}" if codec in BLOCKWISE or codec in SPARSE else "") + \
                    (f" ratio={ratio:g}" if codec == "topk" else "")
            rot += 1
            try:
                self.codec_group(n, dtype, variant, codec, b, ratio, cdesc, rot)
            except (Interrupted, KeyboardInterrupt, ContextBroken):
                raise
            except Exception as e:  # noqa: BLE001  (input generation or a reference call in the harness)
                if self.ck.verbose:
                    traceback.print_exc()
                self.ck.fail("encode", cdesc, f"harness error {type(e).__name__}: {e}")
        if self.ck.broken or self.ck.out_of_time():
            return
        # sums
        for W in ((1, 3, 8) if not big else (4,)):
            self.ordered_sum(make_x(g, n, dtype, variant, 256, rows=W), base)
        for i, eb in enumerate(cfg.exact_blocks):
            W = (1, 3, 8, 2)[i % 4]
            headroom = (HEADROOM, 3, 38, HEADROOM)[i % 4]
            self.exact(make_x(g, n, dtype, variant, eb, rows=W), eb, headroom, base)

    def codec_group(self, n, dtype, variant, codec, b, ratio, cdesc, rot) -> None:
        """encode (4 kinds), decode (3 dtypes), decode_sum and decode_sum_encode for one codec."""
        cfg, g = self.cfg, self.g
        big = n >= cfg.big_n
        x = make_x(g, n, dtype, variant, b)
        r = make_residual(g, n, variant, b)
        # encode: with and without error feedback, deterministic and stochastic rounding
        plain = self.encode(x, codec, b, ratio, None, False, cdesc)
        self.encode(x, codec, b, ratio, r, False, cdesc)
        stoch = None
        if codec in STOCHASTIC:
            stoch = self.encode(x, codec, b, ratio, r if big else None, True, cdesc)
            if not big:
                self.encode(x, codec, b, ratio, r, True, cdesc)
        # decode into every output dtype
        for p, tag in ((plain, ""), (stoch, " stoch")):
            if p is None:
                continue
            for od in DTYPES:
                self.decode(p, codec, n, b, ratio, od, cdesc + tag)
        # decode_sum over W payloads of fresh inputs (W = 0 included)
        W = (3, 1, 0, 5)[rot % 4] if not big else 3
        rows = [make_x(g, n, dtype, variant, b) for _ in range(W)]
        P = torch.stack([fc.encode(xr, codec, block_size=b, ratio=ratio) for xr in rows]) if W else \
            torch.zeros(0, fc.wire_bytes(codec, n, block_size=b, ratio=ratio), dtype=torch.uint8)
        scale = 1.0 if rot % 2 else 1.0 / max(W, 1)
        self.decode_sum(P, codec, n, b, ratio, scale, cdesc)
        if codec in SPARSE:  # decode_sum_encode takes no chunked sparse rows (the op refuses them)
            return
        # decode_sum_encode: every reencode codec for small n and fp32 inputs, else a rotation
        if n <= cfg.full_reencode_max_n and dtype == torch.float32:
            targets = REENCODE
        else:
            targets = tuple(dict.fromkeys([REENCODE[(rot + CODECS.index(codec)) % len(REENCODE)],
                                           codec if codec != "topk" else "int8"]))
        for rc in targets:
            rb = b if codec in BLOCKWISE else cfg.blocks[(rot + REENCODE.index(rc)) % len(cfg.blocks)]
            res = make_residual(g, n, variant, rb)
            self.decode_sum_encode(P, codec, n, b, ratio, scale, rc, rb, None, False, cdesc)
            self.decode_sum_encode(P, codec, n, b, ratio, scale, rc, rb, res, False, cdesc)
            if rc in STOCHASTIC:
                self.decode_sum_encode(P, codec, n, b, ratio, scale, rc, rb, res, True, cdesc)


def negative_controls(device: torch.device) -> List[str]:
    """Self-test of the harness: the comparison must flag poison, single-bit flips, -0 vs +0, NaN
    payload bits, shape / dtype mismatches and exceptions; misaligned buffers must really be
    misaligned. Returns the problems found (empty = the harness works)."""
    problems: List[str] = []
    ck = Checker(device, 1e9, False, quiet=True)
    ref = torch.tensor([1.0, -0.0, float("nan"), 2.5])
    poisoned = ck.poisoned(4, torch.float32)
    cases = [
        ("poisoned out", ref, poisoned),
        ("+0 vs -0", ref, torch.tensor([1.0, 0.0, float("nan"), 2.5])),
        ("NaN vs a number", ref, torch.tensor([1.0, -0.0, 2.5, 2.5])),
        ("a number vs NaN", torch.tensor([1.0, -0.0, 2.5, 2.5]), ref),
        ("NaN in a payload's codes", torch.full((48,), 0xFF, dtype=torch.uint8),
         torch.full((48,), 0xFF, dtype=torch.uint8).index_put_((torch.tensor([20]),), torch.tensor([0x7F], dtype=torch.uint8))),
        ("bit flip", torch.arange(40, dtype=torch.uint8), torch.arange(40, dtype=torch.uint8) ^ (
            torch.arange(40) == 37).to(torch.uint8)),
        ("shape", ref, ref[:3].clone()),
        ("dtype", ref, ref.to(torch.bfloat16)),
        ("bf16 poison", ref.to(torch.bfloat16), ck.poisoned(4, torch.bfloat16)),
    ]
    for what, a, b in cases:
        if ck.check("encode", "negative control", what, a, b.to(device), (33, "int8", 32, 0)):
            problems.append(f"check() missed: {what}")
    if not ck.check("encode", "negative control", "equal NaNs", ref, ref.clone().to(device)):
        problems.append("check() flagged identical bits")
    # Which NaN is not compared (a GPU's canonical 0x7fffffff vs x86's propagated payload)...
    other_nan = ref.clone().view(torch.int32).index_put_(
        (torch.tensor([2]),), torch.tensor([0x7FFFFFFF], dtype=torch.int32)).view(torch.float32)
    if not ck.check("encode", "negative control", "other NaN bits", ref, other_nan.to(device)):
        problems.append("check() flagged a NaN with other bits (sign / payload)")
    # ... in floating outputs and in the value region of a cast payload, but not in other bytes.
    p_ref = torch.tensor([0.5, float("nan")]).view(torch.uint8)
    p_got = torch.tensor([0.5, -float("nan")]).view(torch.uint8)
    if not ck.check("encode", "negative control", "fp32 payload NaN bits", p_ref, p_got.to(device), (2, "fp32", 0, 0)):
        problems.append("check() flagged NaN bits in a cast payload's values")
    before = sum(ck.failed.values())
    ck.run("decode", "negative control", lambda: fc.decode(torch.zeros(3, dtype=torch.uint8), "int8", 100))
    if sum(ck.failed.values()) != before + 1:
        problems.append("run() did not record an exception as a failure")
    for dt in (torch.uint8, torch.float32, torch.bfloat16, torch.int64):
        t = ck.empty((3, 5), dt, True)
        if t.data_ptr() % 16 == 0 or not t.is_contiguous() or tuple(t.shape) != (3, 5):
            problems.append(f"misaligned {dt} buffer is aligned or malformed")
    src = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    if not torch.equal(ck.to_dev(src, True).cpu(), src) or ck.to_dev(src).data_ptr() == src.data_ptr():
        problems.append("to_dev() does not copy")
    return problems
