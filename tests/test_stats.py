"""flatcomm.stats: bandwidth formulas, records, exporters and the Prometheus text format."""
from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import types

import pytest
import torch

import flatcomm.stats as fs
from flatcomm import collectives as C
from flatcomm.tools import spawn

HAS_TB = importlib.util.find_spec("tensorboard") is not None
HAS_PROM = importlib.util.find_spec("prometheus_client") is not None


# ---- formulas --------------------------------------------------------------------------------------


def test_algbw_busbw_hand_computed():
    # 1 GB in 0.5 s -> 2 GB/s.
    assert fs.algbw(1e9, 0.5) == pytest.approx(2.0)
    assert fs.algbw(123, 0.0) == 0.0
    # all_reduce, 8 ranks: 2 * 7/8 = 1.75.
    assert fs.busbw("all_reduce", 1e9, 0.5, 8) == pytest.approx(3.5)
    # reduce_scatter / all_gather / all_to_all, 4 ranks: 3/4.
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        assert fs.busbw(kind, 4e9, 2.0, 4) == pytest.approx(1.5)
    # 256 MiB all_reduce on 2 ranks in 10 ms: algbw 26.8435456, busbw same (factor 1).
    assert fs.busbw("all_reduce", 268435456, 0.01, 2) == pytest.approx(26.8435456)
    assert fs.busbw("all_reduce", 1e9, 1.0, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind"):
        fs.busbw("allreduce", 1, 1, 2)


def test_record_derived_fields():
    r = fs.Record(step=3, name="b0", codec="int8", numel=1000, world=4, wire_bytes=1500,
                  encode_s=0.001, exchange_s=0.002, decode_s=0.001)
    assert r.size_bytes == 4000
    assert r.total_s == pytest.approx(0.004)
    assert r.fp32_bytes == 6000  # 2 * 3/4 * 4000
    assert r.compression == pytest.approx(4.0)
    assert r.algbw == pytest.approx(4000 / 0.004 / 1e9)
    assert r.busbw == pytest.approx(1.5 * 4000 / 0.004 / 1e9)
    d = r.to_dict()
    assert d["busbw"] == pytest.approx(r.busbw) and d["size_bytes"] == 4000
    assert fs.Record.from_dict(d) == r


def test_from_comm_stats():
    cs = C.CommStats(calls=2, wire_bytes=300, encode_s=0.01, exchange_s=0.02, decode_s=0.03)
    r = fs.from_comm_stats(cs, numel=100, step=7, name="x", codec="int8", kind="all_gather", world=3)
    assert (r.step, r.name, r.codec, r.kind, r.world, r.numel, r.wire_bytes) == (7, "x", "int8", "all_gather", 3,
                                                                                 100, 300)
    assert r.total_s == pytest.approx(0.06)
    assert r.fp32_bytes == int(2 / 3 * 400)
    assert r.busbw == pytest.approx(400 / 0.06 / 1e9 * 2 / 3)
    r2 = fs.from_comm_stats(cs, numel=100, total_s=0.1, world=2)
    assert r2.total_s == 0.1 and r2.busbw == pytest.approx(400 / 0.1 / 1e9)


# ---- JSON lines ------------------------------------------------------------------------------------


def _records():
    return [
        fs.Record(step=0, name="bucket0", codec="int8", numel=256, world=2, wire_bytes=300, encode_s=1e-4,
                  exchange_s=2e-4, decode_s=1e-4, total_s=5e-4, rel_error=0.01, residual_norm=0.5),
        fs.Record(step=0, name="bucket1", codec="int8", numel=64, world=2, wire_bytes=80, encode_s=1e-5,
                  rel_error=float("nan")),
        fs.Record(step=1, name="bucket0", codec="int8", numel=256, world=2, wire_bytes=310, total_s=4e-4,
                  rel_error=0.02, residual_norm=0.25, digest="ab" * 32),
        fs.Record(step=1, name='we"ird\\na\nme', codec="fp32", numel=8, world=2, wire_bytes=0),
    ]


def _same(a: fs.Record, b: fs.Record) -> bool:
    for f in fs.Record.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, float) and math.isnan(x):
            if not (isinstance(y, float) and math.isnan(y)):
                return False
        elif x != y:
            return False
    return True


def test_jsonlines_round_trip_appends(tmp_path):
    path = tmp_path / "comm.jsonl"
    recs = _records()
    with fs.JsonLinesExporter(path) as ex:
        ex.write(recs[:2])
    with fs.JsonLinesExporter(path) as ex:  # appends
        ex.write([r.to_dict() for r in recs[2:]])  # dicts are accepted too
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        json.loads(line)  # strict JSON: no bare NaN / Infinity
        assert "NaN" not in line and "Infinity" not in line
    back = fs.JsonLinesExporter.read(path)
    assert len(back) == 4 and all(_same(a, b) for a, b in zip(recs, back))
    assert json.loads(lines[2])["digest"] == "ab" * 32
    assert json.loads(lines[0])["busbw"] == pytest.approx(recs[0].busbw)


# ---- Prometheus text format ------------------------------------------------------------------------

SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)$")
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|$)')


def _unescape(v: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), v)


def parse_prometheus(text: str):
    """Strict line-by-line parser: {(metric, labels tuple): value}, {metric: type}."""
    samples, types_, helps = {}, {}, set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert fs.METRIC_NAME_RE.match(name) and name not in helps
            helps.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge") and name in helps
            types_[name] = kind
            continue
        m = SAMPLE_RE.match(line)
        assert m, f"bad sample line {line!r}"
        name, labels, value = m.groups()
        assert name in types_, f"sample before its TYPE: {line!r}"
        pos, lab = 0, []
        while pos < len(labels):
            lm = LABEL_RE.match(labels, pos)
            assert lm, f"bad labels {labels!r}"
            lab.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
        v = float(value)  # accepts NaN, +Inf, -Inf
        key = (name, tuple(lab))
        assert key not in samples
        samples[key] = v
    return samples, types_


def _key(name, rec):
    return (name, (("name", rec.name), ("codec", rec.codec), ("kind", rec.kind), ("world", str(rec.world))))


def test_prometheus_text_parses_and_matches():
    recs = _records()
    text = fs.prometheus_text(recs)
    samples, types_ = parse_prometheus(text)
    assert types_["flatcomm_wire_bytes_total"] == "counter"
    assert types_["flatcomm_busbw_gbps"] == "gauge"
    b0_last = recs[2]
    # counters sum over records of the same labels, gauges keep the last value
    assert samples[_key("flatcomm_wire_bytes_total", b0_last)] == 610
    assert samples[_key("flatcomm_collectives_total", b0_last)] == 2
    assert samples[_key("flatcomm_fp32_bytes_total", b0_last)] == 2 * 1024
    assert samples[_key("flatcomm_step", b0_last)] == 1
    assert samples[_key("flatcomm_busbw_gbps", b0_last)] == pytest.approx(1024 / 4e-4 / 1e9)
    assert samples[_key("flatcomm_rel_error", b0_last)] == pytest.approx(0.02)
    assert samples[_key("flatcomm_encode_seconds", recs[1])] == pytest.approx(1e-5)
    assert math.isnan(samples[_key("flatcomm_rel_error", recs[1])])
    # the escaped label round-trips; no residual_norm for it (not measured); wire_bytes 0 -> no ratio
    weird = recs[3]
    assert samples[_key("flatcomm_wire_bytes_total", weird)] == 0
    assert _key("flatcomm_residual_norm", weird) not in samples
    assert _key("flatcomm_compression_ratio", weird) not in samples
    assert 'name="we\\"ird\\\\na\\nme"' in text
    assert fs.prometheus_text([]) == ""


# ---- optional exporters ----------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TB, reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_exporter(tmp_path):
    with fs.TensorBoardExporter(str(tmp_path)) as ex:
        ex.write(_records())
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


@pytest.mark.skipif(HAS_TB, reason="tensorboard is installed")
def test_tensorboard_exporter_missing_package():
    with pytest.raises(ImportError, match="tensorboard"):
        fs.TensorBoardExporter("unused")


@pytest.mark.skipif(not HAS_PROM, reason="prometheus_client is not installed (pip install prometheus_client)")
def test_prometheus_exporter_real():
    import prometheus_client as pc

    reg = pc.CollectorRegistry()
    ex = fs.PrometheusExporter(registry=reg)
    recs = _records()
    ex.write(recs)
    lab = {"name": "bucket0", "codec": "int8", "kind": "all_reduce", "world": "2"}
    assert reg.get_sample_value("flatcomm_wire_bytes_total", lab) == 610
    assert reg.get_sample_value("flatcomm_busbw_gbps", lab) == pytest.approx(recs[2].busbw)
    samples, _ = parse_prometheus(pc.generate_latest(reg).decode())
    assert samples
    ex.close()


@pytest.mark.skipif(HAS_PROM, reason="prometheus_client is installed")
def test_prometheus_exporter_missing_package():
    with pytest.raises(ImportError, match="prometheus_client"):
        fs.PrometheusExporter()


def test_prometheus_exporter_with_stub_client(monkeypatch):
    """The exporter's logic against a minimal stand-in for prometheus_client."""
    store = {}

    class _Metric:
        def __init__(self, name, help_, labels, registry=None):
            self.name, self.labelnames = name, labels
            registry.append(self)

        def labels(self, *vals):
            key = (self.name, vals)

            class _Child:
                def inc(self, v):
                    store[key] = store.get(key, 0.0) + v

                def set(self, v):
                    store[key] = v
            return _Child()

    class _Reg(list):
        def unregister(self, m):
            self.remove(m)

    mod = types.SimpleNamespace(Counter=_Metric, Gauge=_Metric, REGISTRY=_Reg())
    monkeypatch.setitem(sys.modules, "prometheus_client", mod)
    reg = _Reg()
    ex = fs.PrometheusExporter(registry=reg)
    assert {m.name for m in reg} == {m[0] for m in fs.METRICS}
    recs = _records()
    ex.write(recs)
    lab = ("bucket0", "int8", "all_reduce", "2")
    assert store[("flatcomm_wire_bytes_total", lab)] == 610
    assert store[("flatcomm_busbw_gbps", lab)] == pytest.approx(recs[2].busbw)
    ex.close()
    assert list(reg) == []


def test_tensorboard_exporter_with_stub_writer(monkeypatch):
    scalars = []

    class _Writer:
        def __init__(self, log_dir=None):
            self.log_dir = log_dir

        def add_scalar(self, tag, v, global_step=None):
            scalars.append((tag, v, global_step))

        def flush(self):
            pass

        def close(self):
            scalars.append("closed")

    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=_Writer))
    recs = _records()
    with fs.TensorBoardExporter("d") as ex:
        ex.write(recs)
    assert ("flatcomm/bucket0/busbw_gbps", pytest.approx(recs[2].busbw), 1) in scalars
    assert ("flatcomm/bucket0/wire_bytes", 300.0, 0) in scalars
    assert scalars[-1] == "closed"


# ---- from_ddp_state --------------------------------------------------------------------------------


def _fake_ddp_stats():
    b = lambda step, i, n: {"step": step, "bucket": i, "numel": n, "wire_bytes": n + 10, "fp32_bytes": 4 * n,
                            "encode_s": 0.001, "exchange_s": 0.002, "decode_s": 0.003, "comm_s": 0.01,
                            "client_residual_norm": 3.0, "server_residual_norm": 4.0, "input_norm": 50.0,
                            "rel_error": 0.06}
    steps = []
    for s in range(2):
        bs = [b(s, 0, 100), b(s, 1, 50)]
        steps.append({"step": s, "buckets": bs, "wire_bytes": 170, "fp32_bytes": 600, "encode_s": 0.002,
                      "exchange_s": 0.004, "decode_s": 0.006, "comm_s": 0.02, "compression": 600 / 170,
                      "rel_error": 0.06, "residual_norm": math.sqrt(50.0)})
    return {"codec": "int8", "block_size": 256, "mode": "ordered", "error_feedback": True, "world_size": 2,
            "steps": steps}


def test_from_ddp_state_fake():
    recs = fs.from_ddp_state(_fake_ddp_stats())
    assert [(r.step, r.name) for r in recs] == [(0, "bucket0"), (0, "bucket1"), (1, "bucket0"), (1, "bucket1")]
    r = recs[0]
    assert (r.codec, r.world, r.numel, r.wire_bytes, r.fp32_bytes) == ("int8", 2, 100, 110, 400)
    assert r.total_s == 0.01 and r.residual_norm == pytest.approx(5.0) and r.rel_error == 0.06
    assert r.busbw == pytest.approx(400 / 0.01 / 1e9)
    steps = fs.from_ddp_state(_fake_ddp_stats(), per_step=True)
    assert [(r.step, r.name, r.numel, r.wire_bytes) for r in steps] == [(0, "step", 150, 170), (1, "step", 150, 170)]
    assert steps[0].compression == pytest.approx(600 / 170)


def _w_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flatcomm.ddp as fddp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(net, bucket_cap_mb=0.001)
    state = fddp.register(ddp, "int8")
    for step in range(3):
        x = torch.randn(8, 16)
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    recs = [r.to_dict() for r in fs.from_ddp_state(state)]
    snaps = {"ddp": state.stats, "diloco": _diloco_snapshot()}
    out = {k: (v.counters(), v.as_dict() if k == "diloco" else v["codec"],
               [r.to_dict() for r in fs.from_snapshot(v)]) for k, v in snaps.items()}
    out["ddp sums"] = {f: sum(st[f] for st in state.stats["steps"]) for f in ("wire_bytes", "encode_s")}
    # a plain collective with CommStats, too
    cs = C.CommStats()
    t = torch.randn(1000)
    C.all_reduce(t, codec="int8", op="sum", stats=cs)
    return recs, fs.from_comm_stats(cs, numel=1000, codec="int8", world=world).to_dict(), out


def _diloco_snapshot():
    from flatcomm.diloco import DiLoCo

    net = torch.nn.Linear(5, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    outer = DiLoCo(net, opt, sync_every=2, codec="int8")
    for _ in range(4):
        opt.zero_grad()
        net(torch.randn(2, 5)).sum().backward()
        opt.step()
    outer.close()
    return outer.stats


def test_from_ddp_state_real_one_rank(tmp_path):
    [(recs, cs_rec, snaps)] = spawn.run(1, _w_ddp, timeout_s=60)
    ddp_counters, codec, ddp_recs = snaps["ddp"]
    assert codec == "int8" and ddp_recs == recs  # a DDP snapshot's records are the State's
    assert ddp_counters["calls"] == len(recs)
    assert ddp_counters["wire_bytes"] == snaps["ddp sums"]["wire_bytes"]  # (0 at one rank)
    assert ddp_counters["encode_s"] == pytest.approx(snaps["ddp sums"]["encode_s"]) and ddp_counters["encode_s"] > 0
    dl_counters, dl_dict, [dl_rec] = snaps["diloco"]
    assert dl_dict["syncs"] == 2 and dl_dict["inner_steps"] == 4 and dl_counters["calls"] == 2
    assert dl_counters["wire_bytes"] == dl_dict["wire_bytes"] == dl_rec["wire_bytes"]
    assert (dl_rec["name"], dl_rec["step"]) == ("diloco", 2)
    recs = [fs.Record.from_dict(d) for d in recs]
    assert {r.step for r in recs} == {0, 1, 2}
    assert len(recs) >= 3 and all(r.name.startswith("bucket") for r in recs)
    n_params = 16 * 32 + 32 + 32 * 4 + 4
    for s in range(3):
        assert sum(r.numel for r in recs if r.step == s) == n_params
    for r in recs:
        assert r.codec == "int8" and r.world == 1 and r.total_s > 0 and r.busbw == 0.0  # 1 rank: factor 0
        assert r.rel_error is not None and r.residual_norm is not None
    samples, _ = parse_prometheus(fs.prometheus_text(recs))
    assert samples
    path = tmp_path / "ddp.jsonl"
    with fs.JsonLinesExporter(path) as ex:
        ex.write(recs)
    assert [r.numel for r in fs.JsonLinesExporter.read(path)] == [r.numel for r in recs]
    assert cs_rec["numel"] == 1000 and cs_rec["world"] == 1


def test_from_step_stats():
    from flatcomm.reproducible import StepStats

    st = StepStats(step=4, applied=True, digest="d" * 64, reduce_s=0.5, wire_bytes=8000)
    r = fs.from_step_stats(st, numel=1000, world=4)
    assert (r.step, r.digest, r.rel_error, r.total_s, r.wire_bytes) == (4, "d" * 64, 0.0, 0.5, 8000)
    assert r.busbw == pytest.approx(4000 / 0.5 / 1e9 * 1.5)


# ---- one convention: .stats is a read-only property -----------------------------------------------


def test_stats_is_a_property_everywhere_and_the_old_ddp_call_warns():
    import warnings

    import flatcomm.ddp
    import flatcomm.optim
    from flatcomm import reproducible

    state = flatcomm.ddp.State("int8", track_norms=False)
    st = state.stats  # no step yet: nothing recorded
    assert isinstance(st, fs.Snapshot) and st["steps"] == [] and st["codec"] == "int8" and st.source == "ddp"
    with pytest.warns(DeprecationWarning, match="state.stats, not state.stats"):
        old = state.stats()
    assert old == st
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert state.stats["codec"] == "int8"  # the new spelling does not warn
    opt = flatcomm.optim.OnebitAdam(torch.nn.Linear(3, 2).parameters(), warmup_steps=1)
    assert isinstance(opt.stats, fs.Snapshot) and opt.stats.wire_bytes == 0 and opt.stats.source == "optim"
    acc = reproducible.ExactGradAccumulator(torch.nn.Linear(3, 2), micro_batches=1)
    assert isinstance(acc.stats, reproducible.StepStats)
    for obj in (state, opt):
        with pytest.raises(AttributeError):
            obj.stats = None  # read-only


def test_every_front_end_returns_the_same_read_only_snapshot(tmp_path):
    """FSDP's and the optimizer's stats: a frozen Snapshot with CommStats' counters, their old
    reads (attributes, keys) kept, and the exporters take them as they are."""
    import dataclasses
    import warnings

    import flatcomm.fsdp
    import flatcomm.optim

    rs = flatcomm.fsdp.ReduceScatter("int8")
    rs.counters.add(C.CommStats(calls=3, wire_bytes=1200, encode_s=0.5, exchange_s=0.25, decode_s=0.125))
    rs.counters.weights_forward_bytes = 200
    snap = rs.stats
    assert type(snap) is fs.Snapshot and snap.source == "fsdp"
    assert snap.counters() == {"calls": 3, "wire_bytes": 1200, "encode_s": 0.5, "exchange_s": 0.25, "decode_s": 0.125}
    assert snap.bytes_by_kind == {"weights_forward": 200, "weights_backward": 0, "gradients": 1000}
    assert snap["decisions"] == {} and snap.decisions == {} and "weights_forward_bytes" in snap
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.wire_bytes = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.detail["x"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError, match="no field 'wire_byte'"):
        snap.wire_byte  # a typo is an error
    rs.counters.wire_bytes += 1
    assert snap.wire_bytes == 1200 and rs.stats.wire_bytes == 1201  # a snapshot: taken when read
    with pytest.warns(DeprecationWarning, match="read-only snapshot"):
        rs.stats = C.CommStats()  # the old way of starting over still works
    assert rs.stats.wire_bytes == 0 and isinstance(rs.counters, flatcomm.fsdp.Stats)
    opt = flatcomm.optim.OnebitAdam(torch.nn.Linear(3, 2).parameters(), warmup_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert opt.stats.last_wire_bytes == 0 and opt.stats.as_dict() == {"last_wire_bytes": 0}
    recs = fs.from_snapshot(snap) + fs.from_snapshot(opt.stats)
    assert [(r.name, r.kind, r.wire_bytes, r.total_s) for r in recs] == [
        ("fsdp", "reduce_scatter", 1200, 0.875), ("optim", "all_reduce", 0, 0.0)]
    path = tmp_path / "s.jsonl"
    with fs.JsonLinesExporter(path) as ex:
        ex.write(snap)  # a snapshot by itself, or in a list with records
        ex.write([opt.stats, recs[0]])
    assert [r.name for r in fs.JsonLinesExporter.read(path)] == ["fsdp", "optim", "fsdp"]
    assert "flatcomm_wire_bytes_total" in fs.prometheus_text([snap])
