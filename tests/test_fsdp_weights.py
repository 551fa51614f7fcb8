"""Quantized FSDP2 weight all-gathers (flatcomm.fsdp.weights, apply(weights=)) on gloo, 2 and 4 ranks.

One spawn per world size: every rank runs the sections and returns named results; each pytest item
asserts one section. References: FSDP2's own all-gather on the same model and data (bit for bit
where the codec is lossless), and flatcomm.ops.reference's encode/decode of every rank's shard (bit for
bit for int8/int4). Failure modes reported for DeepSpeed ZeRO++ are tested by name: hpZ diverging
from plain sharding (#4851, #7164 with reentrant checkpointing), a stale node copy after loading a
checkpoint (#7606), silent fallbacks on odd sizes (#5056).
"""
from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from flatcomm.ops import reference as R
from flatcomm.tools import spawn

# ---- model and helpers (run on the ranks) -----------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, d: int, ac: str = ""):
        super().__init__()
        self.norm = nn.LayerNorm(d)  # 1-D parameters, smaller than one block per shard
        self.up = nn.Linear(d, 3 * d + 1)  # odd rows: padded shards
        self.down = nn.Linear(3 * d + 1, d)
        self.ac = ac

    def _f(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))

    def forward(self, h):
        if self.ac == "reentrant":
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._f, h, use_reentrant=True)
        return self._f(h)


class _Net(nn.Module):
    """Embedding, two blocks, a Linear(7, 13) side branch, a Linear(3, 1) (fewer rows than ranks)."""

    def __init__(self, vocab: int = 32, d: int = 24, ac: str = ""):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, ac) for _ in range(2))
        self.side = nn.Linear(7, 13)
        self.side2 = nn.Linear(13, d)
        self.tiny = nn.Linear(3, 1)
        self.head = nn.Linear(d, vocab)

    def forward(self, tok, feat):
        feat = feat.to(self.embed.weight.dtype)
        h = self.embed(tok) + self.side2(torch.relu(self.side(feat))).unsqueeze(1)
        h = h + self.tiny(feat[:, :3]).unsqueeze(1)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _wrap(model, *, mp=None, reshard=True, mesh=None, ac="", grouped=False):
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    if mesh is not None:
        kw["mesh"] = mesh
    if ac == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    for b in model.blocks:
        fully_shard(b, **kw)
    if grouped:  # one FSDP state for two modules
        fully_shard([model.side, model.tiny], **kw)
    else:
        fully_shard(model.side, **kw)  # a leaf FSDP module: 13 rows over 2 or 4 ranks
    fully_shard(model, **kw)
    return model


def _model(seed=0, ac_mode="", dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return _wrap(_Net(ac="reentrant" if ac_mode == "reentrant" else "").to(dtype), ac=ac_mode, **kw)


def _batch(rank: int, step: int, vocab: int = 32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tok = torch.randint(0, vocab, (4, 6), generator=g)
    feat = torch.randn(4, 7, generator=g)
    return tok, feat, (tok * 7 + 3) % vocab


def _loss(model, rank, step):
    tok, feat, target = _batch(rank, step)
    out = model(tok, feat)
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def _clean(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _grads(model) -> Dict[str, torch.Tensor]:
    return {_clean(n): p.grad.to_local().detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _params(model) -> Dict[str, torch.Tensor]:
    return {_clean(n): p.to_local().detach().clone() for n, p in model.named_parameters()}


def _train(model, steps, rank, lr=3e-3, clip=None):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        loss = _loss(model, rank, s)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses, opt


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k]))
                                        for k in a)


def _apply(model, weights="int8", codec="fp32", **kw):
    from flatcomm import fsdp

    return fsdp.apply(model, codec, weights=weights, **kw)


def _capture(model) -> Dict[str, torch.Tensor]:
    """The unsharded parameters each module computes with, as FSDP gathered them (first use; FSDP's
    own pre-forward hook is prepended, so these run after the gather)."""
    seen: Dict[str, torch.Tensor] = {}
    for mname, mod in model.named_modules():
        if not mod._parameters:
            continue

        def hook(m, args, mname=mname):
            for pname, p in m._parameters.items():
                key = _clean(f"{mname}.{pname}" if mname else pname)
                if p is not None and key not in seen:
                    seen[key] = p.detach().clone()

        mod.register_forward_pre_hook(hook)
    return seen


def _expected(master: torch.Tensor, world: int, codec: str, dtype: torch.dtype, block_size: int = 256) -> torch.Tensor:
    """flatcomm.ops.reference's decode of every rank's encoded dim-0-padded shard, cut to the parameter."""
    rows = master.shape[0]
    per = -(-rows // world)
    padded = torch.zeros((per * world, *master.shape[1:]), dtype=master.dtype)
    padded[:rows] = master
    pieces = []
    for r in range(world):
        shard = padded[r * per:(r + 1) * per].reshape(-1)
        payload = R.encode(shard, codec, block_size=block_size)
        pieces.append(R.decode(payload, codec, shard.numel(), block_size=block_size, dtype=dtype))
    return torch.cat(pieces)[:master.numel()].view(master.shape)


class _Recorder:
    """An FSDP all-gather comm that runs flatcomm's and logs (module, in backward?, output)."""

    def __init__(self, comm, name, log):
        self.comm, self.name, self.log = comm, name, log

    def allocate(self, size, *, dtype, device):
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group=None, async_op=False):
        from flatcomm.fsdp.weights import _in_backward

        work = self.comm(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        self.log.append((self.name, _in_backward(), output_tensor.clone()))
        return None


def _record(model, rs):
    log: list = []
    for name, comm in rs.weights.comms.items():
        model.get_submodule(name).set_custom_all_gather(_Recorder(comm, name, log))
    return log


def _gathers(rs) -> Dict[str, int]:
    total: Dict[str, int] = {}
    for comm in {id(c): c for c in rs.weights.comms.values()}.values():  # fully_shard([a, b]): one comm
        for k, v in comm.gathers.items():
            total[k] = total.get(k, 0) + v
    return total


# ---- sections ---------------------------------------------------------------------------------------


def _sec_lossless(rank, world):
    """weights="fp32" (and "bf16" with bf16 compute) == FSDP2's own gather, bit for bit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for tag, mp, codec in (("fp32", None, "fp32"), ("bf16mp_fp32", bf16, "fp32"), ("bf16mp_bf16", bf16, "bf16")):
        ref = _model(mp=mp)
        ref_losses, _ = _train(ref, 3, rank)
        ours = _model(mp=mp)
        rs = _apply(ours, codec)
        losses, _ = _train(ours, 3, rank)
        out[tag] = {"losses": losses == ref_losses, "params": _same(_params(ours), _params(ref)),
                    "n_quantized": len(rs.weights.quantized), "n_params": len(list(ours.parameters()))}
    return out


def _sec_reference(rank, world):
    """int8/int4: every gathered weight == reference decode of each rank's encode; forward and
    backward gathers identical; keep_fp32 parameters exactly FSDP's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    f32, bf16 = torch.float32, torch.bfloat16
    cases = (("int8", f32, None, None), ("int4", f32, None, None), ("int8", bf16, None, None),  # masters' dtype
             ("int8", f32, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32), None),
             ("int8", f32, MixedPrecisionPolicy(param_dtype=torch.float16), ["*.bias", "embed.*", "blocks.*.norm.*"]))
    if world > 2:  # the padding differs; the dtypes and codecs are the 2-rank run's
        cases = cases[::3]
    for codec, master_dtype, mp, keep in cases:
        model = _model(mp=mp, dtype=master_dtype)
        rs = _apply(model, codec, keep_fp32=keep)
        seen = _capture(model)
        log = _record(model, rs)
        _loss(model, rank, 0).backward()
        dtype = mp.param_dtype if mp is not None else master_dtype
        bad = []
        for n, p in model.named_parameters():
            n = _clean(n)
            master = p.full_tensor().detach()
            if n in rs.weights.kept:
                want = master.to(dtype)
            else:
                want = _expected(master, world, codec, dtype)
            if n not in seen or not torch.equal(_bits(seen[n]), _bits(want)):
                bad.append(n)
        fwd = {}
        same_fwd_bwd = True
        for name, bw, data in log:
            if not bw:
                fwd[name] = data
            elif not torch.equal(fwd[name], data):
                same_fwd_bwd = False
        tag = f"{codec}_{str(master_dtype)[6:]}_{'none' if mp is None else str(dtype)[6:]}_{'keep' if keep else 'all'}"
        out[tag] = {"bad": bad, "fwd_bwd_same": same_fwd_bwd, "n_bwd": sum(1 for x in log if x[1]),
                    "kept": sorted(rs.weights.kept), "quantized": sorted(rs.weights.quantized),
                    "all": sorted(_clean(n) for n, _ in model.named_parameters())}
    return out


def _sec_train(rank, world, steps):
    """int8 / int4 weights (and int8 gradients) train like plain FSDP2; gradient clipping works;
    optimizer states and state_dict() are plain."""
    out = {}
    ref, _ = _train(_model(), steps, rank, clip=1.0)
    out["ref"] = ref
    for codec in ("int8", "int4"):
        model = _model()
        rs = _apply(model, codec, codec="int8")
        out[codec], opt = _train(model, steps, rank, clip=1.0)
        st = opt.state_dict()["state"]
        out[f"{codec}_opt_plain"] = all(type(v.to_local()) is torch.Tensor for s in st.values()
                                        for k, v in s.items() if k != "step")
        out[f"{codec}_sd_plain"] = all(type(v.to_local()) is torch.Tensor for v in model.state_dict().values())
        out[f"{codec}_bytes"] = dict(rs.stats.bytes_by_kind)
    return out


def _group_bytes(model, rs) -> Dict[str, int]:
    """What each FSDP module's gather sends from this rank (the input), from the public layout."""
    from torch.distributed.fsdp import FSDPModule

    from flatcomm import fsdp as F

    names = {id(p): _clean(n) for n, p in model.named_parameters()}
    out = {}
    for mname, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        total = 0
        for p in F.fsdp2.managed_params(m):
            c = F.fsdp2.shard_layout(p)[0]
            if names[id(p)] in rs.weights.quantized:
                total += rs.weights.codec.wire_bytes(c)
            else:
                total += c * p.dtype.itemsize
        out[mname] = total
    return out


def _sec_stats(rank, world):
    """bytes_by_kind: forward/backward weight bytes as the layout predicts (every odd-size parameter
    quantized, no silent fallback: DeepSpeed #5056), gradients as without weights=, sum wire_bytes."""
    steps = 2
    plain = _model(grouped=True)
    rs0 = _apply(plain, None, codec="int8", keep_fp32=["*.bias"])  # gradients: the same split
    _train(plain, steps, rank)
    model = _model(grouped=True)
    rs = _apply(model, "int8", codec="int8", keep_fp32=["*.bias"])
    _train(model, steps, rank)
    per = _group_bytes(model, rs)
    want = sum(per.values()) * (world - 1) * steps
    k = rs.stats.bytes_by_kind
    quantized_all = sorted(rs.weights.quantized) == sorted(
        _clean(n) for n, p in model.named_parameters() if not n.endswith(".bias"))
    return {"by_kind": k, "want_fwd": want, "grad_plain": rs0.stats.wire_bytes, "wire": rs.stats.wire_bytes,
            "quantized_all": quantized_all, "plain_weights_none": rs0.weights is None}


def _sec_nonfinite(rank, world):
    """A NaN / inf in a weight shard: its block decodes to NaN on every rank, the rest is exact."""
    out = {}
    for bad in (float("nan"), float("inf")):
        model = _model()
        rs = _apply(model, "int8")
        w = model.blocks[0].up.weight  # (73, 24): 37 rows a shard on 2 ranks
        with torch.no_grad():
            if rank == world - 1:
                w.to_local().view(-1)[300] = bad  # block 1 of the last rank's piece
        master = w.full_tensor().detach()
        seen = _capture(model)
        _loss(model, rank, 0).backward()
        got = seen["blocks.0.up.weight"].reshape(-1)
        per = -(-73 // world) * 24
        start = (world - 1) * per
        nan_idx = torch.isnan(got).nonzero().flatten()
        finite = master.clone()
        finite.view(-1)[start + 300] = 0.0
        ref = _expected(finite, world, "int8", torch.float32).reshape(-1)
        mask = torch.ones_like(got, dtype=torch.bool)
        mask[start + 256:min(start + 512, got.numel())] = False
        out[str(bad)] = {"nan_range": (nan_idx.min().item(), nan_idx.max().item()) if nan_idx.numel() else None,
                         "want_range": (start + 256, min(start + 512, got.numel()) - 1),
                         "rest_exact": torch.equal(got[mask], ref[mask]),
                         "master_kept": bool(torch.isnan(master).any() or torch.isinf(master).any())}
    return out


def _sec_dcp(rank, world, tmpdir, reshard):
    """A checkpoint written with quantized gathers loads into plain FSDP2 and back, bit for bit,
    optimizer included; the step after loading is the uninterrupted run's, also when the model had
    gathered (and, with hpZ, kept node rows) before the load (DeepSpeed #7606)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save(model, opt, path):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        return msd, osd

    def load(model, opt, path):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def step(model, opt, s):
        opt.zero_grad()
        _loss(model, rank, s).backward()
        opt.step()

    # gradients lossless: int8 gradients would need their residuals too (rs.state_dict(), tested
    # in test_fsdp.py); the weights have no state beyond the masters
    a = _model(reshard=reshard)
    _apply(a, "int8")
    _, opt_a = _train(a, 2, rank)
    msd, osd = save(a, opt_a, f"{tmpdir}/q{world}")
    tensors = list(msd.values()) + [v for st in osd["state"].values() for v in st.values() if v.dim()]
    plain_types = all(type(getattr(v, "_local_tensor", v)) is torch.Tensor for v in tensors)
    saved_a = _params(a)
    step(a, opt_a, 2)  # the uninterrupted run

    b = _model(seed=1, reshard=reshard)  # plain FSDP2, another init
    opt_b = torch.optim.Adam(b.parameters(), lr=3e-3)
    step(b, opt_b, 0)  # state to be overwritten
    load(b, opt_b, f"{tmpdir}/q{world}")
    b_equal_a = _same(_params(b), saved_a)
    save(b, opt_b, f"{tmpdir}/p{world}")

    c = _model(seed=2, reshard=reshard)
    _apply(c, "int8")
    opt_c = torch.optim.Adam(c.parameters(), lr=3e-3)
    step(c, opt_c, 0)  # gathers (and hpZ rows) before the load
    _loss(c, rank, 1)  # a forward without backward: kept rows of other weights
    load(c, opt_c, f"{tmpdir}/p{world}")
    c_equal_a = _same(_params(c), saved_a)
    step(c, opt_c, 2)

    d = _model(seed=3, reshard=reshard)  # load_state_dict(assign=True) puts new parameters in
    rs_d = _apply(d, "int8")
    d.load_state_dict({k: v.detach().clone() for k, v in c.state_dict().items()}, assign=True)
    with torch.no_grad():
        same_loss = _loss(d, rank, 3).item() == _loss(c, rank, 3).item()
    return {"plain_types": plain_types, "b_equal_a": b_equal_a, "c_equal_a": c_equal_a,
            "next_step_bitwise": _same(_params(c), _params(a)),
            "local_type": type(c.blocks[0].up.weight._local_tensor).__name__,
            "assign_wrapped": all(type(p._local_tensor).__name__ == "QuantizedWeight" for p in d.parameters()),
            "assign_same_loss": same_loss, "assign_gathers": _gathers(rs_d)["forward"]}


def _sec_ac(rank, world, reshard):
    """Activation checkpointing (checkpoint_wrapper, reentrant torch.utils.checkpoint): gradients
    and gathered bytes as without it (DeepSpeed #7164: hpZ + reentrant checkpointing)."""
    out = {}
    base = _model(reshard=reshard)
    _apply(base, "int8", codec="int8")
    _loss(base, rank, 0).backward()
    ref = _grads(base)
    for mode in ("wrapper", "reentrant"):
        m = _model(reshard=reshard, ac_mode=mode)
        rs = _apply(m, "int8", codec="int8")
        _loss(m, rank, 0).backward()
        out[mode] = _same(_grads(m), ref)
        out[f"{mode}_gathers"] = _gathers(rs)
    return out


def _sec_errors(rank, world):
    """Bad arguments raise clearly; apply after the first forward refuses; ranks that disagree all raise."""
    from flatcomm import fsdp

    out = {}
    for bad in ("sign", "topk", "auto", "nope", 3):
        try:
            fsdp.apply(_model(), "int8", weights=bad)
            out[repr(bad)] = "no error"
        except (ValueError, TypeError) as e:
            out[repr(bad)] = f"{type(e).__name__}: {e}"
    m = _model()
    fsdp.apply(m, "int8", weights="int8")
    try:
        fsdp.apply(m, "int8", weights="int4")
        out["twice"] = "no error"
    except ValueError as e:
        out["twice"] = str(e)
    m = _model()
    _loss(m, rank, 0).backward()
    try:
        fsdp.apply(m, "int8", weights="int8")
        out["late"] = "no error"
    except ValueError as e:
        out["late"] = str(e)
    m = _model()
    fsdp.apply(m, "fp32", weights="int8" if rank == 0 else "int4")
    try:
        _loss(m, rank, 0).backward()
        out["disagree"] = "no error"
    except RuntimeError as e:
        out["disagree"] = str(e)
    return out


def _sec_hpz(rank, world):
    """2x2 as nodes: reshard_after_forward True / False / 2 give the same bits; with 2 the backward
    gathers run in the node group with the bytes predicted (DeepSpeed #4851: hpZ must not change
    the loss)."""
    out = {}
    plain2, _ = _train(_model(reshard=2, grouped=True), 3, rank)
    plain_true, _ = _train(_model(reshard=True, grouped=True), 3, rank)
    out["plain_2_eq_true"] = plain2 == plain_true
    runs = {}
    for reshard in (True, False, 2):
        m = _model(reshard=reshard, grouped=True)
        rs = _apply(m, "int8", codec="int8")
        losses, _ = _train(m, 3, rank)
        runs[str(reshard)] = {"losses": losses, "params": _params(m), "by_kind": dict(rs.stats.bytes_by_kind),
                              "hpz": dict(rs.weights.hpz), "gathers": _gathers(rs)}
    for k in ("False", "2"):
        out[f"same_{k}"] = runs[k]["losses"] == runs["True"]["losses"] and _same(runs[k]["params"], runs["True"]["params"])
    for v in runs.values():
        v.pop("params")
    out["runs"] = runs
    return out


def _sec_stale(rank, world):
    """hpZ rows kept in forward are not used once the weights changed: a master written between
    forward and backward makes that module's backward gather re-encode it over all ranks."""
    m = _model(reshard=2)
    rs = _apply(m, "int8")
    seen: Dict[str, torch.Tensor] = {}

    def grab(mod, grad_output):  # in backward, after the block's backward gather
        seen["w"] = mod.weight.detach().clone()

    m.blocks[0].up.register_full_backward_pre_hook(grab)
    loss = _loss(m, rank, 0)
    w = m.blocks[0].up.weight
    with torch.no_grad():
        w.add_(0.5)  # DTensor in place: every rank's shard
    want = _expected(w.full_tensor().detach(), world, "int8", torch.float32)
    loss.backward()
    return {"block0": dict(rs.weights.comms["blocks.0"].gathers), "block1": dict(rs.weights.comms["blocks.1"].gathers),
            "fresh": torch.equal(seen["w"], want)}


def _sec_hsdp(rank, world):
    """HSDP: native 2-D mesh and flatcomm.fsdp.hybrid, both with int8 weights."""
    from torch.distributed.device_mesh import init_device_mesh

    from flatcomm.fsdp import hybrid as fsdp_hybrid

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    ref, _ = _train(_model(mesh=mesh), 4, rank)
    m = _model(mesh=mesh)
    rs = _apply(m, "int8")
    out["native"], _ = _train(m, 4, rank)
    out["native_q"] = len(rs.weights.quantized)
    h = _model(mesh=mesh["shard"])
    hs = fsdp_hybrid.apply(h, mesh, "int8", weights="int8")
    out["hybrid"], _ = _train(h, 4, rank)
    out["hybrid_q"] = len(hs.rs.weights.quantized)
    out["hybrid_fwd"] = hs.rs.stats.weights_forward_bytes
    out["ref"] = ref
    return out


def _rank_main(rank, world, tmpdir):
    torch.manual_seed(0)
    if world == 2:
        return {"lossless": _sec_lossless(rank, world), "reference": _sec_reference(rank, world),
                "train": _sec_train(rank, world, 12), "stats": _sec_stats(rank, world),
                "nonfinite": _sec_nonfinite(rank, world), "dcp": _sec_dcp(rank, world, tmpdir, True),
                "ac": _sec_ac(rank, world, True), "errors": _sec_errors(rank, world)}
    return {"reference": _sec_reference(rank, world), "hpz": _sec_hpz(rank, world),
            "dcp": _sec_dcp(rank, world, tmpdir, 2), "stale": _sec_stale(rank, world),
            "ac": _sec_ac(rank, world, 2), "hsdp": _sec_hsdp(rank, world)}


# ---- pytest side ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    return spawn.run(2, _rank_main, str(tmp_path_factory.mktemp("w2")), timeout_s=240)


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    return spawn.run(4, _rank_main, str(tmp_path_factory.mktemp("w4")), timeout_s=240)


def test_lossless_weight_codecs_match_fsdp_bitwise(ranks2):
    for r in ranks2:
        for tag, v in r["lossless"].items():
            assert v["losses"] and v["params"], (tag, v)
            assert v["n_quantized"] == v["n_params"], (tag, v)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gathered_weights_equal_reference_decode(world, request):
    for r in request.getfixturevalue(f"ranks{world}"):
        for tag, v in r["reference"].items():
            assert not v["bad"], (tag, v["bad"])
            assert v["fwd_bwd_same"] and v["n_bwd"] > 0, (tag, v)
            if tag.endswith("keep"):
                assert "embed.weight" in v["kept"] and "blocks.0.norm.weight" in v["kept"], v["kept"]
                assert "blocks.0.up.weight" in v["quantized"], v
            else:
                assert v["quantized"] == v["all"] and not v["kept"], v


def test_int8_weights_train_like_fsdp(ranks2):
    t = ranks2[0]["train"]
    ref, q8, q4 = t["ref"], t["int8"], t["int4"]
    assert ref[-1] < 0.8 * ref[0], "the model does not learn: the comparison would be vacuous"
    assert abs(q8[-1] - ref[-1]) <= 0.01 * ref[-1], (q8[-3:], ref[-3:])
    assert abs(q4[-1] - ref[-1]) <= 0.1 * ref[-1], (q4[-3:], ref[-3:])
    for r in ranks2:
        tr = r["train"]
        for c in ("int8", "int4"):
            assert tr[f"{c}_opt_plain"] and tr[f"{c}_sd_plain"], tr
        assert tr["int4_bytes"]["weights_forward"] < 0.6 * tr["int8_bytes"]["weights_forward"], tr


def test_stats_bytes_by_kind(ranks2):
    for r in ranks2:
        s = r["stats"]
        k = s["by_kind"]
        assert k["weights_forward"] == s["want_fwd"] > 0, s
        assert k["weights_backward"] == s["want_fwd"], s  # every module reshards after forward here
        assert k["gradients"] == s["grad_plain"] > 0, s
        assert sum(k.values()) == s["wire"], s
        assert s["quantized_all"] and s["plain_weights_none"], s


def test_nonfinite_weight_makes_its_block_nan(ranks2):
    for r in ranks2:
        for bad, v in r["nonfinite"].items():
            assert v["nan_range"] == v["want_range"], (bad, v)
            assert v["rest_exact"], (bad, v)
            assert v["master_kept"], (bad, v)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dcp_round_trip_quantized_plain_quantized(world, request):
    for r in request.getfixturevalue(f"ranks{world}"):
        d = r["dcp"]
        assert d["plain_types"], d
        assert d["b_equal_a"] and d["c_equal_a"], d
        assert d["next_step_bitwise"], d
        assert d["local_type"] == "QuantizedWeight", d
        assert d["assign_wrapped"] and d["assign_same_loss"] and d["assign_gathers"] > 0, d


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_activation_checkpointing(world, request):
    for r in request.getfixturevalue(f"ranks{world}"):
        a = r["ac"]
        assert a["wrapper"] and a["reentrant"], a
        for mode in ("wrapper", "reentrant"):
            g = a[f"{mode}_gathers"]
            # 2 ranks: every backward gather over both; 4 ranks with reshard 2: all in the node (hpZ)
            assert g["forward"] > 0 and g[{2: "backward_full", 4: "backward_node"}[world]] == g["forward"], (mode, g)


def test_bad_arguments_raise_clearly(ranks2):
    for r in ranks2:
        e = r["errors"]
        assert e["'sign'"].startswith("ValueError") and "cannot gather weights" in e["'sign'"], e
        assert e["'topk'"].startswith("ValueError"), e
        assert e["'auto'"].startswith("ValueError") and "fixed codec" in e["'auto'"], e
        assert e["'nope'"].startswith("ValueError") and "unknown codec" in e["'nope'"], e
        assert e["3"].startswith("TypeError"), e
        assert "before the first forward" in e["late"], e
        assert "quantized already" in e["twice"], e
        assert "disagree" in e["disagree"], e


def test_hpz_reshard_int_in_node_group(ranks4):
    for r in ranks4:
        h = r["hpz"]
        assert h["plain_2_eq_true"], h
        assert h["same_False"] and h["same_2"], h
        runs = h["runs"]
        fwd = runs["True"]["by_kind"]["weights_forward"]
        assert fwd > 0 and all(v["by_kind"]["weights_forward"] == fwd for v in runs.values()), runs
        assert runs["False"]["by_kind"]["weights_backward"] == 0, runs
        assert runs["True"]["by_kind"]["weights_backward"] == fwd, runs  # every module reshards
        two = runs["2"]
        assert set(two["hpz"]) == {"blocks.0", "blocks.1", "side", "tiny", ""}, two  # side+tiny: one state
        assert set(two["hpz"].values()) == {2}, two
        g = two["gathers"]
        assert g["backward_node"] == g["forward"] > 0 and g["backward_full"] == 0, g
        assert runs["True"]["gathers"]["backward_full"] == g["forward"], runs
        # in the node: this rank's 2 kept pieces to 1 peer, instead of its 1 piece to 3 peers
        assert two["by_kind"]["weights_backward"] * 3 == runs["True"]["by_kind"]["weights_backward"] * 2, runs


def test_hpz_rows_not_used_after_the_weights_changed(ranks4):
    for r in ranks4:
        s = r["stale"]
        assert s["block0"] == {"forward": 1, "backward_node": 0, "backward_full": 1}, s
        assert s["block1"] == {"forward": 1, "backward_node": 1, "backward_full": 0}, s
        assert s["fresh"], s


def test_hsdp(ranks4):
    h = ranks4[0]["hsdp"]
    assert h["native_q"] > 0 and h["hybrid_q"] > 0 and h["hybrid_fwd"] > 0, h
    assert abs(h["native"][-1] - h["ref"][-1]) <= 0.01 * h["ref"][-1], h
    assert abs(h["hybrid"][-1] - h["ref"][-1]) <= 0.02 * h["ref"][-1], h


# ---- single process ---------------------------------------------------------------------------------


def test_decode_rows_into_matches_reference_and_survives_garbage(gen):
    import flatcomm
    from flatcomm.fsdp.weights import decode_rows_into

    codec = flatcomm.Codec("int8", block_size=64)
    row_numel, world, numel = 100, 3, 233  # the last row holds 33 values
    xs = [torch.randn(row_numel, generator=gen) for _ in range(world)]
    rows = torch.stack([flatcomm.encode(x, codec) for x in xs])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.full((numel,), 7.0, dtype=dtype)
        decode_rows_into(rows, codec, row_numel, out)
        want = torch.cat([R.decode(rows[r], "int8", row_numel, block_size=64, dtype=dtype) for r in range(world)])
        assert torch.equal(_bits(out), _bits(want[:numel])), dtype
    garbage = torch.randint(0, 256, rows.shape, generator=gen, dtype=torch.uint8)
    out = torch.empty(numel)
    decode_rows_into(garbage, codec, row_numel, out)  # any bytes: some values, no crash
    want = torch.cat([R.decode(garbage[r], "int8", row_numel, block_size=64) for r in range(world)])[:numel]
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    with pytest.raises(RuntimeError, match="bytes per row"):
        decode_rows_into(rows[:, :-16].contiguous(), codec, row_numel, out)


def test_quantized_weight_ops_return_plain_tensors(gen):
    import flatcomm
    from flatcomm.fsdp.weights import QuantizedWeight, _Spec

    local = torch.randn(5, 3, generator=gen)
    w = QuantizedWeight(local, _Spec(flatcomm.Codec("int8"), 15, 30, "w"))
    assert w.data_ptr() == local.data_ptr()  # the same storage
    for t in (w.detach(), torch.zeros_like(w), w * 2, w.clone(), w.view(-1)):
        assert type(t) is torch.Tensor
    w.add_(1.0)
    assert torch.equal(local, w.detach())  # in place: the master itself
    import copy

    c = copy.deepcopy(w)
    assert type(c) is QuantizedWeight and torch.equal(c.detach(), local) and c.data_ptr() != local.data_ptr()
    (payload,), _ = w.fsdp_pre_all_gather(None)
    assert payload.dtype == torch.uint8 and payload.numel() == flatcomm.wire_bytes("int8", 15)
    with pytest.raises(RuntimeError, match="whole payloads"):
        w.fsdp_post_all_gather((payload[:-1],), None, torch.float32)
    with pytest.raises(RuntimeError, match="cannot hold"):
        w.fsdp_post_all_gather((payload,), None, torch.float32)  # one piece of 15 for 30 values
    full, free = w.fsdp_post_all_gather((torch.cat([payload, payload]),), None, torch.bfloat16)
    assert full.dtype == torch.bfloat16 and full.numel() == 30 and free[0] is full


def test_weight_codec_choices():
    import flatcomm
    from flatcomm.fsdp.weights import weight_codec

    assert weight_codec("int4").name == "int4"
    assert weight_codec(flatcomm.Codec("int8", block_size=128)).block_size == 128
    with pytest.raises(ValueError, match="cannot gather weights"):
        weight_codec(flatcomm.Codec("sign"))
