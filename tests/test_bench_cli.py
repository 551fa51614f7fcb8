"""`python -m flatcomm.bench`: tiny configurations produce valid JSON with the required fields (the
layering, library never importing the tools, is tests/test_layering.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("name", "step_s", "comm_s", "wire_bytes")


def _bench(capsys, tmp_path, *args):
    """``flatcomm.bench`` with ``args``, in this process: its ranks fork from the test run's warm
    forkserver instead of a new interpreter's (tests/test_bad_link_refused runs ``python -m``)."""
    from flatcomm.tools.bench import main

    out = tmp_path / "out.json"
    previous = signal.getsignal(signal.SIGALRM)  # the CLI arms its own backstop alarm
    try:
        rc = main([*args, "--json", str(out)])
    finally:
        signal.signal(signal.SIGALRM, previous)
    p = capsys.readouterr()
    assert rc == 0, p.out[-3000:] + p.err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["results"], doc
    for r in doc["results"]:
        for k in REQUIRED:
            assert k in r, (k, r)
        assert isinstance(r["name"], str)
        assert isinstance(r["step_s"], float) and r["step_s"] > 0
        assert isinstance(r["comm_s"], float) and r["comm_s"] >= 0 or r["name"] == "noop"
        assert isinstance(r["wire_bytes"], (int, float)) and r["wire_bytes"] >= 0
    return doc, p.out, p.err


def test_kernels_quick(tmp_path, capsys):
    png = tmp_path / "k.png"
    doc, out, err = _bench(capsys, tmp_path, "kernels", "--quick", "--sizes", "64K", "--codecs", "int8,sign",
                      "--reps", "2", "--no-ref", "--plot", str(png))
    names = {r["name"] for r in doc["results"]}
    assert {"int8", "sign", "copy_"} <= names
    enc = next(r for r in doc["results"] if r["name"] == "int8" and r["op"] == "encode+EF")
    assert enc["wire_bytes"] > 0 and enc["numel"] == 65536
    assert "int8" in out and "encode+EF" in out and " 64K " in out  # the table, sizes as written
    assert "[bench]" not in out and "Traceback" not in out  # progress goes to stderr
    assert all(r["min_s"] <= r["step_s"] <= r["max_s"] for r in doc["results"])
    lines = [set(ln.split()) for ln in (out + err).splitlines()]
    for r in doc["results"]:  # each result printed once (the table), not also as progress
        words = {f"{r['step_s'] * 1e3:.3f}", *r["name"].split(), *r["op"].split()}
        hits = [ln for ln in lines if words <= ln]
        assert len(hits) == 1, (r, hits)
    assert "copy_ 64K ..." in err and "encode+EF int8 64K ..." in err  # progress: what runs now
    try:
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 0
    except ImportError:
        pass


def test_collectives_two_ranks(tmp_path, capsys):
    doc, out, err = _bench(capsys, tmp_path, "collectives", "--quick", "--ranks", "2", "--sizes", "16K",
                      "--codecs", "fp32,int8,auto")
    assert doc["world"] == 2 and doc["link"] is None
    names = {r["name"] for r in doc["results"]}
    assert {"torch-allreduce", "torch-reduce-scatter", "fp32", "int8"} <= names
    i8 = next(r for r in doc["results"] if r["name"] == "int8" and r["collective"] == "all_reduce")
    f32 = next(r for r in doc["results"] if r["name"] == "fp32" and r["collective"] == "all_reduce")
    assert 0 < i8["wire_bytes"] < f32["wire_bytes"]
    auto = [r for r in doc["results"] if r["name"] == "auto"]
    assert {r["collective"] for r in auto} == {"all_reduce", "reduce_scatter"}
    assert all(r["chosen"] in ("fp32", "bf16", "int8", "int4", "sign") and r["reason"] for r in auto)
    assert "chose" in out


def test_ddp_tiny(tmp_path, capsys):
    doc, out, err = _bench(capsys, tmp_path, "ddp", "--quick", "--params", "2e5", "--hooks", "int8,int4,auto", "--timeout", "120")
    by = {r["name"]: r for r in doc["results"]}
    assert {"noop", "torch-allreduce", "int8", "int4", "auto"} <= set(by)
    # None when torch's step was not slower than the no-communication step (noise on a tiny model)
    assert "comm_ratio" in by["int8"] and (by["int8"]["comm_ratio"] is None or by["int8"]["comm_ratio"] >= 0)
    auto = by["auto"]
    assert auto["decisions"] and all(d["codec"] and d["reason"] for d in auto["decisions"])
    assert auto["best_fixed"] in ("int8", "int4") and "auto_vs_best" in auto
    assert "chose" in out and "the best fixed codec" in out


def test_fsdp_quick_with_auto(tmp_path, capsys):
    doc, out, err = _bench(capsys, tmp_path, "fsdp", "--quick", "--codecs", "int8,auto", "--steps", "1", "--warmup", "1",
                      "--timeout", "120")
    by = {r["name"]: r for r in doc["results"]}
    assert {"torch-reduce-scatter", "int8", "auto"} <= set(by)
    assert by["auto"]["chosen"] and "chose" in out


def test_bad_link_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "flatcomm.bench", "collectives", "--link", "1gbps"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "gbit" in p.stderr


def test_backend_reports_progress(tmp_path):
    """`bench backend` (tens of seconds at its defaults) says what it runs while it runs, on stderr."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "flatcomm.bench", "backend", "--ranks", "2", "--sizes", "4K",
                        "--reps", "1", "--steps", "1", "--timeout", "120"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for step in ("2 ranks", "all_reduce 4KB", "reduce_scatter 4KB", "all_gather 4KB", "ddp steps", "fsdp2 steps"):
        assert f"[bench] backend: {step}" in p.stderr, p.stderr
    assert "[bench]" not in p.stdout and "all_reduce" in p.stdout  # the table alone on stdout
