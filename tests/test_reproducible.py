"""flatcomm.reproducible: the same gradients and weights, bit for bit, on 1, 2 and 4 ranks.

Process start-up dominates on a small machine, so each world size is ONE spawn whose ranks run every
distributed scenario (``_rank_main``) and return a dict; the pytest items compare those dicts across
world sizes and with an in-process run without any process group.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from typing import Dict, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from flatcomm import reproducible as rp
from flatcomm.tools import spawn

WORLDS = (1, 2, 4)
M = 8           # micro-batches per step
MB = 3          # samples per micro-batch
STEPS = 6
JUMP_STEP = 3   # loss x 2^12: the gradient grows by 12 binades > margin, the step replays
INF_STEP = 4    # micro-batch INF_MB's loss is inf: the step is skipped on every rank
INF_MB = 5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, 32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, vocab)

    def forward(self, x):
        return self.fc2(self.drop(F.gelu(self.fc1(self.emb(x).mean(1)))))


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def global_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 40, (M * MB, 5), generator=g), torch.randint(0, 40, (M * MB,), generator=g)


def weights_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(steps: int = STEPS, acc=None, model=None, opt=None, start: int = 0) -> Dict[str, list]:
    model = model or make_model()
    acc = acc or rp.ExactGradAccumulator(model, micro_batches=M)
    opt = opt or torch.optim.Adam(model.parameters(), lr=1e-2)
    out: Dict[str, list] = {"digest": [], "applied": [], "replays": [], "nonfinite": [], "local": []}
    for step in range(start, start + steps):
        x, y = global_batch(step)
        for i in acc.micro_batches():
            loss = F.cross_entropy(model(x[i * MB:(i + 1) * MB]), y[i * MB:(i + 1) * MB])
            if step == JUMP_STEP:
                loss = loss * 4096.0
            if step == INF_STEP and i == INF_MB:
                loss = loss * float("inf")
            loss.backward()
        s = acc.stats
        for k, v in (("digest", s.digest), ("applied", s.applied), ("replays", s.replays),
                     ("nonfinite", s.nonfinite), ("local", s.local_micro_batches)):
            out[k].append(v)
        if s.applied:
            opt.step()
    out["weights"] = weights_hash(model)
    out["model"], out["acc"], out["opt"] = model, acc, opt
    return out


def _rank_main(rank: int, world: int) -> Dict[str, object]:
    rp.configure()
    res = train()
    res = {k: v for k, v in res.items() if k not in ("model", "acc", "opt")}
    # on_nonfinite="raise": every rank raises at the same step with the parameter names.
    model = make_model()
    acc = rp.ExactGradAccumulator(model, micro_batches=M, on_nonfinite="raise")
    try:
        for i in acc.micro_batches():
            loss = model(global_batch(0)[0][i * MB:(i + 1) * MB]).sum()
            (loss * float("inf") if i == M - 1 else loss).backward()
        res["raise"] = "no error"
    except FloatingPointError as e:
        res["raise"] = str(e)
    res["grads_after_raise"] = [p.grad is None for p in model.parameters()]
    # M not a multiple of the world size.
    try:
        rp.ExactGradAccumulator(model, micro_batches=6)
        res["six"] = "ok"
    except ValueError as e:
        res["six"] = str(e)
    # Ranks that disagree on a setting fail together with a clear message.
    if world > 1:
        try:
            rp.ExactGradAccumulator(model, micro_batches=M, margin=2 + rank)
            res["mismatch"] = "ok"
        except ValueError as e:
            res["mismatch"] = str(e)
    return res


@pytest.fixture(scope="module")
def results() -> Dict[int, List[Dict[str, object]]]:
    return {w: spawn.run(w, _rank_main, timeout_s=60) for w in WORLDS}


@pytest.fixture(scope="module")
def local():
    """The same training in this process, without a process group (world 1)."""
    with deterministic():
        return train()


class deterministic:
    """configure() for the duration of a block, restoring every global it touches."""

    def __enter__(self):
        self.saved = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled(),
                      torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                      torch.get_num_threads(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return rp.configure()

    def __exit__(self, *exc):
        det, warn, cd, cb, threads, cublas = self.saved
        torch.use_deterministic_algorithms(det, warn_only=warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cd, cb
        torch.set_num_threads(threads)
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas


# ---- across world sizes ---------------------------------------------------------------------------


def test_same_weights_and_digests_on_1_2_4_ranks(results, local):
    for w, ranks in results.items():
        for r, res in enumerate(ranks):
            assert res["digest"] == local["digest"], f"world {w} rank {r}: per-step digests differ"
            assert res["weights"] == local["weights"], f"world {w} rank {r}: final weights differ"
            assert res["local"] == [n * M // w for n in (2, 1, 1, 2, 1, 1)], res["local"]
    assert len(set(local["digest"])) == STEPS  # the digest does change step to step


def test_first_step_and_jump_replay_everywhere(results, local):
    # Step 0 has no exponent prediction yet; step JUMP_STEP grows by 2^12 > 2^margin.
    assert local["replays"] == [1, 0, 0, 1, 0, 0]
    for w, ranks in results.items():
        for res in ranks:
            assert res["replays"] == local["replays"], f"world {w}"


def test_nonfinite_step_skipped_on_every_rank(results, local):
    expect = [s != INF_STEP for s in range(STEPS)]
    assert local["applied"] == expect
    assert set(local["nonfinite"][INF_STEP]) == {"emb.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    for w, ranks in results.items():
        for res in ranks:
            assert res["applied"] == expect and res["nonfinite"] == local["nonfinite"], f"world {w}"


def test_raise_mode_raises_on_every_rank(results):
    for w, ranks in results.items():
        for r, res in enumerate(ranks):
            assert "step 0: non-finite gradient" in res["raise"] and "fc2.weight" in res["raise"], (w, r)
            assert all(res["grads_after_raise"]), (w, r)


def test_non_divisible_micro_batches_clear_error(results):
    assert results[1][0]["six"] == "ok" and results[2][0]["six"] == "ok"
    for res in results[4]:
        assert re.search(r"micro_batches \(6\) must be a multiple of the world size \(4\).*4 or 8", res["six"])


def test_rank_disagreement_clear_error(results):
    for w in (2, 4):
        for res in results[w]:
            assert "ranks disagree on margin" in res["mismatch"], res["mismatch"]


# ---- in process -------------------------------------------------------------------------------------


def test_gradient_is_exact_mean():
    """The reduced gradient equals the float64 mean of the micro-batch gradients, rounded once."""
    with deterministic():
        model = make_model()
        model.eval()  # no dropout: compare with plain per-micro-batch backward
        x, y = global_batch(0)
        grads = []
        for i in range(M):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[i * MB:(i + 1) * MB]), y[i * MB:(i + 1) * MB]).backward()
            grads.append([p.grad.double().clone() for p in model.parameters()])
        acc = rp.ExactGradAccumulator(model, micro_batches=M)
        for i in acc.micro_batches():
            F.cross_entropy(model(x[i * MB:(i + 1) * MB]), y[i * MB:(i + 1) * MB]).backward()
        for j, p in enumerate(model.parameters()):
            ref = (sum(g[j] for g in grads) / M).float()
            assert p.grad.dtype == p.dtype
            assert torch.equal(p.grad, ref), (j, (p.grad - ref).abs().max())


def test_state_dict_resume_gives_same_digests(local):
    with deterministic():
        first = train(steps=3)
        state = first["acc"].state_dict()
        model, opt = first["model"], first["opt"]
        acc = rp.ExactGradAccumulator(model, micro_batches=M)  # fresh: e.g. after a restart
        acc.load_state_dict(state)
        rest = train(steps=STEPS - 3, acc=acc, model=model, opt=opt, start=3)
        assert first["digest"] + rest["digest"] == local["digest"]
        assert rest["weights"] == local["weights"]


@pytest.mark.parametrize("block", [96, 256])
def test_chunked_conversion_same_bits(block, monkeypatch):
    def digests():
        model = make_model()
        acc = rp.ExactGradAccumulator(model, micro_batches=M, block_size=block)
        return train(steps=4, acc=acc, model=model)["digest"]

    with deterministic():
        whole = digests()
        monkeypatch.setattr(rp.accumulator, "TO_EXACT_CHUNK", 3 * block + 5)  # several chunks per tensor group
        assert digests() == whole


def test_nondeterministic_body_detected_on_replay():
    with deterministic():
        model = make_model()
        acc = rp.ExactGradAccumulator(model, micro_batches=2)
        calls = []
        with pytest.raises(RuntimeError, match="not deterministic"):
            for i in acc.micro_batches():  # the first step always replays (no prediction yet)
                calls.append(i)
                (model(global_batch(0)[0][:2]).sum() * len(calls)).backward()
        assert all(p.grad is None for p in model.parameters())


def test_leaving_the_loop_early_clears_grads():
    with deterministic():
        model = make_model()
        acc = rp.ExactGradAccumulator(model, micro_batches=4)
        for i in acc.micro_batches():
            model(global_batch(0)[0][:2]).sum().backward()
            break
        assert all(p.grad is None for p in model.parameters())
        assert acc.step_count == 0


def test_bfloat16_parameters_and_nan_mode():
    with deterministic():
        model = make_model().to(torch.bfloat16)
        model.eval()
        acc = rp.ExactGradAccumulator(model, micro_batches=2, on_nonfinite="nan")
        x = global_batch(0)[0]
        for i in acc.micro_batches():
            model(x[i * 2:(i + 1) * 2]).float().sum().backward()
        assert acc.stats.applied and all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
        for i in acc.micro_batches():
            (model(x[:2]).float().sum() * (float("nan") if i else 1.0)).backward()
        assert not acc.stats.applied
        assert all(torch.isnan(p.grad).all() for p in model.parameters())


def test_bad_arguments():
    model = make_model()
    with pytest.raises(ValueError, match="on_nonfinite"):
        rp.ExactGradAccumulator(model, micro_batches=2, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="exceed the 2\\^4"):
        rp.ExactGradAccumulator(model, micro_batches=32, headroom=4)
    with pytest.raises(ValueError, match="positive int"):
        rp.ExactGradAccumulator(model, micro_batches=0)
    with pytest.raises(ValueError, match="no parameter"):
        rp.ExactGradAccumulator(nn.ReLU(), micro_batches=2)


def test_configure_sets_and_reports():
    with deterministic() as got:
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.get_num_threads() == 1 and got["num_threads"] == 1
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


# ---- the example under torchrun ---------------------------------------------------------------------


def _example(world: int) -> str:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = ([torchrun, "--standalone", f"--nproc-per-node={world}"] if os.path.exists(torchrun) else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"])
    # The example imports the installed package; here the checkout stands in for it.
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd + ["examples/reproducible_train.py", "--steps", "3", "--micro-batches", "4",
                                 "--batch", "8"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"^weights-sha256: ([0-9a-f]{64})$", proc.stdout, re.M)
    assert len(found) == 1, proc.stdout
    return found[0]


@pytest.mark.slow  # (test_same_weights_and_digests_on_1_2_4_ranks checks the claim in-process)
def test_example_under_torchrun_1_and_2_ranks():
    assert _example(1) == _example(2)
