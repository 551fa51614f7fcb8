"""Every fenced code block of README.md, CONTRIBUTING.md and docs/*.md runs, or its commands parse.

* ```python blocks are executed, each in a fresh namespace, in a temporary working directory. A
  block whose first lines say ``# ranks: N`` runs on N gloo ranks (:mod:`flatcomm.tools.spawn`);
  the others in one plain process without a process group. All blocks of one rank count share one
  run (blocks run in document order, and a rank stops at its first failure), so the whole file
  costs one spawn per rank count. ``# docs-test: skip <reason>`` keeps a block from running (it is
  still compiled); the reason is required.
* ```bash / ```sh blocks are not run. Every command in them is checked: ``make X`` names a
  Makefile target, ``python -m flatcomm.*`` and ``python <script>`` / ``torchrun <script>`` lines
  parse with that tool's own argparse parser (the tool's ``main`` runs up to ``parse_args`` and
  stops there), ``pip install`` names only extras that pyproject.toml defines, and any other
  program must be one listed in ``UNCHECKED``.
* ```text blocks (output, listings) are not run; a fence without a language is an error.

``test_checker_catches_broken_blocks`` feeds the checkers broken snippets, so none of this can
pass vacuously.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import multiprocessing
import os
import re
import shlex
import sys
import tempfile
import traceback
import types
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"python", "bash", "sh", "text"}
# Programs a shell block may name that the checker does not look into (they take no flatcomm
# arguments). Anything else is an error, so a misspelt command cannot hide.
UNCHECKED = {"cd", "cmake", "ctest", "git", "ip", "tc", "nvcc", "export", "ls", "cat", "echo", "mkdir", "rm",
             "nvidia-smi", "ninja"}
RANKS_RE = re.compile(r"^#\s*ranks:\s*(\d+)\s*$")
SKIP_RE = re.compile(r"^#\s*docs-test:\s*skip\b\s*(.*)$")
BLOCK_TIMEOUT_S = 60.0  # gloo timeout of a multi-rank run: a block that fails on one rank only ends there


@dataclasses.dataclass(frozen=True)
class Block:
    path: str   # relative to the repository root
    line: int   # line of the opening fence
    lang: str
    text: str
    ranks: int = 0          # 0: one plain process; N: N gloo ranks
    skip: Optional[str] = None  # the reason, when the block is not run
    excerpt: Optional[str] = None  # a file whose lines the block quotes in order (that file runs elsewhere)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


class DocError(ValueError):
    pass


def parse_blocks(text: str, path: str) -> List[Block]:
    """The fenced blocks of a Markdown text; raises DocError for a fence without a known language,
    an unclosed fence or a bad marker."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,}|~{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group(1), m.group(2), m.group(3).strip()
        start = i + 1
        j = start
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        if j == len(lines):
            raise DocError(f"{path}:{i + 1}: unclosed code fence")
        lang = info.split()[0].lower() if info else ""
        if lang not in LANGS:
            raise DocError(f"{path}:{i + 1}: code fence language {lang or '(none)'!r}: use one of {sorted(LANGS)} "
                           "(```text for output and listings)")
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[start:j])
        ranks, skip = _markers(body, f"{path}:{i + 1}") if lang == "python" else (0, None)
        excerpt = None
        note = _note_before(lines, i)
        if note is not None:
            kind, arg = note
            if lang != "python":
                raise DocError(f"{path}:{i + 1}: a docs-test note applies to python blocks only")
            if kind == "skip":
                skip = _reason(arg, f"{path}:{i + 1}")
            else:
                excerpt = arg
                if not (ROOT / excerpt).is_file():
                    raise DocError(f"{path}:{i + 1}: the excerpt's file {excerpt} does not exist")
        out.append(Block(path, i + 1, lang, body + "\n", ranks, skip, excerpt))
        i = j + 1
    return out


NOTE_RE = re.compile(r"^\s*<!--\s*docs-test:\s*(\S+)\s*(.*?)\s*-->\s*$")


def _note_before(lines: List[str], i: int) -> Optional[Tuple[str, str]]:
    """An HTML comment ``<!-- docs-test: skip <reason> -->`` or ``<!-- docs-test: excerpt
    <file> -->`` on the line before a fence (invisible when rendered)."""
    if i == 0:
        return None
    m = NOTE_RE.match(lines[i - 1])
    if m is None:
        return None
    if m.group(1) not in ("skip", "excerpt"):
        raise DocError(f"line {i}: unknown docs-test note {m.group(1)!r}: 'skip <reason>' or 'excerpt <file>'")
    return m.group(1), m.group(2)


def _reason(text: str, where: str) -> str:
    reason = text.strip(" -:—")
    if len(reason.split()) < 3:
        raise DocError(f"{where}: '# docs-test: skip' needs a reason (why the block cannot run here)")
    return reason


def _markers(body: str, where: str) -> Tuple[int, Optional[str]]:
    ranks, skip = 0, None
    for ln in body.splitlines():
        if not ln.startswith("#"):
            break
        if ln.lstrip("# ").startswith("ranks") and not RANKS_RE.match(ln):
            raise DocError(f"{where}: bad marker {ln!r}: write '# ranks: N'")
        if RANKS_RE.match(ln):
            ranks = int(RANKS_RE.match(ln).group(1))
            if ranks < 2:
                raise DocError(f"{where}: '# ranks: {ranks}': a block without the marker runs in one process")
        m = SKIP_RE.match(ln)
        if m:
            skip = _reason(m.group(1), where)
    return ranks, skip


@functools.lru_cache(maxsize=None)
def _parsed() -> Tuple[Tuple[Block, ...], Tuple[str, ...]]:
    blocks: List[Block] = []
    errors: List[str] = []
    for f in DOC_FILES:
        try:
            blocks += parse_blocks(f.read_text(), str(f.relative_to(ROOT)))
        except DocError as e:  # reported by test_every_fence_is_well_formed
            errors.append(str(e))
    return tuple(blocks), tuple(errors)


def all_blocks() -> Tuple[Block, ...]:
    return _parsed()[0]


def _ids(kind: Sequence[str]) -> List[Block]:
    return [b for b in all_blocks() if b.lang in kind]


# ---- python blocks --------------------------------------------------------------------------------


def run_block(block: Block) -> Optional[str]:
    """Execute one block in a fresh namespace; None when it passed, else the traceback."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    out = io.StringIO()
    try:
        code = compile(block.text, block.id, "exec")
        with contextlib.redirect_stdout(out):
            exec(code, {"__name__": "__docs__"})
        return None
    except BaseException:  # noqa: BLE001 - reported per block, with what it printed
        return f"{traceback.format_exc()}\n--- the block printed:\n{out.getvalue()[-2000:]}"
    finally:  # a block may configure torch globally (flatcomm.reproducible.configure): undo it
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def run_blocks(rank: int, world: int, blocks: Sequence[Block], workdir: str) -> Dict[str, Optional[str]]:
    """Run ``blocks`` in order in ``workdir`` (one directory for all ranks, as a shared file system
    would be); stop at the first failure (with several ranks a later block could pair its
    collectives with an unfinished one of another rank)."""
    results: Dict[str, Optional[str]] = {}
    with _chdir(workdir):
        for b in blocks:
            err = run_block(b)
            results[b.id] = err
            if err is not None and world > 1:
                break
    return results


@contextlib.contextmanager
def _chdir(path: str):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _one_process(blocks: Sequence[Block], workdir: str) -> Dict[str, Optional[str]]:
    return run_blocks(0, 1, blocks, workdir)


@functools.lru_cache(maxsize=None)
def python_results(ranks: int) -> Dict[str, Optional[str]]:
    """Results of every runnable python block that wants ``ranks`` ranks (0: one process), run once."""
    blocks = [b for b in _ids(["python"]) if b.ranks == ranks and b.skip is None and b.excerpt is None]
    if not blocks:
        return {}
    try:
        with tempfile.TemporaryDirectory() as workdir:
            if ranks == 0:
                ctx = multiprocessing.get_context("spawn")
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
                    return ex.submit(_one_process, blocks, workdir).result(timeout=300)
            from flatcomm.tools import spawn

            per_rank = spawn.run(ranks, run_blocks, blocks, workdir, timeout_s=BLOCK_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - the run itself broke: every block of it fails with why
        why = traceback.format_exc()
        return {b.id: f"the {ranks or 1}-process run failed:\n{why}" for b in blocks}
    return merge(blocks, per_rank)


def merge(blocks: Sequence[Block], per_rank: Sequence[Dict[str, Optional[str]]]) -> Dict[str, Optional[str]]:
    """One result per block from every rank's: a block passes when it passed on every rank."""
    merged: Dict[str, Optional[str]] = {}
    for b in blocks:
        for r, res in enumerate(per_rank):
            if b.id not in res:
                first = next((k for k, v in res.items() if v is not None), "?")
                merged[b.id] = merged.get(b.id) or f"not run on rank {r}: an earlier block failed there ({first})"
            elif res[b.id] is not None and merged.get(b.id) is None:
                merged[b.id] = f"rank {r}:\n{res[b.id]}"
            else:
                merged.setdefault(b.id, None)
    return merged


@pytest.mark.parametrize("block", _ids(["python"]), ids=lambda b: b.id)
def test_python_block(block: Block):
    compile(block.text, block.id, "exec")  # skipped blocks are still valid Python
    if block.skip is not None:
        pytest.skip(block.skip)
    if block.excerpt is not None:
        missing = excerpt_mismatch(block)
        assert missing is None, f"{block.id}: {missing!r} is not in {block.excerpt} (in this order)"
        return
    res = python_results(block.ranks)[block.id]
    assert res is None, f"{block.id} failed: {res}"


def excerpt_mismatch(block: Block) -> Optional[str]:
    """The first line of an excerpt block that its file lacks (after the previous one), or None."""
    lines = [ln.strip() for ln in (ROOT / str(block.excerpt)).read_text().splitlines()]
    at = 0
    for ln in (x.strip() for x in block.text.splitlines() if x.strip()):
        if ln not in lines[at:]:
            return ln
        at = lines.index(ln, at) + 1
    return None


# ---- shell blocks ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset:
    text = (ROOT / "Makefile").read_text()
    names = set()
    for m in re.finditer(r"^([A-Za-z0-9_.\- ]+?)\s*:(?!=)", text, re.M):
        names.update(n for n in m.group(1).split() if not n.startswith((".", "$")))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def extras() -> frozenset:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: the table's keys, read by hand
        table = re.search(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
        return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*=", table.group(1), re.M) if table else ())
    return frozenset(tomllib.loads(text)["project"].get("optional-dependencies", {}))


def commands(script: str) -> List[List[str]]:
    """The simple commands of a shell snippet: continuation lines joined, comments dropped, split
    at ; && || | &, loop keywords and leading VAR=value / sudo / nice removed; loop variables take
    their first value."""
    text = script.replace("\\\n", " ")
    out: List[List[str]] = []
    loop_vars: Dict[str, str] = {}
    for line in text.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        cmd: List[str] = []
        for tok in list(lex) + [";"]:
            if tok and set(tok) <= set(";&|"):
                if cmd:
                    out.append(cmd)
                cmd = []
                continue
            cmd.append(tok)
    cleaned = []
    for cmd in out:
        while cmd and cmd[0] in ("do", "then", "else", "done", "fi"):
            cmd = cmd[1:]
        if not cmd:
            continue
        if cmd[0] == "for" and len(cmd) >= 4 and cmd[2] == "in":
            loop_vars[cmd[1]] = cmd[3]
            continue
        while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
            cmd = cmd[1:]
        while cmd and cmd[0] in ("sudo", "time", "nice"):
            cmd = cmd[3:] if cmd[0] == "nice" and len(cmd) > 2 and cmd[1] == "-n" else cmd[1:]
        cmd = [re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: loop_vars.get(m.group(1), m.group(0)), t)
               for t in cmd]
        if cmd:
            cleaned.append(cmd)
    return cleaned


class _Parsed(Exception):
    pass


@contextlib.contextmanager
def _parse_only(argv0: str, args: Sequence[str]):
    """While active, ArgumentParser.parse_args parses and then raises _Parsed (the tool stops)."""
    original = argparse.ArgumentParser.parse_args
    saved_argv = sys.argv

    def parse_args(self, args=None, namespace=None):
        ns = original(self, args, namespace)
        raise _Parsed(ns)

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign]
    sys.argv = [argv0, *args]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv = saved_argv


def _call_main(main, argv0: str, args: Sequence[str], what: str) -> Optional[str]:
    """Run ``main()`` up to its argument parsing; None when the arguments parse, else why not."""
    with _parse_only(argv0, args):
        try:
            main()
        except _Parsed:
            return None
        except SystemExit as e:
            if e.code in (0, None):  # --help / --version
                return None
            return f"{what}: the arguments {list(args)} do not parse (exit {e.code})"
    return f"{what}: main() returned without parsing its arguments"


def _tool_main(module: str):
    """The ``main`` behind ``python -m module`` (an entry module names its tool's)."""
    mod = importlib.import_module(module)
    if hasattr(mod, "main"):
        return mod.main
    src = Path(mod.__file__).read_text()
    m = re.search(r"from\s+(\S+)\s+import\s+main\b", src)
    if m is None:
        raise DocError(f"python -m {module}: no main() to check the arguments with")
    return importlib.import_module(m.group(1)).main


def _import_safe(path: Path) -> bool:
    """Whether importing the script only defines things (imports, defs, constants, a
    ``__main__`` guard): then its ``main`` can be looked at without running the script."""
    import ast

    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                             ast.Assign, ast.AnnAssign)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # a docstring
            continue
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
            continue
        return False
    return True


# Imported by example scripts, slow to import (seconds each) and not needed to parse arguments:
# while a script's arguments are checked they are empty stand-ins.
STUBBED = ("lightning", "pytorch_lightning", "accelerate", "transformers", "flatcomm.integrations")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == s or fullname.startswith(s + ".") for s in STUBBED):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # a package: its submodules are stand-ins too
        mod.__getattr__ = lambda name: type(name, (), {"__init__": lambda self, *a, **k: None})  # type: ignore
        return mod

    def exec_module(self, module) -> None:
        pass


@contextlib.contextmanager
def _stubbed_frameworks():
    def ours(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in STUBBED)

    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    finder = _StubFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        stubs = [k for k in sys.modules if ours(k)]
        for k in stubs:
            del sys.modules[k]
        sys.modules.update(saved)
        for k in stubs:  # importing a.b sets attribute b on a: point it back at the real module
            parent, _, child = k.rpartition(".")
            if parent in sys.modules and not ours(parent):
                if k in saved:
                    setattr(sys.modules[parent], child, saved[k])
                elif child in vars(sys.modules[parent]):
                    delattr(sys.modules[parent], child)


def _script_main(path: Path):
    if not _import_safe(path):
        return None  # e.g. setup.py: it runs on import; only its existence is checked
    spec = importlib.util.spec_from_file_location(f"_docs_script_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)  # its `if __name__ == "__main__"` does not run
    return getattr(mod, "main", None)


def check_python(args: List[str], what: str) -> Optional[str]:
    """``python [-m module | script] args``."""
    if args[:1] == ["-m"]:
        module, rest = args[1], args[2:]
        if module == "pip":
            return check_pip(rest, what)
        if module == "pytest":
            missing = [a for a in rest if not a.startswith("-") and not (ROOT / a.split("::")[0]).exists()]
            return f"{what}: no such test path {missing}" if missing else None
        if not module.startswith("flatcomm"):
            return f"{what}: python -m {module} is not checked: add a check to tests/test_docs.py"
        try:
            main = _tool_main(module)
        except ImportError as e:
            return f"{what}: python -m {module}: {e}"
        return _call_main(main, module, rest, what)
    if not args or args[0].startswith("-"):
        return f"{what}: python {' '.join(args)} is not checked: add a check to tests/test_docs.py"
    return check_script(args[0], args[1:], what)


def check_script(script: str, args: List[str], what: str) -> Optional[str]:
    path = ROOT / script
    if not path.is_file():
        return f"{what}: no such file {script}"
    if path.suffix != ".py":
        return None
    with _stubbed_frameworks():
        main = _script_main(path)
        if main is None:
            return None
        return _call_main(main, script, args, what)


def check_torchrun(args: List[str], what: str) -> Optional[str]:
    from torch.distributed.run import get_args_parser

    try:
        with _parse_only("torchrun", args):
            get_args_parser().parse_args(args)
    except _Parsed as p:
        ns = p.args[0]
        return check_script(ns.training_script, list(ns.training_script_args), what)
    except SystemExit as e:
        return f"{what}: torchrun's arguments {args} do not parse (exit {e.code})"
    return f"{what}: torchrun's parser did not run"


def check_pip(args: List[str], what: str) -> Optional[str]:
    if args[:1] != ["install"]:
        return f"{what}: pip {' '.join(args[:1])} is not checked"
    bad = []
    for a in args[1:]:
        m = re.match(r"^(\.|flatcomm|[./\w-]*flatcomm[\w./-]*)\[([^\]]*)\]$", a)
        if m:
            bad += [e for e in (x.strip() for x in m.group(2).split(",")) if e not in extras()]
        elif "[" in a:
            return f"{what}: cannot read the extras of {a!r}"
    return f"{what}: pyproject.toml has no extra {bad} (it has {sorted(extras())})" if bad else None


def check_make(args: List[str], what: str) -> Optional[str]:
    targets = [a for a in args if not a.startswith("-") and "=" not in a]
    bad = [t for t in targets if t not in make_targets()]
    return f"{what}: the Makefile has no target {bad}" if bad else None


def check_command(cmd: List[str], what: str) -> Optional[str]:
    prog = os.path.basename(cmd[0])
    if prog == "make":
        return check_make(cmd[1:], what)
    if re.fullmatch(r"python(3(\.\d+)?)?", prog):
        return check_python(cmd[1:], what)
    if prog in ("pip", "pip3"):
        return check_pip(cmd[1:], what)
    if prog == "torchrun":
        return check_torchrun(cmd[1:], what)
    if prog in ("bash", "sh"):
        return None if cmd[1:] and (ROOT / cmd[1]).is_file() else f"{what}: no such script {cmd[1:2]}"
    if cmd[0].startswith(("./", "benchmarks/", ".ci/")):
        return None if (ROOT / cmd[0]).is_file() else f"{what}: no such file {cmd[0]}"
    if prog in UNCHECKED:
        return None
    return f"{what}: unknown command {cmd[0]!r}: check it in tests/test_docs.py or list it in UNCHECKED"


def check_shell(block: Block) -> List[str]:
    errors = []
    for cmd in commands(block.text):
        err = check_command(cmd, f"{block.id}: {' '.join(cmd)[:80]}")
        if err:
            errors.append(err)
    return errors


@pytest.mark.parametrize("block", _ids(["bash", "sh"]), ids=lambda b: b.id)
def test_shell_block(block: Block):
    errors = check_shell(block)
    assert not errors, "\n".join(errors)


# ---- the documents themselves ---------------------------------------------------------------------


def test_every_fence_is_well_formed():
    """A known language on every fence, every fence closed, markers well formed."""
    blocks, errors = _parsed()
    assert not errors, "\n".join(errors)
    assert any(b.lang == "python" for b in blocks) and any(b.lang == "bash" for b in blocks)


def test_quick_start_is_the_two_make_commands():
    """README's first code block: `make demo` and `make test`, nothing else (a fresh machine runs it)."""
    first = parse_blocks((ROOT / "README.md").read_text(), "README.md")[0]
    assert first.lang == "bash"
    assert commands(first.text) == [["make", "demo"], ["make", "test"]]


def test_no_internal_issue_numbers():
    """The documents read on their own: no "issue 12" or "#12" of the project's tracker (another
    project's numbered reference, "DeepSpeed #4851", is fine)."""
    pattern = re.compile(r"\bissues? \d+\b|(?<![\w&])#\d{1,3}\b", re.I)
    docs = [*DOC_FILES, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "csrc" / "README.md"]
    found = [f"{p.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
             for p in dict.fromkeys(docs) if p.exists() for text in [p.read_text()] for m in pattern.finditer(text)]
    assert not found, "\n".join(found)
    assert pattern.search("as issue 24 showed") and pattern.search("see #7") and not pattern.search("DeepSpeed #4851")


def test_skips_are_few():
    skipped = [b.id for b in _ids(["python"]) if b.skip is not None]
    ran = [b for b in _ids(["python"]) if b.skip is None]
    assert len(skipped) <= max(3, len(ran) // 4), f"too many blocks that do not run: {skipped}"


def anchors(markdown: str) -> set:
    """GitHub's anchors of a Markdown text's headings (lower case, punctuation dropped, spaces to -)."""
    out = set()
    text = re.sub(r"^(`{3,}|~{3,}).*?^\1\s*$", "", markdown, flags=re.M | re.S)  # not inside code blocks
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_links_resolve():
    """Every relative link of README.md and docs/*.md points at a file of the repository, and its
    #anchor at a heading there (docs/integrations.md, written in another change, may be absent)."""
    missing = []
    for f in DOC_FILES:
        for m in re.finditer(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", f.read_text()):
            target, anchor = m.group(1), (m.group(2) or "")[1:]
            if re.match(r"^[a-z]+:", target):
                continue
            p = (f.parent / target).resolve() if target else f
            if not p.exists():
                if p != ROOT / "docs" / "integrations.md":
                    missing.append(f"{f.relative_to(ROOT)}: {target}")
            elif anchor and p.suffix == ".md" and anchor not in anchors(p.read_text()):
                missing.append(f"{f.relative_to(ROOT)}: {target}#{anchor} (no such heading)")
    assert not missing, missing


# ---- the checkers fail on broken blocks -----------------------------------------------------------


def test_checker_catches_broken_blocks():
    # Fences: no language, an unknown one, unclosed; markers without a reason or with one rank.
    for bad in ("```\nx\n```\n", "```js\nx\n```\n", "```python\nx = 1\n",
                "```python\n# docs-test: skip\nx\n```\n", "```python\n# ranks: 1\nx\n```\n",
                "```python\n# ranks two\nx\n```\n"):
        with pytest.raises(DocError):
            parse_blocks(bad, "t.md")
    (b,) = parse_blocks("```python\n# ranks: 2\nimport torch\n```\n", "t.md")
    assert b.ranks == 2 and b.skip is None
    (b,) = parse_blocks("```python\n# docs-test: skip needs a GPU to run\nx\n```\n", "t.md")
    assert b.skip == "needs a GPU to run"
    (b,) = parse_blocks("<!-- docs-test: skip a sketch of the caller's loop -->\n```python\nx\n```\n", "t.md")
    assert b.skip == "a sketch of the caller's loop"
    for bad in ("<!-- docs-test: skip -->\n```python\nx\n```\n", "<!-- docs-test: run x -->\n```python\nx\n```\n",
                "<!-- docs-test: excerpt examples/no_such.py -->\n```python\nx\n```\n"):
        with pytest.raises(DocError):
            parse_blocks(bad, "t.md")
    # Excerpts: every line in its file, in order.
    ex = "examples/restart_train.py"
    (b,) = parse_blocks(f"<!-- docs-test: excerpt {ex} -->\n```python\nimport argparse\ndef main() -> None:\n```\n", "t.md")
    assert b.excerpt == ex and excerpt_mismatch(b) is None
    (b,) = parse_blocks(f"<!-- docs-test: excerpt {ex} -->\n```python\ndef main() -> None:\nimport argparse\n```\n", "t.md")
    assert excerpt_mismatch(b) == "import argparse"
    # Python: a block that raises, and one that passes.
    assert "ZeroDivisionError" in run_block(Block("t.md", 1, "python", "x = 1 / 0\n"))
    assert run_block(Block("t.md", 1, "python", "import flatcomm\nassert flatcomm.CODECS\n")) is None
    with pytest.raises(SyntaxError):
        compile("def f(:\n", "t.md", "exec")
    # Several ranks: a block fails if it failed, or did not run, on any rank.
    a, b2, c = (Block("t.md", i, "python", "x\n", 2) for i in (1, 2, 3))
    m = merge([a, b2, c], [{a.id: None, b2.id: "boom", }, {a.id: None, b2.id: None, c.id: None}])
    assert m[a.id] is None and "rank 0:\nboom" in m[b2.id] and "not run on rank 0" in m[c.id]
    # Shell: each broken line is reported, and the right ones are not.
    before = set(sys.modules)
    broken = {
        "make no-such-target": "no target",
        "python -m flatcomm.bench kernels --no-such-flag": "do not parse",
        "python -m flatcomm.bench no-such-command": "do not parse",
        "python -m flatcomm.tune --ranks zero": "do not parse",
        "python -m flatcomm.tools.no_such_tool": "No module",
        'pip install --no-build-isolation ".[no-such-extra]"': "no extra",
        "torchrun --nproc-per-node 2 examples/no_such.py": "no such file",
        "torchrun --standalone --nproc-per-node 2 examples/restart_train.py --no-such-flag": "do not parse",
        "python examples/restart_train.py --codec int8": "do not parse",  # --ckpt is required
        "mkae demo": "unknown command",
        "torchrun --nproc-per-node 2 examples/lightning_ddp.py": "do not parse",  # --out is required
    }
    for line, why in broken.items():
        errs = check_shell(Block("t.md", 1, "bash", line + "\n"))
        assert len(errs) == 1 and why in errs[0], (line, errs)
    good = ("make demo  # comment\nmake test\n"
            "python -m flatcomm.bench kernels --quick --sizes 1M\n"
            "python -m flatcomm.bench convergence --quick --seeds 2\n"
            "for W in 1 2; do torchrun --standalone --nproc-per-node $W examples/reproducible_train.py; done\n"
            "python -m flatcomm.demo --help\n"
            'pip install --no-build-isolation ".[cupy-cuda12]"\n')
    assert check_shell(Block("t.md", 1, "bash", good)) == []
    assert commands("A=1 make x && nice -n 10 make y | cat\n") == [["make", "x"], ["make", "y"], ["cat"]]
    assert check_shell(Block("t.md", 1, "bash", "python setup.py -q build_ext --inplace\n")) == []  # not run
    assert check_shell(Block("t.md", 1, "bash", "torchrun --nproc-per-node 2 examples/lightning_ddp.py --out o\n")) == []
    assert not any(k.startswith(("lightning", "flatcomm.integrations")) for k in sys.modules if k not in before)
    import flatcomm

    assert "integrations" not in vars(flatcomm) or vars(flatcomm)["integrations"] is sys.modules["flatcomm.integrations"]
    # Links and anchors.
    assert {"the-collectives-contract", "1-bit-adam-flatcommoptim", "codecauto"} <= anchors(
        "## The collectives' contract\n## 1-bit Adam: `flatcomm.optim`\n## `codec=\"auto\"`\n```text\n# not a heading\n```\n")
    assert "not-a-heading" not in anchors("```text\n# not a heading\n```\n")
