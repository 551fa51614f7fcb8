"""The route table of docs/backend.md is the code's: every row's call, on 2 ranks of the flatcomm
backend, has the route ``flatcomm.backend.route`` names (decided by flatcomm.comm.route), runs with
the right sum, and is counted under that route in ``flatcomm.backend.stats()["routes"]``."""
from __future__ import annotations

import ast
import pathlib
import re

import torch

from flatcomm.tools import spawn

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "backend.md"
ROW = re.compile(r"^\| `dist\.all_reduce\((?P<expr>.+)\)`(?P<exact>, exact mode)?(?:, codec (?P<codec>\w+))? "
                 r"\| (?P<route>[a-z-]+) \|")


def _rows() -> list:
    text = DOC.read_text()
    section = text[text.index("## Routes"):]
    section = section[:section.index("\n## ", 1)]
    rows = [m.groupdict() for m in map(ROW.match, section.splitlines()) if m]
    assert len(rows) >= 8, rows
    return rows


def _check(rank: int, world: int, rows: list) -> list:
    import torch.distributed as dist

    import flatcomm.backend as fb

    out = []
    for row in rows:
        group = None  # (a row with a codec: a group of its own, configured with it)
        if row["codec"]:
            group = dist.new_group(backend="flatcomm")
            fb.configure(group, codec=row["codec"])
        fb.configure(group, mode="exact" if row["exact"] else "ordered")
        t = eval(row["expr"], {"torch": torch})  # noqa: S307 - the docs' own expressions
        named = fb.route(t, group=group)
        before = fb.stats(group)["routes"].get(named, 0)
        t.fill_(rank + 1)
        dist.all_reduce(t, group=group)
        counted = fb.stats(group)["routes"].get(named, 0) - before
        out.append((row["expr"], row["route"], named, counted, bool((t == sum(range(1, world + 1))).all())))
    return out


def test_the_docs_route_table_is_the_codes():
    rows = _rows()
    assert {r["route"] for r in rows} >= {"small-native", "small", "gathered", "native", "pipelined", "exact",
                                          "passed-through", "full"}
    for result in spawn.run(2, _check, rows, timeout_s=60, backend="flatcomm"):
        for expr, documented, named, counted, right in result:
            assert named == documented, f"{expr}: the docs say {documented}, the code routes it {named}"
            assert counted == 1, (expr, counted)
            assert right, expr


# What decides an all-reduce's route; only flatcomm.comm.route may ask (a reduce-scatter's own
# slot test aside: it has no routes).
_ROUTE_PREDICATES = ("fits_all_reduce", "in_slot", "name_if_native", "runs_natively")
_ALLOWED = {("comm/small.py", "reduce_scatter", "in_slot")}


def _calls(tree):
    """(enclosing function, called name) of every call in a module."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    f = node.func
                    yield fn.name, f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def test_only_the_route_module_decides_an_all_reduces_route():
    root = pathlib.Path(__file__).resolve().parents[1] / "flatcomm"
    asking = set()
    for path in root.rglob("*.py"):
        where = str(path.relative_to(root))
        if where == "comm/route.py":
            continue
        for fn, name in _calls(ast.parse(path.read_text())):
            if name in _ROUTE_PREDICATES and (where, fn, name) not in _ALLOWED:
                asking.add(f"{where}:{fn} calls {name}")
    assert not asking, f"an all-reduce's route decided outside flatcomm/comm/route.py: {sorted(asking)}"


# (values, mode, routes turned off, the route then taken)
_OFF_CASES = [
    ("torch.randn(64)", "ordered", "small-native", "small"),
    ("torch.randn(64)", "ordered", "small-native,small", "gathered"),
    ("torch.randn(64)", "ordered", "small-native,small,gathered", "native"),
    ("torch.randn(64)", "ordered", "small-native,small,gathered,native", "pipelined"),
    ("torch.randn(64)", "exact", "small-native", "small"),
    ("torch.randn(1_200_096)", "ordered", "native", "pipelined"),
    ("torch.randn(1_200_096)", "exact", "native", "exact"),
]


def _off(rank: int, world: int) -> list:
    import os

    import torch.distributed as dist

    import flatcomm.backend as fb
    from flatcomm.comm.route import ROUTES_OFF_ENV

    out = []
    for k, (expr, mode, off, _) in enumerate(_OFF_CASES):
        fb.configure(None, mode=mode)
        torch.manual_seed(100 * k + rank)
        t = eval(expr, {"torch": torch})  # noqa: S307 - the cases above
        want = t.clone()
        plain = dist.new_group(backend="flatcomm")
        dist.all_reduce(want, group=plain)
        os.environ[ROUTES_OFF_ENV] = off
        try:
            g = dist.new_group(backend="flatcomm")  # (a new group: routes are decided once per shape)
            named = fb.route(t, group=g)
            dist.all_reduce(t, group=g)
            dist.all_reduce(t.clone(), group=g)  # (a prepared call's second post)
        finally:
            del os.environ[ROUTES_OFF_ENV]
        out.append((named, torch.equal(t, want), fb.stats(g)["routes"]))
    os.environ[ROUTES_OFF_ENV] = "pipelined"
    try:
        fb.route(torch.ones(3))
    except ValueError as e:
        out.append(str(e))
    finally:
        del os.environ[ROUTES_OFF_ENV]
    return out


def test_routes_turned_off_give_way_to_the_next_with_the_same_sums():
    for res in spawn.run(2, _off, timeout_s=120, backend="flatcomm"):
        *cases, error = res
        for (expr, mode, off, taken), (named, same, counted) in zip(_OFF_CASES, cases):
            assert named == taken, (expr, mode, off, named)
            assert same, (expr, mode, off)
            assert counted.get(taken) == 2 and sum(counted.values()) == 2, (expr, mode, off, counted)
        assert "pipelined cannot be turned off" in error, error
