"""The alpha-beta model of flatcomm.autotune.costmodel against hand-computed bytes and times, and the
`bench scale` projection (no ranks: the model only)."""
from __future__ import annotations

import json

import pytest

from flatcomm.autotune import costmodel as M
from flatcomm.ops.codecs import Codec

INF = float("inf")


def _cluster(nodes, g, inter=1e8, intra=1e10, codec_s=0.0, lat=0.0, share=1.0):
    return M.Cluster(nodes, g, M.Tier(lat, inter), M.Tier(lat, intra),
                     {c: codec_s for c in ("fp32", "int8", "int4", "sign")}, 0.0, share)


def test_ring_bytes_and_latency():
    n = 10_000_000  # S = 40 MB
    cl = _cluster(2, 2, lat=1e-3)
    # a node sends 2 (W-1)/W S = 60 MB at 100 MB/s, 2 (W-1) = 6 steps of latency
    assert M.ring(cl, n) == pytest.approx(60e6 / 1e8 + 6e-3)
    assert M.ring(_cluster(1, 1), n) == 0.0
    one_node = _cluster(1, 4)  # only the intra tier: 2 x 3/4 x 40 MB at 10 GB/s
    assert M.ring(one_node, n) == pytest.approx(60e6 / 1e10)


@pytest.mark.parametrize("codec", ["fp32", "int8", "sign"])
def test_flat_and_hierarchical_bytes_off_a_node(codec):
    n, nodes, g = 1 << 22, 2, 4
    w = nodes * g
    cs = Codec(codec).wire_bytes(n)
    cl = _cluster(nodes, g, intra=INF)  # only the network counts
    flat = (g * (w - g) / w + (w - 1) / w) * cs / 1e8
    assert M.flat(cl, n, codec) == pytest.approx(flat, rel=1e-9)
    m = n // g
    hier = 2 * (nodes - 1) / nodes * Codec(codec).wire_bytes(m) * g / 1e8
    assert M.hierarchical(cl, n, codec) == pytest.approx(hier, rel=1e-9)
    # the count: two-level sends ~ 2 c S per node, flat ~ G times more in the all-to-all
    assert M.hierarchical(cl, n, codec) < 0.4 * M.flat(cl, n, codec)


def test_overlap_and_shared_cores():
    n = 1 << 24
    cl = _cluster(2, 1, inter=1e9, codec_s=1e-9)  # compute 16.8 ms; wire of int8
    k = M._chunks(n, "int8", 2)
    wire = 2 * 0.5 * Codec("int8").wire_bytes(n) / 1e9
    comp = n * 1e-9
    assert k > 1 and M.flat(cl, n, "int8") == pytest.approx(max(comp, wire) + min(comp, wire) / k)
    # latency per chunk: the all-to-all, then W - 1 steps of the ring all-gather
    with_lat = M.Cluster(4, 1, M.Tier(1e-3, INF), M.Tier(0.0, INF), {"int8": 0.0}, 0.0)
    assert M.flat(with_lat, n, "int8") == pytest.approx(M._chunks(n, "int8", 4) * 4 * 1e-3)
    half = _cluster(2, 1, inter=1e9, codec_s=1e-9, share=0.5)  # two ranks per core: compute x2
    assert M.flat(half, n, "int8") == pytest.approx(max(2 * comp, wire) + min(2 * comp, wire) / k)
    # flat when one tier is missing
    assert M.hierarchical(_cluster(1, 4), n, "int8") == M.flat(_cluster(1, 4), n, "int8")
    with pytest.raises(ValueError, match="path"):
        M.predict(cl, "tree", n)


def test_bench_scale_projection(tmp_path, capsys):
    from flatcomm.tools.bench import main

    out = tmp_path / "scale.json"
    assert main(["scale", "--project-nodes", "16", "--project-sizes", "1M", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert {r["nodes"] for r in rows} == {1, 2, 4, 8, 16}
    assert doc["projection"]["inter_GBps_per_node"] == 400 and "assumed" in doc["projection"]["gpu_figures"]
    at16 = {(r["path"], r["codec"]): r["model_s"] for r in rows if r["nodes"] == 16}
    assert at16[("hierarchical", "int8")] < at16[("flat", "int8")] < at16[("flat", "fp32")]
    assert "projection" in capsys.readouterr().out


def test_shared_cores_add_the_node_tier_to_the_codec_work():
    """On a CPU host the node's loopback transfers and the kernels share the cores: the two-level
    path's node tier and codec work add up, only the network overlaps them."""
    n, g, nodes = 8 << 20, 2, 2
    cl = M.Cluster(nodes, g, M.Tier(0.0, 1e8), M.Tier(0.0, 1e9), {"int8": 4e-9}, 1e-9, 1.0, shared_cores=True)
    m = n / g
    cs = Codec("int8").wire_bytes(int(m))
    node_rs = (g - 1) / g * 4 * n / 1e9 + (g - 1) * m * 1e-9
    node_ag = (g - 1) * cs / 1e9 + (g - 1) * m * 4e-9 / 3
    cpu = node_rs + node_ag + m * 4e-9
    wire = 2 * (nodes - 1) / nodes * cs * g / 1e8
    assert M.hierarchical(cl, n, "int8", segments=4) == pytest.approx(max(cpu, wire) + min(cpu, wire) / 4)
    apart = M.Cluster(nodes, g, cl.inter, cl.intra, cl.codec_s, cl.reduce_s, 1.0)
    assert M.hierarchical(apart, n, "int8", segments=4) < M.hierarchical(cl, n, "int8", segments=4)


def test_segments_pay_where_tiers_overlap_and_latencies_are_cheap():
    gpu = lambda nodes: M.Cluster(nodes, 8, M.Tier(10e-6, 400e9), M.Tier(3e-6, 900e9),  # noqa: E731
                                  {c: 4.0 / 1e12 for c in ("fp32", "int8")}, 4.0 / 3e12)
    # 100 MB on 128 x 8 GPUs: each segment is one exchange across nodes, whose all-gather costs 127
    # latencies: one segment, by default and by the model
    n = 25_000_000
    one = M.hierarchical(gpu(128), n, "int8", segments=1)
    assert M.hierarchical(gpu(128), n, "int8") == pytest.approx(one)
    assert M.best_segments(gpu(128), n, "int8") == 1 and M.hierarchical(gpu(128), n, "int8", segments=2) > one
    # 800 MB on 2 x 8: the tiers overlap; the default (by size) is the model's best
    n = 200_000_000
    one = M.hierarchical(gpu(2), n, "int8", segments=1)
    assert M.best_segments(gpu(2), n, "int8") == 8
    eight = M.hierarchical(gpu(2), n, "int8", segments=8)
    assert M.hierarchical(gpu(2), n, "int8") == pytest.approx(eight) and eight < 0.6 * one
    # a CPU box: payload forwarding (fp32 intra codec) splits; a lossy intra codec's segments cost
    # two copies of the tensor as much as the steps: splitting never pays there
    cpu = M.Cluster(2, 2, M.Tier(1e-3, 1e9), M.Tier(5e-4, 8e8), {"fp32": 1e-8, "int8": 6e-9, "bf16": 8e-9}, 1e-8, 0.5)
    assert M.best_segments(cpu, 4 << 20, "int8") == 8
    assert M.best_segments(cpu, 4 << 20, "int8", "bf16") == 1
    # each segment costs a latency per step: with free wires, one segment wins (node reduce, the
    # one-hop exchange: all-to-all + 1-step all-gather, node gather)
    lat = _cluster(2, 2, inter=INF, intra=INF, lat=1e-3)
    assert M.hierarchical(lat, 1 << 20, "int8", segments=1) == pytest.approx(4e-3)
    assert M.best_segments(lat, 1 << 20, "int8") == 1
