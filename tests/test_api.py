"""The user-facing API: signatures help() shows, residual types, Handle as dist.Work, clear errors."""
from __future__ import annotations

import datetime
import inspect

import pytest
import torch
import torch.distributed as dist

import flatcomm
import flatcomm.collectives as C
import flatcomm.ddp


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group in this process (the collectives' argument checks run before any exchange)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_all_reduce_tensor_residual_is_a_clear_type_error(one_rank):
    g = torch.randn(1000)
    with pytest.raises(TypeError, match=r"all_reduce's residual is a flatcomm.ErrorFeedback .*not a Tensor"):
        C.all_reduce(g, codec="int8", residual=torch.zeros(1000))
    with pytest.raises(TypeError, match="must be a flatcomm.ErrorFeedback, got dict"):
        C.all_reduce(g, codec="int8", residual={"client": torch.zeros(1000)})


@pytest.mark.parametrize("kind", ["tensor", "ef"])
def test_one_stage_collectives_take_both_residual_types(one_rank, kind):
    n = 1003  # odd: not a multiple of any block
    x = torch.randn(n, generator=torch.Generator().manual_seed(14), dtype=torch.float64).float()

    def res(numel):
        ef = C.ErrorFeedback.zeros(numel)
        return ef.client if kind == "tensor" else ef

    out = torch.empty(n)
    C.reduce_scatter(out, x.clone(), codec="int8", residual=res(n))
    assert torch.equal(out, x)  # one rank sends nothing: lossless
    gathered = torch.empty(n)
    r = res(n)
    kept = r if kind == "tensor" else r.client
    kept.fill_(0.5)  # a residual left by an earlier lossy step: one rank sends it, losslessly
    C.all_gather(gathered, x.clone(), codec="int4", residual=r)
    assert torch.equal(gathered, x + 0.5) and not kept.any()
    # an ErrorFeedback is checked like a Tensor (its client is the residual)
    with pytest.raises(ValueError, match="residual must be a contiguous float32 tensor of 1003 values, got .* 1002"):
        C.reduce_scatter(out, x, codec="int8", residual=res(n - 1))
    with pytest.raises(ValueError, match="residual must be a contiguous float32 tensor of 1003 values"):
        C.all_gather(gathered, x, codec="int8", residual=res(n + 1))
    with pytest.raises(TypeError, match="reduce_scatter's residual must be an fp32 Tensor or a flatcomm.ErrorFeedback"):
        C.reduce_scatter(out, x, codec="int8", residual=[0.0] * n)


def test_handle_has_work_methods(one_rank):
    g = torch.randn(4099)
    want = g.clone()
    h = C.all_reduce(g, codec="fp32", async_op=True)
    out = h.wait(datetime.timedelta(seconds=30))
    assert out is g and torch.equal(g, want)
    assert h.is_completed() and h.is_success() and h.exception() is None
    assert h.result()[0] is g
    assert h.wait(datetime.timedelta(0)) is g  # Work's default: no limit
    for bad in (-1, 0, "1", True):
        with pytest.raises(ValueError, match="Handle.wait timeout must be seconds > 0"):
            h.wait(bad)


def test_handle_reports_a_failed_collective():
    import concurrent.futures

    f: concurrent.futures.Future = concurrent.futures.Future()
    h = C.Handle(f, torch.zeros(3))
    assert not h.is_completed() and not h.is_success() and h.exception() is None
    with pytest.raises(TimeoutError, match="did not finish within 0.01 s"):
        h.wait(0.01)
    f.set_exception(RuntimeError("peer gone"))
    assert h.is_completed() and not h.is_success()
    assert isinstance(h.exception(), RuntimeError)
    with pytest.raises(RuntimeError, match="peer gone"):
        h.result()


def test_register_signature_is_explicit():
    sig = inspect.signature(flatcomm.ddp.register)
    assert not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    state_params = set(inspect.signature(flatcomm.ddp.State).parameters) - {"model"}
    assert state_params <= set(sig.parameters), state_params - set(sig.parameters)
    for name in ("error_feedback", "mode", "group", "chunks", "tuner", "topology", "start_step"):
        assert name in (flatcomm.ddp.register.__doc__ or ""), name


def test_register_on_a_non_ddp_module_is_a_clear_error():
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got Linear"):
        flatcomm.ddp.register(torch.nn.Linear(2, 2), "int8")
    with pytest.raises(TypeError, match="got Tensor"):
        flatcomm.ddp.register(torch.zeros(2), "int8")


def test_every_library_module_has_all():
    import importlib
    import pkgutil

    missing = []
    for m in pkgutil.walk_packages(flatcomm.__path__, "flatcomm."):
        if m.name.startswith(("flatcomm.tools", "flatcomm.integrations")) or m.name in (
                "flatcomm._version", "flatcomm._C", "flatcomm.bench", "flatcomm.tune", "flatcomm.demo"):
            continue
        mod = importlib.import_module(m.name)
        names = getattr(mod, "__all__", None)
        if names is None:
            missing.append(m.name)
            continue
        for n in names:
            assert hasattr(mod, n), f"{m.name}.__all__ names {n!r}, which it lacks"
    assert not missing, f"modules without __all__: {missing}"
