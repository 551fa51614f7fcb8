"""benchmarks/gpu_check.py --collectives: flatcomm.collectives on CUDA tensors over a world-size-1
NCCL group against the same calls on CPU tensors over gloo, bitwise (streams, CUDA-aware futures, the
DDP hook, a DiLoCo outer sync)."""
from __future__ import annotations

import time
from typing import Callable, List, Sequence

import torch

from gpu_check_common import _fmt, bits

SPIN_CYCLES = 20_000_000  # torch.cuda._sleep before writing an input: ~10 ms of a busy caller stream


def collectives_section(device: torch.device, seed: int, max_seconds: float, self_test: bool = False) -> dict:
    """flatcomm.collectives on ``device`` tensors over a world-size-1 NCCL group, bitwise against the
    same calls on CPU tensors over gloo (world size 1 too, same process, file:// rendezvous). With
    self_test (CPU) the "device" group is a second gloo group: it exercises this code, not NCCL.

    Every case runs twice: as flatcomm does at world size 1 (local copies), and with
    ``flatcomm.comm.groups.EXCHANGE_ALONE``, which sends through torch.distributed anyway so that the NCCL
    calls and their stream hand-offs run on a one-GPU machine. On CUDA every input is written on the
    caller's stream behind a ~10 ms ``torch.cuda._sleep`` over a NaN poison, so a collective that does
    not wait for the caller's stream reads NaN; asynchronous results are read on another stream right
    after ``get_future().wait()`` or ``Handle.wait()``, so a future that is not CUDA-aware reads them
    before the collective has run; some callers run on a non-default stream."""
    import contextlib
    import shutil
    import tempfile
    from datetime import timedelta

    import torch.distributed as dist
    from flatcomm import collectives as C
    from flatcomm.comm import groups
    from flatcomm import ddp as fddp

    cuda = device.type == "cuda"
    if not dist.is_available():
        return {"skipped": "torch.distributed is not available"}
    if cuda and not dist.is_nccl_available():
        return {"skipped": "torch.distributed has no NCCL"}
    if dist.is_initialized():
        return {"skipped": "a default process group already exists"}
    t0 = time.monotonic()
    out: dict = {"passed": 0, "failed": 0, "failures": [], "skipped_cases": 0}
    tmp = tempfile.mkdtemp(prefix="flatcomm_gpu_check_")
    if cuda:
        if device.index is None:  # torch.cuda.set_device needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"file://{tmp}/rendezvous",
                            rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        dev_group = dist.new_group([0], backend="nccl" if cuda else "gloo")
        cpu_group = dist.new_group([0], backend="gloo")
        g = torch.Generator().manual_seed(seed)
        other = torch.cuda.Stream(device) if cuda else None  # where async results are consumed
        caller = torch.cuda.Stream(device) if cuda else None  # a non-default caller stream

        def on(stream):
            return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

        def stage(dev: torch.device, *xs: torch.Tensor) -> List[torch.Tensor]:
            """The xs on dev. On CUDA each is written on the current stream behind a spin, over NaN,
            after all the uploads (a pageable upload may wait for the stream and hide the spins)."""
            if dev.type != "cuda":
                return [x.clone() for x in xs]
            srcs = [x.to(dev) for x in xs]
            torch.cuda.synchronize(dev)
            outs = []
            for src in srcs:
                d = torch.full_like(src, float("nan"))
                torch.cuda._sleep(SPIN_CYCLES)
                d.copy_(src)
                outs.append(d)
            return outs

        def consume(run, dev: torch.device, how: str):
            """run(async_op) -> (handle or None, tensors the call writes); their values, read on the
            caller's stream (sync) or on another one after the future's / handle's wait (CUDA)."""
            h, ts = run(how != "sync")
            if how == "sync" or dev.type != "cuda":
                if how == "future":
                    h.get_future().wait()
                elif how == "handle":
                    h.wait()
                vals = [t.clone() for t in ts]
            else:
                with torch.cuda.stream(other):
                    if how == "future":
                        h.get_future().wait()
                    else:
                        h.wait()
                    vals = [t.clone() for t in ts]
                torch.cuda.synchronize(dev)
            return [v.cpu() for v in vals]

        def compare(name: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
            bad = [i for i, (a, b) in enumerate(zip(got, want))
                   if a.shape != b.shape or not torch.equal(bits(a), bits(b))]
            if bad or len(got) != len(want):
                where = []
                for i in bad[:3]:
                    a, b = got[i].reshape(-1), want[i].reshape(-1)
                    if a.shape != b.shape:
                        where.append(f"tensor {i}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                        continue
                    j = int((bits(a) != bits(b)).nonzero()[0])
                    where.append(f"tensor {i}: {int((bits(a) != bits(b)).sum())} of {a.numel()} differ, "
                                 f"first [{j}] {_fmt(a, j)} vs cpu {_fmt(b, j)}")
                fail(f"{name}: " + "; ".join(where or ["count mismatch"]))
            else:
                out["passed"] += 1

        def fail(msg: str) -> None:
            out["failed"] += 1
            out["failures"].append(msg)
            print(f"   FAIL {msg}", flush=True)

        def both_exchange_paths(label: str, body: Callable[[str], None]) -> None:
            """body(label) once through flatcomm's own exchange and once via dist (EXCHANGE_ALONE),
            within the time budget; an exception is that case's failure."""
            for alone in (False, True):
                lab = label.replace("]", ", via dist]") if alone else label
                if time.monotonic() - t0 > max_seconds:
                    out["skipped_cases"] += 1
                    continue
                groups.EXCHANGE_ALONE = alone
                try:
                    body(lab)
                except Exception as e:  # noqa: BLE001
                    fail(f"{lab}: {type(e).__name__}: {e}")
                finally:
                    groups.EXCHANGE_ALONE = False

        def run_case(name: str, make_run, how: str, on_caller: bool) -> None:
            """make_run(dev, group) -> run(async_op); compared device (as `how`) vs cpu (sync)."""
            def body(label: str) -> None:
                want = consume(make_run(torch.device("cpu"), cpu_group), torch.device("cpu"), "sync")
                with on(caller if on_caller else None):
                    got = consume(make_run(device, dev_group), device, how)
                compare(label, got, want)

            both_exchange_paths(f"{name} [{how}{', caller stream' if on_caller else ''}]", body)

        hows = ("sync", "future", "handle")
        k = 0

        def how_next():
            nonlocal k
            k += 1
            return hows[k % 3], k % 2 == 0

        # all_reduce: fp32 / int8 / sign, with error feedback, chunks 1 and 3, two steps each
        for codec in ("fp32", "int8", "sign"):
            for chunks in (1, 3):
                n = 1000 if chunks == 1 else 300_001
                xs = [torch.randn(n, generator=g) * 3 for _ in range(2)]
                rc, rs = torch.randn(n, generator=g) * 0.01, torch.randn(n, generator=g) * 0.01

                def make_run(dev, group, codec=codec, chunks=chunks, xs=xs, rc=rc, rs=rs):
                    rcd, rsd, t = stage(dev, rc, rs, xs[0])
                    ef = C.ErrorFeedback(rcd, rsd)
                    # step 1 synchronous, step 2 as the case says (its input is staged after step 1)
                    C.all_reduce(t, codec=codec, chunks=chunks, residual=ef, group=group)
                    t.copy_(stage(dev, xs[1])[0])

                    def run(async_op):
                        return C.all_reduce(t, codec=codec, chunks=chunks, residual=ef, group=group,
                                            async_op=async_op), [t, ef.client, ef.server]
                    return run

                how, oc = how_next()
                run_case(f"all_reduce {codec} chunks={chunks} n={n} +EF", make_run, how, oc)
        # fp32 without residual: the zero-copy path (one chunk) and the staged one; exact mode
        for chunks, mode in ((1, "ordered"), (3, "ordered"), (3, "exact")):
            x = torch.randn(300_001, generator=g)

            def make_run(dev, group, x=x, chunks=chunks, mode=mode):
                (t,) = stage(dev, x)
                return lambda a: (C.all_reduce(t, codec="fp32", chunks=chunks, mode=mode, group=group,
                                               async_op=a), [t])

            how, oc = how_next()
            run_case(f"all_reduce fp32 {mode} chunks={chunks} no EF", make_run, how, oc)
        # reduce_scatter: fp32 (zero-copy and staged), int8 with a residual; all_gather int8 + EF
        for codec, chunks, ef in (("fp32", None, False), ("fp32", 3, False), ("int8", 3, True)):
            x = torch.randn(300_001, generator=g)
            r = torch.randn(300_001, generator=g) * 0.01

            def make_run(dev, group, x=x, r=r, codec=codec, chunks=chunks, ef=ef):
                dst, res, src = stage(dev, torch.zeros(x.numel()), r, x)
                res = res if ef else None
                return lambda a: (C.reduce_scatter(dst, src, codec=codec, chunks=chunks, residual=res,
                                                   group=group, async_op=a), [dst] + ([res] if ef else []))

            how, oc = how_next()
            run_case(f"reduce_scatter {codec} chunks={chunks or 'auto'}{' +EF' if ef else ''}", make_run, how, oc)
        x, r = torch.randn(4099, generator=g), torch.randn(4099, generator=g) * 0.01

        def make_run(dev, group):
            dst, res, src = stage(dev, torch.zeros(4099), r, x)
            return lambda a: (C.all_gather(dst, src, codec="int8", residual=res, group=group, async_op=a),
                              [dst, res])

        how, oc = how_next()
        run_case("all_gather int8 +EF", make_run, how, oc)

        # one DDP model, three steps, flatcomm.ddp.register(model, "int8"): the gradients are exact
        # in fp32 on both devices (dyadic values), so the hook's results must match bitwise.
        def dyadic(shape, den):
            return torch.randint(-8, 9, shape, generator=g).float() / den

        w = [dyadic((48, 64), 8), dyadic((48,), 8), dyadic((16, 48), 8), dyadic((16,), 8)]
        batches = [(dyadic((8, 64), 4), torch.randint(-2, 3, (8, 16), generator=g).float()) for _ in range(3)]

        def model_on(dev):
            model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
            with torch.no_grad():
                for p, v in zip(model.parameters(), w):
                    p.copy_(v)
            return model.to(dev)

        def ddp_grads(dev, group):
            model = model_on(dev)
            net = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.01)
            st = fddp.register(net, "int8")
            grads = []
            for xb, tb in batches:
                model.zero_grad()
                (net(xb.to(dev)) * tb.to(dev)).sum().backward()
                grads += [p.grad.detach().clone().cpu() for p in model.parameters()]
            steps = len(st.stats["steps"])
            if steps != len(batches):  # the hook must have run (and finished) on every step
                raise RuntimeError(f"the flatcomm hook recorded {steps} steps on {dev}, expected {len(batches)}")
            return grads

        both_exchange_paths("DDP int8 hook, 3 steps [hook]", lambda label: compare(
            label, ddp_grads(device, dev_group), ddp_grads(torch.device("cpu"), cpu_group)))

        # DiLoCo on the device's parameters (fp32 master pinned on the CPU, int8 + EF outer sync, two
        # fragments, one in flight at the end, replicas verified): the weights and masters after 6
        # inner SGD steps must match the CPU run bitwise (the outer step runs on the CPU in both; the
        # pseudo-gradient and the codec on the device). The inner steps take fixed gradients, not a
        # backward pass: after the first outer step the weights have full mantissas (int8 scales are
        # max/127), and a matmul's rounding is cuBLAS's, not ours (the first H200 run: 1 ulp apart).
        # p - 0.125 * g is one correctly rounded operation on either device.
        inner_grads = [[torch.randn(p.shape, generator=g) for p in w] for _ in range(6)]
        def diloco_state(dev, group):
            from flatcomm.diloco import DiLoCo

            model = model_on(dev)
            opt = torch.optim.SGD(model.parameters(), lr=0.125)
            outer = DiLoCo(model, opt, sync_every=4, codec="int8", fragments=2, fragment_sync_delay=1,
                           group=group, verify_every=1)
            for grads in inner_grads:
                for p, gr in zip(model.parameters(), grads):
                    p.grad = gr.to(dev)
                opt.step()
            if outer.syncs != 2 or outer.pending is None:
                raise RuntimeError(f"DiLoCo on {dev}: {outer.syncs} syncs applied and "
                                   f"{'one' if outer.pending else 'none'} in flight, expected 2 and one")
            # Where the outer state lives with CUDA parameters (what this case checks): the fp32
            # master and momentum in pinned host memory, the residuals beside the parameters.
            for f in outer.fragments:
                where = [(t.device.type, t.is_pinned()) for t in (f.master, f.momentum)]
                if dev.type == "cuda" and (where != [("cpu", True)] * 2
                                           or any(r.device != dev for r in f.residuals)):
                    raise RuntimeError(f"DiLoCo on {dev}: master / momentum at {where}, residuals on "
                                       f"{sorted({str(r.device) for r in f.residuals})}")
            # Elastic DiLoCo islands with CUDA parameters (master on the host or the device) have a
            # step of their own in gpu_check.sh (gpu_check_islands.py, from the islands branch).
            state = outer.state_dict()  # drains the sync in flight
            outer.close()
            return ([p.detach().cpu().clone() for p in model.parameters()] + [f.master.clone() for f in outer.fragments]
                    + [state["in_flight"]["delta"]])

        both_exchange_paths("DiLoCo int8 +EF, 2 fragments, delay 1 [diloco]", lambda label: compare(
            label, diloco_state(device, dev_group), diloco_state(torch.device("cpu"), cpu_group)))
    finally:
        groups.EXCHANGE_ALONE = False
        dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    out["ok"] = out["failed"] == 0
    out["seconds"] = round(time.monotonic() - t0, 1)
    backend = "NCCL" if cuda else "gloo (CPU: not NCCL)"
    print(f"   collectives, {device} over {backend} vs cpu over gloo, world size 1: {out['passed']} passed, "
          f"{out['failed']} failed, {out['skipped_cases']} skipped ({out['seconds']} s)", flush=True)
    return out
