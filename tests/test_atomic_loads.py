"""Loads are transactional: a state dict that fails any check raises and leaves the State exactly
as it was (the DDP hook's State, the FSDP backends, OnebitAdam), and every saved field is checked
(the GradScaler scale, counters, decisions: type, finite, in range).

One 2-rank spawn (real residuals, real DDP buckets): each rank trains a few steps, saves, then
tries every corrupted copy of its own save and compares its whole state before and after.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flatcomm.ddp as fddp
import flatcomm.fsdp as ffsdp
from flatcomm.optim import OnebitAdam, STATE_KEY
from flatcomm.tools import spawn
from flatcomm.autotune import Tuner

Corrupt = Callable[[dict], Any]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(32, 48)
        self.l2 = torch.nn.Linear(48, 8)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _train(rank: int, model, opt, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * s + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _same(a: Any, b: Any) -> bool:
    """Deep equality, tensors bit for bit (NaN equal to itself)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _try_all(snap: Callable[[], Any], load: Callable[[Any], None], good: dict,
             corruptions: Dict[str, Corrupt]) -> List[str]:
    """Every corrupted copy of ``good`` must raise a clear error and change nothing."""
    bad = []
    for name, corrupt in corruptions.items():
        load(copy.deepcopy(good))  # the same state before every case (an accepted one changed it)
        before = snap()
        sd = copy.deepcopy(good)
        got = corrupt(sd)
        sd = sd if got is None else got
        try:
            load(sd)
            bad.append(f"{name}: accepted")
        except (ValueError, TypeError, KeyError) as e:
            if "flatcomm" not in str(e):
                bad.append(f"{name}: not a flatcomm message: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001
            bad.append(f"{name}: raised {type(e).__name__}: {e}")
        if not _same(snap(), before):
            bad.append(f"{name}: the failed load changed the state")
    try:  # the good dict still loads afterwards
        load(copy.deepcopy(good))
    except Exception as e:  # noqa: BLE001
        bad.append(f"the good state dict no longer loads: {e!r}")
    return bad


def _set(key: str, value: Any) -> Corrupt:
    def f(sd):
        sd[key] = value
    return f


def _drop(key: str) -> Corrupt:
    def f(sd):
        del sd[key]
    return f


# ---- DDP --------------------------------------------------------------------------------------------


def _ddp_corruptions(sd: dict) -> Dict[str, Corrupt]:
    first = next(iter(sd["client"]))
    out: Dict[str, Corrupt] = {}
    for k in ("version", "form", "codec", "block_size", "mode", "world_size", "rank", "step", "client",
              "server", "buckets", "decisions", "error_feedback", "tiered"):
        out[f"missing {k}"] = _drop(k)
    for v in (float("nan"), float("inf"), -float("inf"), -1.0, 0.0, "1024", True, [1.0]):
        out[f"scale_seen {v!r}"] = _set("scale_seen", v)
    for v in (-1, True, 2.5, "3", None):
        out[f"step {v!r}"] = _set("step", v)
    for v in ("yes", 1, None):
        out[f"tiered {v!r}"] = _set("tiered", v)
        out[f"error_feedback {v!r}"] = _set("error_feedback", v)

    def bucket_twice(d):
        d["buckets"] = [d["buckets"][0] + [d["buckets"][0][0]]] + d["buckets"][1:]

    def bucket_unknown(d):
        d["buckets"] = d["buckets"] + [["no.such.param"]]

    def bucket_entry_not_list(d):
        d["buckets"] = d["buckets"] + ["l1.weight"]

    def nan_residual(d):
        d["client"][first] = d["client"][first].clone()
        d["client"][first].view(-1)[3] = float("nan")

    def double_residual(d):
        d["server"][first] = d["server"][first].double()

    def decisions_garbage(d):
        d["decisions"] = [["not", "a", "decision", "entry"]]

    out.update({"bucket lists a parameter twice": bucket_twice, "bucket names an unknown parameter": bucket_unknown,
                "bucket entry is not a list": bucket_entry_not_list, "buckets not a list": _set("buckets", "l1"),
                "NaN client residual": nan_residual, "float64 server residual": double_residual,
                "decisions garbage": decisions_garbage, "decisions not a list": _set("decisions", {}),
                "not a dict": lambda d: 42, "rank of another rank": _set("rank", 1 - d_rank(sd))})
    return out


def d_rank(sd: dict) -> int:
    return int(sd["rank"])


def _ddp_snap(state) -> Any:
    sd = state.state_dict()
    return sd, state.replay, state.replay_tiered, state.step, state.scale_seen, dict(state.decisions)


def _ddp_case(rank: int, codec: str, **opts) -> List[str]:
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.002)  # a few buckets after DDP's rebuild
    state = fddp.register(ddp, codec, **opts)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(rank, ddp, opt, 3)
    good = state.state_dict()
    good["scale_seen"] = 1024.0  # as if a GradScaler had been seen
    state.load_state_dict(copy.deepcopy(good))
    bad = _try_all(lambda: _ddp_snap(state), state.load_state_dict, good, _ddp_corruptions(good))
    _train(rank, ddp, opt, 1)  # and it trains on
    return [f"DDP {codec}: {b}" for b in bad]


# ---- FSDP (the backends alone: their loads need no FSDP model) ---------------------------------------


def _fsdp_corruptions(sd: dict, prefix: str) -> Dict[str, Corrupt]:
    keys = [k for k in sd if k.startswith(prefix) and not k.endswith("__")]
    first = keys[0]
    out: Dict[str, Corrupt] = {}

    def nan(d):
        d[first] = d[first].clone()
        d[first][0] = float("nan")

    out["NaN residual"] = nan
    out["float64 residual"] = lambda d: d.__setitem__(first, d[first].double())
    out["a list, not a tensor"] = lambda d: d.__setitem__(first, [0.0])
    out["not a dict"] = lambda d: [1, 2]
    for k in [k for k in sd if k.endswith("__step__")]:
        out["step -1"] = _set(k, torch.tensor(-1))
        out["step float"] = _set(k, torch.tensor(2.5))
        out["step a string"] = _set(k, "3")
    return out


def _fsdp_case(rank: int) -> List[str]:
    bad = []
    for make in (lambda: ffsdp.ReduceScatter("int8", start_step=2), lambda: ffsdp.FSDP1State("int8", start_step=2)):
        st = make()
        p = st._prefix()
        good = {f"{p}a": torch.randn(64), f"{p}b": torch.randn(40)}
        if isinstance(st, ffsdp.FSDP1State):
            good.update({f"{p}u.client": torch.randn(30), f"{p}u.server": torch.randn(30)})
        good[f"{p}__step__"] = torch.tensor(5)
        st.load_state_dict(copy.deepcopy(good))
        good = st.state_dict()
        bad += [f"{type(st).__name__}: {b}" for b in
                _try_all(st.state_dict, st.load_state_dict, good, _fsdp_corruptions(good, p))]
    return bad


# ---- OnebitAdam ----------------------------------------------------------------------------------------


def _optim_case(rank: int) -> List[str]:
    torch.manual_seed(0)
    model = Net()
    opt = OnebitAdam(model.parameters(), lr=1e-3, warmup_steps=2, codec="int8")
    _train(rank, model, opt, 4)  # past the warm-up: residuals exist
    good = opt.state_dict()
    out: Dict[str, Corrupt] = {}
    for v in ("abc", -1, True, 2.5, None):
        out[f"steps_done {v!r}"] = lambda d, v=v: d[STATE_KEY].__setitem__("steps_done", v)
    out["world_size 'x'"] = lambda d: d[STATE_KEY].__setitem__("world_size", "x")
    out["residuals not a list"] = lambda d: d[STATE_KEY].__setitem__("residuals", 5)
    out["NaN residual"] = lambda d: d[STATE_KEY]["residuals"][0]["client"].__setitem__(0, float("nan"))
    out["residual entry garbage"] = lambda d: d[STATE_KEY]["residuals"].__setitem__(0, "x")
    out["torch state of another shape"] = lambda d: d["state"][0].__setitem__("exp_avg", torch.zeros(3))
    out["torch state NaN"] = lambda d: d["state"][0]["exp_avg"].__setitem__((0, 0), float("nan"))
    out["torch param groups garbage"] = lambda d: d.__setitem__("param_groups", [{"params": [0]}])
    out["variance_floor NaN"] = lambda d: d[STATE_KEY].__setitem__("variance_floor", float("nan"))
    bad = _try_all(lambda: (opt.state_dict(), opt.steps_done), opt.load_state_dict, good, out)
    return [f"OnebitAdam: {b}" for b in bad]


def _rank_main(rank: int, world: int) -> Dict[str, List[str]]:
    cases: Dict[str, Callable[[], List[str]]] = {
        "ddp int8": lambda: _ddp_case(rank, "int8"),
        "ddp auto": lambda: _ddp_case(rank, "auto", tuner=Tuner(pinned={"bucket0": "int8", "bucket1": "fp32"})),
        "ddp accordion": lambda: _ddp_case(rank, "sign", accordion="int8", start_step=0),
        "fsdp": lambda: _fsdp_case(rank),
        "optim": lambda: _optim_case(rank),
    }
    out = {}
    for name, case in cases.items():
        try:
            out[name] = case()
        except Exception as e:  # noqa: BLE001 - reported by that case's test
            out[name] = [f"raised {type(e).__name__}: {e}"]
    return out


_RESULTS: list = []


def _results():
    if not _RESULTS:
        _RESULTS.append(spawn.run(2, _rank_main, timeout_s=60))
    return _RESULTS[0]


@pytest.mark.parametrize("case", ["ddp int8", "ddp auto", "ddp accordion", "fsdp", "optim"])
def test_failed_load_changes_nothing(case: str) -> None:
    bad = [f"rank {r}: {b}" for r, res in enumerate(_results()) for b in res[case]]
    assert not bad, "\n".join(bad)


def test_scale_seen_checked_at_runtime_too() -> None:
    """A GradScaler scale that turns non-finite or non-positive never rescales the residuals."""
    state = fddp.State("int8")
    state.scale_seen = 1024.0

    class Scaler:
        scale = 1024.0

        def get_scale(self):
            return self.scale

    rescaled: List[float] = []
    state.residuals.rescale = rescaled.append  # type: ignore[method-assign]
    state.grad_scaler = Scaler()
    for s in (float("nan"), float("inf"), -2.0, 0.0):
        state.grad_scaler.scale = s
        state.rescale_for_scaler()
        assert rescaled == [], (s, rescaled)
        assert state.scale_seen == 1024.0, (s, state.scale_seen)
    state.grad_scaler.scale = 2048.0
    state.rescale_for_scaler()
    assert rescaled == [2.0] and state.scale_seen == 2048.0
