"""The command-line tools' surface (in process, no ranks): bad values are argparse usage errors (exit 2,
no traceback), every tool has --version, sizes read and print as 64K / 1M / 25M, plot labels do not
repeat, and a noisy timing is flagged."""
from __future__ import annotations

import argparse
import importlib
import time

import pytest

import flatcomm
from flatcomm.tools import _cli, demo, netlink, tune
from flatcomm.tools import bench
from flatcomm.tools.bench import kernels

PARSERS = {"bench": bench.build_parser, "tune": tune.build_parser, "demo": demo.build_parser,
           "netlink": netlink.build_parser}


def test_sizes_read_and_print_as_written():
    for text, n in (("64K", 65536), ("1M", 1 << 20), ("25M", 25 << 20), ("1.5K", 1536), ("1000", 1000), ("2g", 2 << 30)):
        assert _cli.parse_size(text) == n
        assert _cli.parse_size(_cli.format_size(n)) == n
    assert [_cli.format_size(n) for n in (65536, 1 << 20, 25 << 20, 1000, 3)] == ["64K", "1M", "25M", "1000", "3"]
    assert _cli.format_size(25_000_000) == "23.8M"  # not exact in binary units: 3 digits
    assert _cli.sizes("64K, 1M,25M") == [65536, 1 << 20, 25 << 20]
    for bad in ("abc", "0", "-1K", "1.3", "K", "1e400", "nan"):
        with pytest.raises(ValueError):
            _cli.parse_size(bad)


BAD = [
    ("bench", ["kernels", "--sizes", "abc"], "abc"),
    ("bench", ["kernels", "--codecs", "int9"], "int9"),
    ("bench", ["kernels", "--reps", "0"], "--reps"),
    ("bench", ["collectives", "--codecs", "int8,int9"], "int9"),
    ("bench", ["collectives", "--sizes", "1M,x"], "'x'"),
    ("bench", ["collectives", "--link", "1gbps"], "gbit"),
    ("bench", ["ddp", "--hooks", "int8,nope"], "nope"),
    ("bench", ["ddp", "--ranks", "0"], "--ranks"),
    ("bench", ["fsdp", "--codecs", "int9"], "int9"),
    ("tune", ["--sizes", "abc"], "abc"),
    ("tune", ["--budget", "int9"], "int9"),
    ("tune", ["--link", "fast"], "fast"),
    ("demo", ["--steps", "x"], "'x'"),
    ("netlink", ["check", "--link", "1gbps"], "gbit"),
    ("netlink", ["check", "--reps", "-1"], "-1"),
]


@pytest.mark.parametrize("tool,argv,names", BAD, ids=[" ".join([t] + a) for t, a, _ in BAD])
def test_bad_values_are_usage_errors(tool, argv, names, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[tool]().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage:" in err and names in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("tool", sorted(PARSERS))
def test_version(tool, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[tool]().parse_args(["--version"])
    assert e.value.code == 0 and f"flatcomm {flatcomm.__version__}" in capsys.readouterr().out


def test_good_values_parse():
    a = bench.build_parser().parse_args(["kernels", "--sizes", "64K,1M", "--codecs", "int8,sign"])
    assert a.sizes == [65536, 1 << 20] and a.codecs == ["int8", "sign"]
    a = bench.build_parser().parse_args(["ddp", "--hooks", "int8,torch-allreduce", "--link", "1gbit,0.2ms"])
    assert a.hooks == ["int8", "torch-allreduce"] and a.link == "1gbit,0.2ms"
    assert tune.build_parser().parse_args([]).sizes == [64 << 10, 1 << 20, 25 << 20]


def test_plot_labels_do_not_repeat():
    rows = [{"op": "copy_", "name": "copy_", "numel": 65536}, {"op": "encode+EF", "name": "int8", "numel": 25 << 20}]
    assert bench.plot_labels(rows, "kernels") == ["copy_ 64K", "encode+EF int8 25M"]
    rows = [{"name": "int8", "collective": "all_reduce", "numel": 16384}]
    assert bench.plot_labels(rows, "collectives") == ["int8 all_reduce 16K"]


def test_measure_reports_the_spread_and_flags_noise():
    calls = []

    def uneven():  # every other call 4x slower: a disturbed measurement
        calls.append(1)
        time.sleep(0.004 if len(calls) % 2 else 0.001)

    t = kernels.measure(uneven, reps=4, min_time=0.0)
    assert t["samples"] >= 4 and t["calls_per_sample"] == 1
    assert t["min_s"] <= t["median_s"] <= t["max_s"] and t["max_s"] / t["min_s"] > kernels.NOISY_SPREAD
    steady = [{"spread": 1.1}, {"spread": 1.2}]
    assert bench.noisy_warning(steady) is None
    assert "1 of 3" in bench.noisy_warning(steady + [{"spread": t["max_s"] / t["min_s"]}])


def test_measure_batches_fast_calls():
    """A call far below a millisecond is timed in batches: per-call time, not timer resolution."""
    t = kernels.measure(lambda: None, reps=3, min_time=0.0)
    assert t["calls_per_sample"] > 1 and 0 < t["min_s"] < 1e-3


# slow: a pytest run in a fresh interpreter (~13 s); the kernels it times are checked by
# tests/test_encode_decode.py and tests/test_decode_sum.py in the fast loop, the suite in make test.
@pytest.mark.slow
def test_microbench_suite_runs():
    """benchmarks/test_microbench.py (pytest-benchmark; `make microbench`) collects and runs, once per case."""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("pytest_benchmark")
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "--benchmark-disable",
                        "-k", "64K and (int8 or exact)", str(root / "benchmarks" / "test_microbench.py")],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and " passed" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]


def test_kernel_table_columns_line_up():
    row = dict(op="encode+EF", name="int8", numel=65536, step_s=1e-4, min_s=9e-5, spread=1.1, gbps=20.0, x_copy=0.9,
               vs_torch=50.0, wire_bytes=66560)
    rows = [row, dict(row, op="ordered_sum W=4", name="ordered_sum W=4", vs_torch=None, wire_bytes=0)]
    lines = bench.table_kernels(rows).splitlines()
    assert lines[2].index(" 64K ") == lines[3].index(" 64K ") and len(lines[2]) == len(lines[3]) == len(lines[0])


def _options_without_help(ap: argparse.ArgumentParser) -> list:
    return [a.option_strings[0] for a in ap._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]


def test_bench_help_lists_every_subcommand_and_every_option_has_help(capsys):
    """`python -m flatcomm.bench --help` names every subcommand, also those with a CLI of their own
    (backend, diloco, convergence); every option of every subcommand says what it does."""
    ap = bench.build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(bench.COMMANDS) >= {"kernels", "collectives", "ddp", "scale", "fsdp",
                                                       "backend", "diloco", "convergence"}
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(c in out for c in bench.COMMANDS), out
    assert not {name: _options_without_help(p) for name, p in sub.choices.items() if _options_without_help(p)}
    for name in sub.choices:  # each subcommand's help renders (a stray % in a help text would raise)
        with pytest.raises(SystemExit) as e:
            ap.parse_args([name, "--help"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("name", ["backend", "convergence", "diloco"])
def test_bench_own_cli_commands_share_the_listed_options(name, capsys):
    """The commands main() hands to their module parse with the options --help lists, all with help."""
    own = importlib.import_module(f"flatcomm.tools.bench.{name}").build_parser()
    sub = next(a for a in bench.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert not _options_without_help(own)
    listed = {s for a in sub.choices[name]._actions for s in a.option_strings}
    assert {s for a in own._actions for s in a.option_strings} == listed
    with pytest.raises(SystemExit) as e:
        bench.main([name, "--help"])
    assert e.value.code == 0 and f"python -m flatcomm.bench {name}" in capsys.readouterr().out
