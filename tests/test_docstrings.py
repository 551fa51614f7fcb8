"""The public entry points document their arguments like torch's: an ``Args:`` section naming every
parameter and a short ``Example:`` whose code parses."""
from __future__ import annotations

import ast
import inspect
import re
import textwrap

import pytest

import flatcomm
import flatcomm.ddp
import flatcomm.diloco
import flatcomm.fsdp

ENTRY_POINTS = {
    "flatcomm.diloco.DiLoCo": flatcomm.diloco.DiLoCo,
    "flatcomm.ddp.register": flatcomm.ddp.register,
    "flatcomm.fsdp.apply": flatcomm.fsdp.apply,
    "flatcomm.all_reduce": flatcomm.all_reduce,
    "flatcomm.reduce_scatter": flatcomm.reduce_scatter,
    "flatcomm.all_gather": flatcomm.all_gather,
}


def _sections(doc: str) -> dict:
    """Section name -> its indented body, for Google-style ``Name:`` / ``Name::`` headers."""
    out, name, body = {}, None, []
    for line in doc.splitlines():
        m = re.fullmatch(r"(Args|Returns|Example|Raises)::?", line.strip())
        if m and not line.startswith(" "):
            if name:
                out[name] = "\n".join(body)
            name, body = m.group(1), []
        elif name:
            if line and not line.startswith(" "):  # back to prose: the section ended
                out[name], name = "\n".join(body), None
            else:
                body.append(line)
    if name:
        out[name] = "\n".join(body)
    return out


def _own_parameters(obj) -> list:
    """The parameters the callable itself declares (register's signature shows State's options,
    documented by State; its own are ddp_model, codec and the options mapping)."""
    fn = obj.__init__ if inspect.isclass(obj) else obj
    code = fn.__code__
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARKEYWORDS)]
    return [n for n in names if n not in ("self", "cls")]


def _example_code(example: str) -> str:
    lines = [ln.strip()[4:] for ln in textwrap.dedent(example).splitlines() if ln.strip().startswith((">>> ", "... "))]
    return "\n".join(lines)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_point_has_args_for_every_parameter_and_an_example(name):
    obj = ENTRY_POINTS[name]
    doc = inspect.getdoc(obj) or ""
    sections = _sections(doc)
    assert "Args" in sections and "Example" in sections, f"{name}: sections {sorted(sections)}"
    documented = set(re.findall(r"^\s{4}(\w+):", sections["Args"], flags=re.M))
    missing = [p for p in _own_parameters(obj) if p not in documented]
    assert not missing, f"{name}: Args does not document {missing}"
    unknown = documented - set(_own_parameters(obj))
    assert not unknown, f"{name}: Args documents {sorted(unknown)}, which it does not take"
    code = _example_code(sections["Example"])
    assert code.count("\n") >= 1, f"{name}: Example has no >>> lines"
    ast.parse(code)  # the example is Python


def test_the_checker_finds_a_missing_argument():
    def f(a, *, b=1):
        """Does f.

        Args:
            a: the a.

        Example::

            >>> f(1)
        """

    sections = _sections(inspect.getdoc(f))
    assert set(re.findall(r"^\s{4}(\w+):", sections["Args"], flags=re.M)) == {"a"}
    assert _own_parameters(f) == ["a", "b"]  # b is not documented: the test above would fail
    assert _example_code(sections["Example"]) == "f(1)"
    assert "Example" not in _sections("Does g.\n\nArgs:\n    a: x\n")


def test_help_of_diloco_reads_like_torch():
    text = flatcomm.diloco.DiLoCo.__doc__ or ""
    assert "Args:" in text and "Example::" in text and ">>> outer = flatcomm.diloco.DiLoCo(" in text


def test_the_backend_process_group_overrides_are_typed():
    """Every ProcessGroup method flatcomm's group overrides declares its argument and return types."""
    import torch.distributed as dist

    from flatcomm.backend.group import FlatcommGroup

    overrides = [n for n, f in vars(FlatcommGroup).items()
                 if inspect.isfunction(f) and not n.startswith("_") and hasattr(dist.ProcessGroup, n)]
    assert {"allreduce", "reduce_scatter", "broadcast", "barrier"} <= set(overrides)
    untyped = []
    for n in overrides:
        sig = inspect.signature(getattr(FlatcommGroup, n))
        params = [p for p in sig.parameters.values() if p.name != "self"]
        if sig.return_annotation is inspect.Signature.empty or any(p.annotation is inspect.Parameter.empty for p in params):
            untyped.append(n)
    assert not untyped, f"untyped overrides: {untyped}"
