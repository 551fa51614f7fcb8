"""flatcomm.tools.bench.convergence: row parsing, and a tiny run whose JSON has the documented shape
and whose flatcomm fp32 row reproduces torch's all-reduce (2 ranks: (a + b) / 2 rounds the same)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flatcomm.tools.bench import convergence as conv


def test_parse_rows():
    assert conv._split_rows("torch,sign:block_size=32,start_step=5,int8") == [
        "torch", "sign:block_size=32,start_step=5", "int8"]
    assert conv.parse_row("sign:block_size=32,start_step=5") == ("sign", {"block_size": 32, "start_step": 5})
    assert conv.parse_row("int8") == ("int8", {})
    with pytest.raises(ValueError, match="key=value"):
        conv.parse_row("sign:block_size")
    with pytest.raises(ValueError, match="torch row"):
        conv.parse_row("torch:start_step=3")


def test_quick_run_json(tmp_path):
    path = tmp_path / "conv.json"
    rows = ["torch", "fp32", "sign:start_step=2"]
    assert conv.main(["--quick", "--workloads", "mlp_sgd", "--codecs", ",".join(rows), "--seeds", "2",
                      "--json", str(path), "--timeout", "120"]) == 0
    doc = json.loads(path.read_text())
    assert doc["command"] == "convergence" and doc["world"] == 2 and doc["seeds"] == 2
    w = doc["workloads"]["mlp_sgd"]
    assert w["optimizer"] == "SGD+momentum" and w["steps"] >= 4 and w["params"] > 0
    assert [r["row"] for r in w["rows"]] == rows
    for r in w["rows"]:
        assert len(r["val"]) == len(r["rel"]) == len(r["curves"]) == 2
        assert all(len(c) == w["steps"] and all(math.isfinite(x) for x in c) for c in r["curves"])
        assert isinstance(r["rel_mean"], float) and r["rel_sd"] >= 0
        assert r["wire_bytes_per_step"] > 0
    torch_row, fp32_row, sign_row = w["rows"]
    assert fp32_row["val"] == torch_row["val"] and fp32_row["curves"] == torch_row["curves"]
    assert fp32_row["rel"] == [0.0, 0.0]
    assert sign_row["options"] == {"start_step": 2} and sign_row["val"] != torch_row["val"]
    assert sign_row["wire_bytes_per_step"] < fp32_row["wire_bytes_per_step"] / 2


def test_accordion_and_onebit_rows():
    from flatcomm.ddp.accordion import Accordion

    assert conv._accordion_opts({"accordion": "int8"}) == {"accordion": "int8"}
    opts = conv._accordion_opts(dict(conv.parse_row("sign:accordion=fp32,accordion_every=4,"
                                                    "accordion_threshold=0.25")[1]))
    acc = opts["accordion"]
    assert isinstance(acc, Accordion) and (acc.low.name, acc.every, acc.threshold) == ("fp32", 4, 0.25)
    assert conv._applies("onebit:warmup_steps=3", conv.CNN(0, 0.1))
    assert not conv._applies("onebit:warmup_steps=3", conv.MLPSGD(0, 0.1))
    assert conv._applies("sign", conv.MLPSGD(0, 0.1))
    opt, _ = conv.CNN(0, 0.1).make_optimizer(conv.CNN(0, 0.1).model().parameters(), {"warmup_steps": 3})
    assert type(opt).__name__ == "OnebitAdam" and opt.warmup_steps == 3



def test_lm_recipe_workload():
    """lm_recipe: 2 micro-batches a step, AdamW (0.9, 0.95), weight decay on the matrices only."""
    w = conv.LMRecipe(0, 0.02)
    parts = w.batches(3, 1)
    assert len(parts) == 2 and parts[0][0].shape == (8, 64) and not torch.equal(parts[0][0], parts[1][0])
    opt, _ = w.make_optimizer(w.model().parameters())
    assert opt.defaults["betas"] == (0.9, 0.95)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(p.dim() >= 2 for p in opt.param_groups[0]["params"])
    assert all(p.dim() < 2 for p in opt.param_groups[1]["params"])


def test_fsdp_rows(tmp_path):
    """FSDP2 rows, on mlp_sgd and on lm_recipe (accumulation: DDP's no_sync, FSDP's paused sync;
    clipping): flatcomm's lossless fp32 trains the bits of its baseline (torch's all-reduce, plain
    FSDP2's reduce-scatter); quantized weights change them a little, and the held-out loss through
    the gathered weights differs from the masters' only when the weights are quantized."""
    path = tmp_path / "conv.json"
    rows = ["torch", "fp32", "fsdp", "fsdp:grads=fp32", "fsdp:grads=int8,weights=int8"]
    assert conv.main(["--quick", "--workloads", "mlp_sgd,lm_recipe", "--codecs", ",".join(rows), "--seeds", "1",
                      "--steps-scale", "0.02", "--json", str(path), "--timeout", "120"]) == 0
    doc = json.loads(path.read_text())["workloads"]
    assert doc["lm_recipe"]["steps"] == 5 and doc["mlp_sgd"]["steps"] == 4
    for wname, w in doc.items():
        by = {r["row"]: r for r in w["rows"]}
        assert list(by) == rows and all(len(r["curves"][0]) == w["steps"] for r in w["rows"])
        assert by["fp32"]["curves"] == by["torch"]["curves"], wname
        assert by["fsdp"]["baseline"] == "torch" and by["fsdp:grads=fp32"]["baseline"] == "fsdp"
        assert abs(by["fsdp"]["rel_mean"]) < 1e-3
        assert by["fsdp:grads=fp32"]["curves"] == by["fsdp"]["curves"] and by["fsdp:grads=fp32"]["rel"] == [0.0]
        q = by["fsdp:grads=int8,weights=int8"]
        assert q["curves"] != by["fsdp"]["curves"] and abs(q["rel_mean"]) < 0.05, wname
        assert q["rel_min"] == q["rel_max"] == q["rel_mean"]
        assert by["fsdp:grads=fp32"]["val_gathered"] == pytest.approx(by["fsdp:grads=fp32"]["val"], rel=1e-6)
        assert q["val_gathered"] != q["val"]
        kinds = q["bytes_by_kind"][0]
        assert kinds["weights_forward"] > 0 and kinds["weights_backward"] > 0 and kinds["gradients"] > 0
    with pytest.raises(SystemExit):
        conv.main(["--quick", "--workloads", "mlp_sgd", "--codecs", "fsdp:weights=sign"])


def test_fsdp_weights_block_option():
    """``weights_block=`` needs a weight codec and a number; it reaches the codec's block size."""
    from flatcomm.tools.bench import convergence_fsdp as cf

    cf.check_options({"weights": "int4", "weights_block": "32"})
    for bad in ({"weights_block": "32"}, {"weights": "int4", "weights_block": "x"}):
        with pytest.raises(ValueError, match="weights_block"):
            cf.check_options(bad)
    with pytest.raises(SystemExit):  # 48 is no block size (a multiple of 32): the Codec refuses it
        conv.main(["--quick", "--workloads", "mlp_sgd", "--codecs", "fsdp:weights=int4,weights_block=48",
                   "--seeds", "1", "--steps-scale", "0.02", "--timeout", "60"])


def test_diloco_and_sparseloco_rows(tmp_path):
    """The sparse grid's rows: DiLoCo with SparseLoCo's recipe and the SparseLoCo baseline train, are
    compared with fp32 DiLoCo at the same H, and count bytes per parameter per sync as their formats
    say (1 seed, 8 steps, H = 4: 2 syncs)."""
    from flatcomm.tools.bench import convergence_diloco as cd
    from flatcomm.tools.bench import sparseloco

    path = tmp_path / "conv.json"
    rows = ["diloco:codec=fp32,H=4", "diloco:codec=sparse,H=4,decay=0.95,outer_lr=1.0,momentum=0.0",
            "sparseloco:H=4,chunking=flat"]
    assert conv.main(["--workloads", "lm_diloco", "--steps-scale", str(8 / 300), "--seeds", "1",
                      "--codecs", ";".join(rows), "--json", str(path), "--timeout", "120"]) == 0
    w = json.loads(path.read_text())["workloads"]["lm_diloco"]
    fp32, sparse, slc = w["rows"]
    assert sparse["baseline"] == slc["baseline"] == rows[0] and fp32["baseline"] is None
    assert fp32["bytes_per_param_per_sync"][0] == pytest.approx(4.0, rel=1e-3)  # 2 replicas: 1x the payload
    n = w["params"]
    assert sparse["bytes_per_param_per_sync"][0] == pytest.approx(88 * math.ceil(n / 4096) / n, rel=0.01)
    model = conv.LMDiLoCo(0, 1.0).model()
    assert slc["bytes_per_param_per_sync"][0] == pytest.approx(
        sparseloco.nominal_bytes_per_param(model, 2, chunking="flat"))
    assert all(math.isfinite(v) for r in w["rows"] for v in r["val"])
    assert len(cd.sparse_grid_rows(15)) == 10 and all("H=15" in r for r in cd.sparse_grid_rows(15))
    table = cd.markdown_table(w["rows"]).splitlines()
    assert len(table) == 2 + len(rows) and table[2].startswith(f"| `{rows[0]}` | {fp32['val'][0]:.4f} (0.0000) | - |")
    assert f"| {100 * sparse['rel_mean']:+.2f}% [" in table[3] and table[4].endswith(
        f"| {slc['bytes_per_param_per_sync'][0]:.4f} |")
    with pytest.raises(ValueError, match="sparseloco rows take"):
        cd.check_options({"H": 4, "codec": "int4"}, "sparseloco")
    with pytest.raises(SystemExit):
        conv.main(["--codecs", "sparseloco:H=4,momentum=0.5"])
