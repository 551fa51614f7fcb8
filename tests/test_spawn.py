"""flatcomm.tools.spawn, the multi-rank runner of the tests and benchmarks: when the process that
launched the ranks is killed (its cleanup never runs), the ranks end within seconds instead of
computing on for the rest of their run (a killed benchmark once left four ranks training)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

_RANK = textwrap.dedent('''
    import os, time

    def rank_fn(rank, world, pid_dir):
        open(os.path.join(pid_dir, str(rank)), "w").write(str(os.getpid()))
        time.sleep(120)  # a long run
''')
_LAUNCHER = "import sys, spawn_child; from flatcomm.tools import spawn; spawn.run(2, spawn_child.rank_fn, sys.argv[1], timeout_s=200)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code, pids_dir = tmp_path / "code", tmp_path / "pids"
    code.mkdir()
    pids_dir.mkdir()
    (code / "spawn_child.py").write_text(_RANK)  # (the ranks import their function by module name)
    path = os.pathsep.join([str(code), root, os.environ.get("PYTHONPATH", "")])
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(pids_dir)], env=dict(os.environ, PYTHONPATH=path))
    try:
        deadline = time.monotonic() + 90
        while len(os.listdir(pids_dir)) < 2 or any(os.path.getsize(pids_dir / f) == 0 for f in os.listdir(pids_dir)):
            assert time.monotonic() < deadline, "the ranks never started"
            assert launcher.poll() is None, "the launcher died on its own"
            time.sleep(0.2)
        pids = [int((pids_dir / f).read_text()) for f in os.listdir(pids_dir)]
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if _alive(p)]
        assert not left, f"ranks {left} outlived their killed launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
