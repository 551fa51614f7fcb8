"""flatcomm.diloco: the schedule; one sync against a float64 reference of outer Nesterov SGD on the
averaged pseudo-gradient (with fragments, delay and alpha); replicas bitwise equal after every
sync for every codec (verify_every), and a differing replica named; bf16 parameters with an fp32
master and bf16 residuals; configuration and load errors on every rank, changing nothing; resume
bit for bit at three kill points; a replica that dies or stops during a sync (2 gloo ranks).
Exact mode under permuted ranks, two-level vs flat, DDP and FSDP2 replicas: test_diloco_replicas.py."""
from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from flatcomm import CODECS
import flatcomm
from flatcomm.diloco import DiLoCo, Schedule, split
from flatcomm.diloco.auto import Auto
from flatcomm.tools import spawn

H, STEPS = 4, 12


def _net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    # odd sizes: 13*31+31+31*3+3 = 530 values
    net = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 3))
    return net.to(dtype)


def _train(net, opt, steps, replica, start=0, hooks=()):
    """``steps`` inner steps on replica ``replica``'s own data (batch t is the same in every run)."""
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * replica + t)
        x = torch.randn(8, 13, generator=g).to(next(net.parameters()).dtype)
        opt.zero_grad()
        net(x).float().pow(2).mean().backward()
        opt.step()


def _expect(fn, exc, *words) -> str:
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        return f"missing {missing} in: {e}" if missing else ""
    except Exception as e:  # noqa: BLE001
        return f"wrong exception {e!r}"
    return "no exception"


# ---- the schedule (no communication) ----------------------------------------------------------------


def test_schedule_fragment_i_syncs_at_i_h_over_k():
    s = Schedule(8, 4, 1)
    assert [s.starts(t) for t in range(0, 17)] == [None, None, 1, None, 2, None, 3, None, 0,
                                                   None, 1, None, 2, None, 3, None, 0]
    assert [s.applies(t) for t in range(0, 10)] == [None, None, None, 1, None, 2, None, 3, None, 0]
    assert [Schedule(5, 1, 0).starts(t) for t in (4, 5, 10)] == [None, 0, 0]
    for bad, word in (((6, 4, 0), "multiple"), ((8, 4, 2), "fragment_sync_delay"), ((0, 1, 0), "sync_every"),
                      ((4, 1, -1), "fragment_sync_delay"), ((4, 2.0, 0), "fragments")):
        assert _expect(lambda: Schedule(*bad), ValueError, word) == ""


def test_split_equal_runs_of_values_and_modules():
    net = torch.nn.Sequential(*[torch.nn.Linear(10, 10) for _ in range(4)])
    named = list(net.named_parameters())
    parts = split(named, 4)  # the cuts fall on parameter boundaries: whole parameters
    assert [[x.label for x in p] for p in parts] == [[f"{i}.weight", f"{i}.bias"] for i in range(4)]
    for k in (3, 7, 8, 440):
        parts = split(named, k)
        sizes = [sum(x.stop - x.start for x in p) for p in parts]
        assert len(parts) == k and sum(sizes) == 440 and max(sizes) - min(sizes) <= 2 * 440 // (16 * k) + 1, sizes
        flat = [(x.name, i) for p in parts for x in p for i in range(x.start, x.stop)]
        assert flat == [(n, i) for n, q in named for i in range(q.numel())]  # every value once, in order
    assert [x.label for x in split(named, 8)[0]] == ["0.weight[0:55]"]
    # an MLP of a few large matrices: equal fragments, not 10.6M / 4.6K / 10.6M / 5.3M
    big = torch.nn.Sequential(torch.nn.Linear(230, 460), torch.nn.Linear(460, 230), torch.nn.Linear(230, 230))
    sizes = [sum(x.stop - x.start for x in p) for p in split(list(big.named_parameters()), 4)]
    assert max(sizes) - min(sizes) <= 1, sizes
    odd = torch.nn.Linear(10, 10)
    odd.weight = torch.nn.Parameter(torch.randn(10, 10).t())  # non-contiguous: never cut
    assert [x.label for p in split(list(odd.named_parameters()), 2) for x in p] == ["weight", "bias"]
    mods = split(named, [net[0], net[1], torch.nn.ModuleList([net[2], net[3]])])
    assert [len(p) for p in mods] == [2, 2, 4]
    assert _expect(lambda: split(named, [net[0], torch.nn.ModuleList([net[0], net[1]]), net[2], net[3]]),
                   ValueError, "0.weight", "one fragment") == ""
    assert _expect(lambda: split(named, [net[0], net[1]]), ValueError, "no fragment", "2.weight") == ""
    assert _expect(lambda: split(named, 441), ValueError, "only 440") == ""
    assert _expect(lambda: split(list(odd.named_parameters()), 3), ValueError, "non-contiguous") == ""


# ---- float64 reference ---------------------------------------------------------------------------


class _Reference:
    """float64 outer step of every sync, from the run's own state before it: ``before`` runs ahead
    of DiLoCo's hook each inner step (records every replica's weights when a fragment starts, and
    this replica's local weights when one is applied), ``after`` behind it (compares)."""

    def __init__(self, lr, mu, alpha):
        self.lr, self.mu, self.alpha = lr, mu, alpha
        self.outer, self.step, self.delta, self.local = None, 0, None, None
        self.errors = {"master": 0.0, "weights": 0.0}
        self.applied = []

    def before(self):
        self.step += 1
        sch = self.outer.config.schedule
        i = sch.starts(self.step)
        if i is not None:
            rows = [None] * dist.get_world_size()
            dist.all_gather_object(rows, self.outer.fragments[i].gather().double())
            m = self.outer.fragments[i].master.double()
            self.delta = (i, sum(m - r for r in rows) / len(rows), m, self.outer.fragments[i].momentum.double())
        if sch.applies(self.step) is not None:
            self.local = self.outer.fragments[sch.applies(self.step)].gather().double()

    def after(self):
        i = self.outer.config.schedule.applies(self.step)
        if i is None:
            return
        j, d, master, mom = self.delta
        assert i == j
        mom = self.mu * mom + d
        master = master - self.lr * (d + self.mu * mom)
        f = self.outer.fragments[i]
        want = master + self.alpha * (self.local - master)
        self.errors["master"] = max(self.errors["master"], (f.master.double() - master).abs().max().item())
        self.errors["weights"] = max(self.errors["weights"], (f.gather().double() - want).abs().max().item())
        self.applied.append((self.step, i))


def _reference(rank, world):
    out = {}
    for k, tau, alpha in ((1, 0, 0.0), (2, 1, 0.0), (2, 1, 0.5)):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        ref = _Reference(0.7, 0.9, alpha)
        opt.register_step_post_hook(lambda *a: ref.before())
        ref.outer = DiLoCo(net, opt, sync_every=H, codec="fp32", fragments=k, fragment_sync_delay=tau,
                           fragment_update_alpha=alpha, verify_every=1)
        opt.register_step_post_hook(lambda *a: ref.after())
        _train(net, opt, STEPS, rank)
        out[(k, tau, alpha)] = (ref.errors, ref.applied, ref.outer.syncs)
    return out


def test_syncs_match_float64_outer_nesterov_with_fragments_delay_alpha():
    res = spawn.run(2, _reference, timeout_s=60)
    for key, (errors, applied, syncs) in res[0].items():
        k, tau, _ = key
        # fragment i starts at t = i*H/k (mod H) and is applied tau steps later
        want = [(t + tau, (t // (H // k)) % k) for t in range(H // k, STEPS + 1, H // k) if t + tau <= STEPS]
        assert applied == want, key
        assert syncs == len(want)
        assert errors["master"] < 1e-6, f"{key}: max |master - float64| = {errors['master']}"
        assert errors["weights"] < 1e-6, f"{key}: max |weights - float64| = {errors['weights']}"


# ---- every codec: replicas bitwise equal; a differing replica named; bf16 --------------------------


def _hash_all(t: torch.Tensor):
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, t.detach().clone())
    return all(torch.equal(r.view(torch.uint8) if r.dtype != torch.uint8 else r, rows[0].view(torch.uint8))
               for r in rows)


def _codecs(rank, world):
    out = {}
    for codec in CODECS:
        net = _net()
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        outer = DiLoCo(net, opt, sync_every=H, codec=codec, verify_every=1)
        equal = []
        for _ in range(STEPS // H):
            _train(net, opt, H, rank, start=outer.step)
            # after a sync (k = 1, no delay) the weights are the master: the same bits everywhere
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            equal.append(_hash_all(flat) and torch.equal(flat, outer.fragments[0].master))
        init = torch.cat([p.detach().reshape(-1) for p in _net().parameters()])
        moved = (outer.fragments[0].master - init).abs().max()
        st = outer.stats
        out[codec] = (all(equal), outer.syncs, float(moved), st["wire_bytes"], st["fragments"][0]["bytes_per_sync"])
    # a replica whose master differs is named on every rank
    if rank == 1:
        outer.fragments[0].master[7] += 1e-3
    out["mismatch"] = _expect(outer.verify, RuntimeError, "differ", "[0]", "[1]")
    # bf16 parameters, fp32 master, bf16 residuals
    net = _net(dtype=torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = DiLoCo(net, opt, sync_every=H, codec="int4", residual_dtype=torch.bfloat16, verify_every=1)
    _train(net, opt, STEPS, rank)
    f = outer.fragments[0]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    out["bf16 params"] = (f.master.dtype, [r.dtype for r in f.residuals],
                          torch.equal(flat, f.master.to(torch.bfloat16)),
                          _hash_all(f.master), bool((f.master != f.master.to(torch.bfloat16).float()).any()))
    return out


def test_every_codec_keeps_replicas_bitwise_equal():
    res = spawn.run(2, _codecs, timeout_s=90)
    for codec in CODECS:
        equal, syncs, moved, wire, per_sync = res[0][codec]
        assert equal, f"{codec}: replicas differ after a sync"
        assert syncs == STEPS // H and moved > 0, codec
        assert wire > 0 and per_sync == wire / syncs and isinstance(per_sync, int), codec
    assert res[0]["mismatch"] == "" and res[1]["mismatch"] == "", (res[0]["mismatch"], res[1]["mismatch"])
    mdtype, rdtypes, params_are_master, equal, fp32_bits = res[0]["bf16 params"]
    assert mdtype == torch.float32 and rdtypes == [torch.bfloat16] * 2
    assert params_are_master and equal, "bf16 weights are not the rounded fp32 master on every replica"
    assert fp32_bits, "the master holds only bf16 values: outer steps are not taken in fp32"
    # int4 + error feedback: about half a byte per value per sync sent by each of 2 ranks
    assert res[0]["int4"][4] < 0.6 * 530, res[0]["int4"]


# ---- configuration and load errors: on every rank, changing nothing ---------------------------------


def _errors(rank, world):
    out = {}
    bad = {"H not a multiple of k": (dict(sync_every=6, fragments=4), "multiple"),
           "tau >= H/k": (dict(sync_every=8, fragments=4, fragment_sync_delay=2), "fragment_sync_delay"),
           "alpha > 1": (dict(sync_every=4, fragment_update_alpha=1.5), "fragment_update_alpha"),
           "unknown codec": (dict(sync_every=4, codec="int3"), "int3"),
           "auto on two levels": (dict(sync_every=4, codec="auto", topology=flatcomm.Topology(local_size=1)), "auto"),
           "auto headroom": (dict(sync_every=4, codec=Auto(headroom=0.0)), "headroom")}
    for name, (kw, word) in bad.items():
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        good = dict(sync_every=4)
        # only rank 1 is misconfigured: rank 0 raises too, naming rank 1's error
        out[name] = _expect(lambda: DiLoCo(net, opt, **(kw if rank == 1 else good)), Exception, "rank 1", word)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    two = [net[0], torch.nn.ModuleList([net[0], net[2]])]
    out["module in two fragments"] = _expect(
        lambda: DiLoCo(net, opt, sync_every=4, fragments=two if rank == 0 else 1), Exception, "rank 0", "0.weight")
    out["configurations differ"] = _expect(
        lambda: DiLoCo(net, opt, sync_every=4 * (rank + 1)), RuntimeError, "configuration", "[0]", "[1]")
    out["weights differ"] = _expect(lambda: DiLoCo(_net(seed=rank), opt, sync_every=4), RuntimeError, "initial weights")
    # a load that fails on one rank changes nothing on any rank
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = DiLoCo(net, opt, sync_every=4, codec="int8", fragments=2, fragment_sync_delay=1)
    _train(net, opt, 6, rank)
    sd = outer.state_dict()
    before = [(f.master.clone(), f.momentum.clone(), [r.clone() for r in f.residuals]) for f in outer.fragments]
    counters = (outer.step, outer.syncs)
    corrupt = {"NaN master": lambda d: d["fragments"][1]["master"].__setitem__(3, float("nan")),
               "residual shape": lambda d: d["fragments"][0]["residuals"].__setitem__(0, torch.zeros(3)),
               "other config": lambda d: d.__setitem__("config", "0" * 16),
               "in flight off schedule": lambda d: d.__setitem__("in_flight", {
                   "fragment": 0, "started": 5, "delta": torch.zeros(1), "residuals": []}),
               "other sync count": lambda d: d.__setitem__("syncs", 1)}
    for name, hurt in corrupt.items():
        mine = {**sd, "fragments": [dict(f, residuals=list(f["residuals"])) for f in sd["fragments"]]}
        mine["fragments"][1]["master"] = mine["fragments"][1]["master"].clone()
        if rank == 1:
            hurt(mine)
        words = ("disagree",) if name == "other sync count" else ("rank 1",)
        out[f"load: {name}"] = _expect(lambda: outer.load_state_dict(mine), Exception, *words)
    after = [(f.master, f.momentum, f.residuals) for f in outer.fragments]
    out["load changed nothing"] = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and
                                      all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
                                      for a, b in zip(before, after)) and (outer.step, outer.syncs) == counters
    outer.load_state_dict(sd)  # and a good one loads
    out["good load"] = (outer.step, outer.syncs) == counters
    return out


def test_configuration_and_load_errors_raise_on_every_rank():
    res = spawn.run(2, _errors, timeout_s=60)
    for rank, per in enumerate(res):
        failed = [f"{k}: {v}" for k, v in per.items() if v not in ("", True)]
        assert not failed, f"rank {rank}:\n" + "\n".join(failed)


# ---- resume bit for bit: after a sync, mid interval, with a fragment in flight ---------------------

RESUME = dict(sync_every=8, codec="int4", fragments=2, fragment_sync_delay=1)
RESUME_STEPS, KILL_AT = 20, (5, 7, 8)  # fragment 1 starts at 4, applied at 5; fragment 0 in flight at 8


def _fresh():
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    return net, opt, DiLoCo(net, opt, verify_every=1, **RESUME)


def _final(net, outer):
    return [p.detach().clone() for p in net.parameters()], [f.master.clone() for f in outer.fragments]


def _straight(rank, world, ckpt):
    net, opt, outer = _fresh()
    for t in range(RESUME_STEPS):
        _train(net, opt, 1, rank, start=t)
        if t + 1 in KILL_AT:
            in_flight = outer.pending is not None
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict(),
                        "in_flight": in_flight}, os.path.join(ckpt, f"{t + 1}.{rank}.pt"))
    saved = _final(net, outer)
    net, opt, outer = _fresh()  # the same run without checkpoints: saving drains, changes no bit
    _train(net, opt, RESUME_STEPS, rank)
    return saved, _final(net, outer)


def _resumed(rank, world, ckpt):
    out = {}
    for s in KILL_AT:
        sd = torch.load(os.path.join(ckpt, f"{s}.{rank}.pt"), weights_only=True)
        net, opt, outer = _fresh()
        net.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        outer.load_state_dict(sd["outer"])
        _train(net, opt, RESUME_STEPS - s, rank, start=s)
        out[s] = (_final(net, outer), sd["in_flight"], outer.syncs)
    return out


def _straight_then_resumed(rank, world, ckpt):
    # one spawn for both (starting ranks dominates here); each rank reads only its own files
    return _straight(rank, world, ckpt), _resumed(rank, world, ckpt)


def _bits_equal(a, b):
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def test_resume_bit_for_bit_at_three_kill_points():
    with tempfile.TemporaryDirectory() as ckpt:
        both = spawn.run(2, _straight_then_resumed, ckpt, timeout_s=90)
    straight, resumed = [s for s, _ in both], [r for _, r in both]
    for rank in range(2):
        (w, m), (w2, m2) = straight[rank]
        assert _bits_equal(w, w2) and _bits_equal(m, m2), "saving a checkpoint changed the run"
        assert [resumed[rank][s][1] for s in KILL_AT] == [False, False, True]  # the third has one in flight
        for s in KILL_AT:
            (rw, rm), _, _ = resumed[rank][s]
            assert _bits_equal(rw, w) and _bits_equal(rm, m), f"rank {rank}: resumed at step {s} differs"


# ---- faults: a replica that stops or dies during a sync ----------------------------------------------

FAULT_TIMEOUT_S = 4.0


def _fault(rank, world, how, flag, result):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    dist.group.WORLD.set_timeout(timedelta(seconds=FAULT_TIMEOUT_S))  # flatcomm's group inherits it
    tau = 1 if how == "dies" else 0
    snap = {}

    def snapshot(*_):  # runs ahead of DiLoCo's hook: the state just before a sync is applied
        snap["state"] = [(f.master.clone(), f.momentum.clone(), [r.clone() for r in f.residuals], f.gather())
                         for f in outer.fragments]

    opt.register_step_post_hook(snapshot)
    outer = DiLoCo(net, opt, sync_every=4, codec="int4", fragments=2, fragment_sync_delay=tau)
    _train(net, opt, 5, rank)  # two syncs done (applied at 2 / 4, or 3 / 5)
    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    peer = pids[1 - rank]
    if rank == 1:
        if how == "dies":
            _train(net, opt, 1, rank, start=5)  # starts fragment 1's all-reduce at step 6, then dies
            os._exit(3)
        deadline = time.monotonic() + 6 * FAULT_TIMEOUT_S  # stops before step 6, stays alive
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {}
    if how == "dies":
        # Rank 1's part of a tiny all-reduce could otherwise finish before it exits: let it die first.
        deadline = time.monotonic() + 2 * FAULT_TIMEOUT_S
        while _alive(peer) and time.monotonic() < deadline:
            time.sleep(0.05)
    t0 = time.monotonic()
    err = ""
    try:
        _train(net, opt, 3, rank, start=5)  # the sync at step 6 (applied at 6, or 7) fails
    except Exception as e:  # noqa: BLE001
        err = repr(e)
    elapsed = time.monotonic() - t0
    now = [(f.master, f.momentum, f.residuals, f.gather()) for f in outer.fragments]
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(a[3], b[3]) and
               all(torch.equal(x, y) for x, y in zip(a[2], b[2])) for a, b in zip(snap["state"], now))
    out = {"error": err, "elapsed": elapsed, "unchanged": same, "pending": outer.pending is None}
    torch.save(out, result)
    open(flag, "w").close()
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.parametrize("how", ["stops", "dies"])
def test_replica_fault_during_sync_raises_and_changes_nothing(how):
    with tempfile.TemporaryDirectory() as tmp:
        flag, result = os.path.join(tmp, "done"), os.path.join(tmp, "result.pt")
        try:
            spawn.run(2, _fault, how, flag, result, timeout_s=60)
        except RuntimeError as e:  # the dead rank ends the run; rank 0 saved its findings first
            assert how == "dies" and "exited abnormally" in str(e), str(e)[-2000:]
        out = torch.load(result, weights_only=False)
    assert out["error"], "the sync did not raise although a replica stopped"
    # the error names the sync (fragment 1 starts after step 6: the third) and what happened
    for word in ("flatcomm.diloco: the outer sync of fragment 1 started after inner step 6 (outer sync 3)",
                 "replica(s) [1] of the outer group exited" if how == "dies" else "did not reach this sync"):
        assert word in out["error"], out["error"]
    assert out["elapsed"] < 2.5 * FAULT_TIMEOUT_S, f"raised after {out['elapsed']:.1f} s ({out['error']})"
    assert out["unchanged"], "a failed sync changed master, momentum, residuals or weights"
    assert out["pending"], "a failed sync stayed pending"
