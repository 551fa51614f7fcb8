"""`python -m flatcomm.bench fsdp` in whole-step mode (flatcomm/tools/bench/fsdp_steps.py): variant
parsing, model sizing, a loopback run whose self-reported bytes match the payload computed here from
the model's shapes, and (root only) a run on a small link whose interface counters agree with that
payload and with the split by collective."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flatcomm.tools import netlink
from flatcomm.tools.bench import fsdp_steps as S

ROOT = Path(__file__).resolve().parents[1]
OK, WHY = netlink.available()


def _bench(tmp_path, *args, timeout=180):
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "flatcomm.bench", "fsdp", *args, "--json", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


def _payload_per_param(cfg: dict, codec: str, world: int, root_too: bool) -> float:
    """Bytes one rank sends per parameter in the forward (root_too) or backward weight gathers:
    its encoded dim-0-padded shard of every parameter, to each of the world - 1 peers."""
    import torch

    import flatcomm
    from flatcomm.tools.bench.fsdp import Transformer

    torch.manual_seed(0)
    m = Transformer(cfg["vocab"], cfg["d_model"], cfg["layers"], cfg["ff"])
    blocks = {id(p) for layer in m.layers for p in layer.parameters()}
    sent = 0
    for p in m.parameters():
        if not root_too and id(p) not in blocks:
            continue  # the root's parameters stay gathered from forward to backward
        row = -(-p.shape[0] // world) * (p.numel() // p.shape[0])
        sent += flatcomm.wire_bytes(codec, row) * (world - 1)
    return sent / sum(p.numel() for p in m.parameters())


def test_variants_and_sizes():
    assert S.parse_variant("plain") == S.Variant("plain", None, False)
    assert S.parse_variant("int8/int4:hpz") == S.Variant("int8", "int4", True)
    assert S.parse_variant("int8/int4:hpz").name == "int8/int4:hpz"
    for bad, why in [("plain/int8", "flatcomm's gradients"), ("int8/sign", "weights"), ("int9", "gradients"),
                     ("int8:fast", "hpz")]:
        with pytest.raises(ValueError, match=why):
            S.parse_variant(bad)
    assert S.default_variants("int8", ["int8", "int4"], 1) == ["plain", "int8", "int8/int8", "int8/int4"]
    assert S.default_variants("int8", ["int8", "int4"], 2) == [
        "plain", "int8", "int8/int8", "plain:hpz", "int8:hpz", "int8/int8:hpz", "int8/int4:hpz"]
    import torch

    from flatcomm.tools.bench.fsdp import Transformer

    for target in (2e5, 25e6):
        dims = S.model_dims(target, 8, 1024)
        n = S.transformer_params(dims["d_model"], 8, 1024)
        assert n >= target and S.transformer_params(dims["d_model"] - 64, 8, 1024) < target
    dims = S.model_dims(3e5, 2, 256)
    m = Transformer(dims["vocab"], dims["d_model"], dims["layers"], dims["ff"])
    assert sum(p.numel() for p in m.parameters()) == S.transformer_params(dims["d_model"], 2, 256)
    del torch


def test_hpz_needs_nodes(tmp_path):
    p = subprocess.run([sys.executable, "-m", "flatcomm.bench", "fsdp", "--variants", "int8/int8:hpz"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "ranks-per-node" in p.stderr


def test_loopback_self_reported_bytes(tmp_path):
    doc, out = _bench(tmp_path, "--quick", "--weights", "int8,int4", "--steps", "1", "--warmup", "1",
                      "--timeout", "120")
    rows = {r["variant"]: r for r in doc["results"]}
    assert list(rows) == ["plain", "int8", "int8/int8", "int8/int4"] and "int8/int4" in out
    cfg = doc["config"]
    for r in rows.values():
        assert r["counters"] is False and "bytes_per_param" not in r
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"] and math.isfinite(r["final_loss"])
    assert "self_bytes_per_param" not in rows["plain"] and rows["int8"]["self_bytes_per_param"]["weights_forward"] == 0
    for v, codec in (("int8/int8", "int8"), ("int8/int4", "int4")):
        me = rows[v]["self_bytes_per_param"]
        assert me["weights_forward"] == pytest.approx(_payload_per_param(cfg, codec, 2, True), rel=1e-9)
        assert me["weights_backward"] == pytest.approx(_payload_per_param(cfg, codec, 2, False), rel=1e-9)
        assert rows[v]["weight_gathers"]["backward_full"] > 0 and rows[v]["weight_gathers"]["backward_node"] == 0
    # same init and batches: the lossless-weight rows train alike, int4 weights differ a little
    assert abs(rows["int8/int8"]["final_loss"] - rows["plain"]["final_loss"]) < 0.05
    assert rows["int8/int4"]["final_loss"] != rows["int8/int8"]["final_loss"]


@pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")
def test_link_counters_match_the_payload(tmp_path):
    png = tmp_path / "f.png"
    doc, out = _bench(tmp_path, "--nodes", "2", "--link", "1gbit", "--params", "3e5", "--layers", "2",
                      "--variants", "plain,int8/int8", "--steps", "2", "--warmup", "1", "--plot", str(png))
    rows = {r["variant"]: r for r in doc["results"]}
    cfg = doc["config"]
    assert doc["link"]["nodes"] == 2 and "B/param" in out
    for r in rows.values():
        kinds = r["kind_bytes_per_param"]
        # the split by call adds up to the whole step (counted separately, in other steps)
        assert sum(kinds.values()) == pytest.approx(r["bytes_per_param"], rel=0.05), r
        assert r["wire_bytes"] == r["bytes_per_step"] and not r["wire_estimated"]
    plain, q = rows["plain"]["kind_bytes_per_param"], rows["int8/int8"]["kind_bytes_per_param"]
    # fp32 weights: each node sends its half of every parameter, 4 B each; the root's stay gathered
    assert plain["weights_forward"] == pytest.approx(_payload_per_param(cfg, "fp32", 2, True), rel=0.06)
    assert plain["weights_backward"] == pytest.approx(_payload_per_param(cfg, "fp32", 2, False), rel=0.06)
    assert 3.6 < plain["gradients"] < 4.6  # gloo's reduce-scatter is an all-reduce: 2 (W-1)/W x 4 B
    me = rows["int8/int8"]["self_bytes_per_param"]
    for k in S.KINDS:  # two nodes of one rank: what a rank sends is what leaves its node
        assert q[k] == pytest.approx(me[k], rel=0.06), (k, q, me)
    assert rows["int8/int8"]["bytes_ratio"] < 0.3
    try:
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 0
    except ImportError:
        pass
