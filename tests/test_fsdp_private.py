"""The private FSDP attributes flatcomm still reads (flatcomm.fsdp.frames) exist in this torch,
and the public layout flatcomm.fsdp derives from DTensor placements equals FSDP's own.

If a torch release renames one of them, test_private_attributes_exist fails and names it: flatcomm
itself would only fall back to size-keyed residuals (see flatcomm.fsdp's module docstring)."""
from __future__ import annotations

import torch
import torch.nn as nn

from flatcomm.fsdp import frames as _fsdp_private
from flatcomm.tools import spawn


def test_private_attributes_exist():
    problems = _fsdp_private.check()
    assert not problems, "torch changed FSDP internals flatcomm reads: " + "; ".join(problems)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5, bias=False))  # uneven rows
        self.tail = nn.Linear(5, 3)
        self.unused = nn.Linear(3, 3)  # no gradient in some steps
        self.scale = nn.Parameter(torch.ones(1))  # one row over 2 ranks: padded

    def forward(self, x, use_all=True):
        y = self.tail(self.inner(x)) * self.scale
        return self.unused(y) if use_all else y


def _rank(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import flatcomm.fsdp as F

    torch.manual_seed(0)
    net = _Net()
    fully_shard(net.inner)
    fully_shard(net)
    names = {id(p): n for n, p in net.named_parameters()}
    layouts = {}
    for m in net.modules():
        if isinstance(m, FSDPModule):
            public = [(n, c) for n, c, _ in F.fsdp2._module_layout(m, names)]
            private = []
            for group in _fsdp_private.fsdp2_param_groups(m):
                for fp in group:
                    param, fqn, c = _fsdp_private.param_piece(fp)
                    private.append((names.get(id(param), fqn), c))
            layouts[type(m).__name__] = (public, private)
    rs = F.apply(net, "int8")
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    net(x).sum().backward()
    after_full = dict(rs.layout_sources)
    net(x, use_all=False).sum().backward()  # net's group without `unused`: FSDP's own list
    dist.barrier()
    return layouts, after_full, dict(rs.layout_sources), sorted(rs.state_dict())


def test_public_layout_equals_fsdps_own():
    for layouts, full, partial, keys in spawn.run(2, _rank, timeout_s=180):
        for what, (public, private) in layouts.items():
            assert public == private, what
            assert public, what
        assert full == {"module": 2, "fsdp_frame": 0, "size": 0}
        assert partial == {"module": 3, "fsdp_frame": 1, "size": 0}
        assert any(k.endswith("unused.weight") for k in keys)
