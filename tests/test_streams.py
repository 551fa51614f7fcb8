"""The CUDA stream handling of the collectives stays off the CPU path (the GPU side is checked by
benchmarks/gpu_check.py --collectives, which the gpu_check self-test runs with gloo)."""
import threading

import torch

from flatcomm.comm import groups, streams as _streams, worker
from flatcomm import collectives as C
from flatcomm.tools import spawn


def test_for_call_is_none_for_cpu_tensors():
    assert _streams.for_call(None, torch.device("cpu")) is None
    assert _streams.for_call(123, torch.empty(1).device) is None


def test_on_worker_leaves_cpu_bodies_alone():
    def fn():
        pass

    assert worker._on_side(fn, None) is fn
    assert worker._on_side(fn, None, (torch.empty(1),)) is fn


def test_submit_runs_in_order_on_the_group_worker():
    seen = []
    futs = [worker.submit(worker.key_of(None), torch.device("cpu"),  # (no process group: its own worker)
                      lambda i=i: seen.append((i, threading.current_thread().name))) for i in range(5)]
    for f in futs:
        f.result(10)
    assert [i for i, _ in seen] == list(range(5))
    assert all(name.startswith("flatcomm") for _, name in seen)


def _rank(rank, world):
    def boom(*a, **k):
        raise AssertionError("CallStreams built for CPU tensors")

    _streams.CallStreams = boom  # any use on the CPU path fails the run
    out = {}
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300_001, generator=g)
    for alone in (False, True):
        groups.EXCHANGE_ALONE = alone  # world size 1 through gloo's all_to_all / all_gather
        t, ef = x.clone(), C.ErrorFeedback.zeros(x.numel())
        C.all_reduce(t, codec="int8", chunks=3, residual=ef)
        h = C.all_reduce(t, codec="int8", chunks=3, residual=ef, async_op=True)
        fut_val = h.get_future().wait()
        assert fut_val is t and h.is_completed()
        rs = torch.empty_like(x)
        C.reduce_scatter(rs, x, codec="fp32")
        ex = x.clone()
        C.all_reduce(ex, mode="exact", chunks=3)
        out[alone] = [t, ef.client, ef.server, rs, ex]
    groups.EXCHANGE_ALONE = False
    same = [torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(out[False][3:], out[True][3:])]
    # Without the forced exchange one rank compresses nothing: int8 returns the input, no residual.
    t, client, server = out[False][:3]
    alone_exact = [torch.equal(t, x), not client.any(), not server.any()]
    # Through the exchange the codec runs: error feedback keeps what it did not send.
    t, client, server = out[True][:3]
    fed = [bool(client.any()), bool(torch.isfinite(t).all())]
    return same + alone_exact + fed


def test_cpu_path_never_builds_streams_and_world1_exchange_matches():
    (eq,) = spawn.run(1, _rank, timeout_s=60.0)
    assert all(eq), eq
