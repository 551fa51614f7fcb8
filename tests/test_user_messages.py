"""Small things a new user meets first: a codec name in the wrong case gets "did you mean" at every
entry point, a second DDP hook gets flatcomm's message, ``init_process_group("flatcomm")`` works after
a plain ``import flatcomm``, DiLoCo's bytes per sync is an int, its messages read as English."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flatcomm
from flatcomm.diloco import replicas
from flatcomm.diloco.outer import FragmentStats
from flatcomm.tools import _cli, spawn

ROOT = Path(__file__).resolve().parents[1]
HINT = "did you mean 'int8'"


@pytest.mark.parametrize("call", [
    lambda: flatcomm.Codec("INT8"),
    lambda: flatcomm.resolve("INT8"),
    lambda: flatcomm.wire_bytes("Int8", 100),
    lambda: flatcomm.encode(torch.ones(10), "INT8"),
    lambda: flatcomm.decode(torch.zeros(16, dtype=torch.uint8), "INT8", 10),
    lambda: flatcomm.optim.OnebitAdam(torch.nn.Linear(2, 2).parameters(), codec="INT8"),
    lambda: flatcomm.ddp.State("INT8"),
], ids=["Codec", "resolve", "wire_bytes", "encode", "decode", "OnebitAdam", "ddp.State"])
def test_codec_name_in_another_case_gets_did_you_mean(call):
    with pytest.raises(ValueError, match=HINT):
        call()


def test_codec_name_hints_in_the_ops_and_the_cli():
    with pytest.raises(RuntimeError, match=HINT):  # the raw ops (and the cupy path, which parses with them)
        torch.ops.flatcomm.encode(torch.ones(10), "INT8", 256, 0, None, False, 0)
    with pytest.raises(Exception, match=HINT):
        _cli.names(_cli.codecs, "codec")("fp32,INT8")
    for name, hint in (("float32", "'fp32'"), ("bfloat16", "'bf16'"), ("half", "'fp16'"), ("AUTO", "'auto'")):
        with pytest.raises(ValueError, match=hint):
            flatcomm.Codec(name)
    with pytest.raises(ValueError) as e:
        flatcomm.Codec("int9")
    assert "did you mean" not in str(e.value)  # no guess where none fits


def _hook_twice(rank: int, world: int) -> dict:
    import flatcomm.ddp

    out = {}
    for codec in ("int8", "fp32"):
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        flatcomm.ddp.register(ddp, "int8")
        try:
            flatcomm.ddp.register(ddp, codec)
        except RuntimeError as e:
            out[codec] = str(e)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    try:
        flatcomm.ddp.register(ddp, "int8")
    except RuntimeError as e:
        out["torch hook"] = str(e)
    return out


def test_registering_a_second_ddp_hook_names_the_way_out():
    out = spawn.run(1, _hook_twice, timeout_s=60)[0]
    for codec in ("int8", "fp32"):
        msg = out[codec]
        assert msg.startswith("flatcomm.ddp.register: this DistributedDataParallel model has a communication hook "
                              "already: flatcomm's (State;"), msg
        assert "new DistributedDataParallel" in msg and "keep the object the first registration returned" in msg
    assert "allreduce_hook" in out["torch hook"] and out["torch hook"].startswith("flatcomm.ddp.register:")


def test_init_process_group_flatcomm_after_a_plain_import_flatcomm(tmp_path):
    code = ("import sys, torch, torch.distributed as dist, flatcomm\n"
            "assert 'flatcomm.backend' not in sys.modules\n"
            f"dist.init_process_group('flatcomm', init_method='file://{tmp_path}/rdv', rank=0, world_size=1)\n"
            "x = torch.ones(3)\n"
            "dist.all_reduce(x)\n"
            "print(dist.get_backend(), type(dist.distributed_c10d._get_default_group()).__name__, x.tolist())\n"
            "dist.destroy_process_group()\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split()[:2] == ["flatcomm", "FlatcommGroup"] and "[1.0, 1.0, 1.0]" in p.stdout, p.stdout


def test_bytes_per_sync_is_an_int():
    assert FragmentStats().bytes_per_sync == 0 and isinstance(FragmentStats().bytes_per_sync, int)
    s = FragmentStats(syncs=3, wire_bytes=3 * 4112)
    assert s.bytes_per_sync == 4112 and isinstance(s.bytes_per_sync, int)


def test_replicas_disagreeing_reads_as_english():
    with pytest.raises(RuntimeError) as e:
        replicas.differing([5, 5, 7], "the initial weights (seed every replica alike)")
    msg = str(e.value)
    assert msg.startswith("flatcomm.diloco: the replicas disagree on the initial weights (seed every replica alike): ")
    assert "differs" not in msg and "replicas [2] differ from replicas [0, 1]" in msg
