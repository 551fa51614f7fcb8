"""A cluster-like link on one machine: N gloo ranks, each in its own network namespace, joined by a
rate-limited (and optionally delayed) virtual network. Needs root and ``ip netns`` / ``tc``.

    from flatcomm.tools.netlink import Link

    with Link(ranks=2, rate="1gbit") as link:            # or Link(2, "1gbit,0.2ms")
        results = link.run(2, fn, arg1, arg2, timeout_s=120)   # like flatcomm.tools.spawn.run

    with Link(2, "1gbit", ranks_per_node=2) as link:     # 2 "nodes" x 2 ranks (ranks 0-1: node 0)
        link.run(4, fn)                                   # rank r in namespace r // 2
        # inside fn: netlink.interface_bytes() -> (tx, rx) of this node's fc0 (kernel counters)

    python -m flatcomm.tools.netlink check --link 1gbit       # 100 MB all_reduce + 6 MB all_to_all
    python -m flatcomm.tools.netlink cleanup                  # remove namespaces left by killed runs

Topology. Rank r runs in namespace ``fcnet-<pid>-<tag>-r`` with address ``10.77.0.(r+1)/24`` on an
interface ``fc0`` (``lo`` is up too). Two ranks are joined by one veth pair; more ranks by one veth
pair each to a Linux bridge in a namespace of its own (``...-br``), like hosts on a switch.

Nodes. With ``ranks_per_node=G`` every namespace is a node holding G ranks (rank r in namespace
``r // G``; ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` are set as torchrun sets them).
The G ranks of a node reach each other through their shared address, which the kernel routes over
the namespace's own loopback: only traffic between nodes crosses ``fc0`` and its shaping, so fc0's
kernel counters (``interface_bytes()``, ``Link.tx_bytes(node)``) count exactly what left a node.

Shaping. Every node's egress on ``fc0`` goes through ``tbf rate RATE`` (and, with a bridge, the
switch port towards each rank too, so a rank also *receives* at most RATE, like a full-duplex NIC).
A delay adds ``netem delay DELAY`` on each rank's egress (one-way delay DELAY, round trip 2 x
DELAY), with tbf as netem's child. Kernels without ``sch_netem`` (this machine's: "Specified qdisc
kind is unknown") cannot add a delay: the Link then refuses, or with ``require_delay=False`` runs
without it and says so (``link.delay_applied``).

Processes. ``run`` starts one ``ip netns exec NS python`` per rank; the function and its arguments
travel pickled through a private temporary directory (so ``fn`` must be importable: a module-level
function), the ranks meet through a ``file://`` rendezvous there (the filesystem is shared across
namespaces) with ``GLOO_SOCKET_IFNAME=fc0`` (``MASTER_ADDR`` = rank 0's address is set as well),
and each rank's return value comes back through ``torch.save``. Every run is bounded (``timeout_s``);
a rank that fails makes the others be killed after a short grace period, and the error carries that
rank's traceback.

Cleanup. Namespaces (and with them the veths and the bridge) are removed on ``__exit__``/``close()``,
at interpreter exit (atexit) and on SIGINT/SIGTERM (the previous handler runs afterwards); the rank
processes are killed first. A SIGKILLed parent cannot clean up: ``python -m flatcomm.tools.netlink
cleanup`` removes ``fcnet-<pid>-*`` namespaces whose pid is gone (``Link`` does this on setup too).
"""
from __future__ import annotations

import argparse
import atexit
import collections
import io
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["Link", "LinkError", "LinkUnavailable", "available", "cleanup_stale", "interface_bytes",
           "parse_delay", "parse_link", "parse_rate", "run"]

PREFIX = "fcnet"
IFNAME = "fc0"
SUBNET = "10.77.0"
# c10d cannot reverse-resolve 10.77.0.x inside a namespace; it says so once per connection.
_NOISE = re.compile(r"hostname of the client socket cannot be retrieved|ProcessGroupGloo\.cpp:\d+\] Warning")


class LinkUnavailable(RuntimeError):
    """This machine cannot build the link (not root, no netns support, no tbf/netem)."""


class LinkError(RuntimeError):
    """A run on the link failed or timed out."""


# ---- parsing ---------------------------------------------------------------------------------------

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(text: str) -> float:
    """``"1gbit"``, ``"100mbit"``, ``"10gbit"``, ``"2.5gbit"`` -> bits per second (tc's units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if unit in ("gbps", "mbps", "kbps", "bps"):
        raise ValueError(f"rate {text!r}: tc reads '{unit}' as BYTES per second; write e.g. '1gbit' "
                         f"for 1 Gbit/s")
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"rate {text!r}: expected a number and one of {', '.join(_RATE_UNITS)} "
                         f"(e.g. 1gbit, 100mbit, 10gbit)")
    bps = float(m.group(1)) * _RATE_UNITS[unit]
    if bps <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return bps


def parse_delay(text: str) -> float:
    """``"0.2ms"``, ``"200us"``, ``"1s"`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise ValueError(f"delay {text!r}: expected a number and one of s, ms, us (e.g. 0.2ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]


def parse_link(text: str) -> Tuple[float, Optional[float]]:
    """``"RATE"`` or ``"RATE,DELAY"`` (e.g. ``"1gbit,0.2ms"``) -> (bits/s, seconds or None)."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > 2 or not parts[0]:
        raise ValueError(f"link {text!r}: expected RATE or RATE,DELAY (e.g. 1gbit or 1gbit,0.2ms)")
    return parse_rate(parts[0]), (parse_delay(parts[1]) if len(parts) == 2 and parts[1] else None)


def link_arg(text: str) -> str:
    """argparse type for ``--link``: the text, checked by :func:`parse_link` (a usage error otherwise)."""
    try:
        parse_link(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _fmt_rate(bps: float) -> str:
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= f:
            return f"{bps / f:g}{unit}"
    return f"{bps:g}bit"


def _fmt_time(s: float) -> str:
    return f"{s * 1e6:g}us"


# ---- running commands ----------------------------------------------------------------------------


def _ip(*args: str, check: bool = True, timeout: float = 15.0) -> subprocess.CompletedProcess:
    return _cmd(["ip", *args], check=check, timeout=timeout)


def _cmd(argv: List[str], check: bool = True, timeout: float = 15.0) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise LinkUnavailable(f"flatcomm.tools.netlink: {argv[0]!r} not found (install iproute2)") from e
    except subprocess.TimeoutExpired as e:
        raise LinkError(f"flatcomm.tools.netlink: `{' '.join(argv)}` timed out after {timeout:g} s") from e
    if check and p.returncode != 0:
        raise LinkError(f"flatcomm.tools.netlink: `{' '.join(argv)}` failed: {p.stderr.strip() or p.returncode}")
    return p


_available: Optional[str] = None  # "" when available, else the reason


def available() -> Tuple[bool, str]:
    """(True, "") when this process can build links; else (False, why). Probes once: root, and a
    dry ``ip netns add`` / ``del`` of a test namespace."""
    global _available
    if _available is None:
        _available = _probe()
    return _available == "", _available


def _probe() -> str:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (euid 0); run as root or skip the link"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found (install iproute2)"
    name = f"{PREFIX}-{os.getpid()}-probe{secrets.token_hex(2)}"
    try:
        p = _ip("netns", "add", name, check=False)
    except (LinkError, LinkUnavailable) as e:
        return str(e)
    if p.returncode != 0:
        return f"`ip netns add` failed: {p.stderr.strip() or p.returncode}"
    _ip("netns", "del", name, check=False)
    return ""


def _require() -> None:
    ok, why = available()
    if not ok:
        raise LinkUnavailable(f"flatcomm.tools.netlink: cannot build a link here: {why}")


def _netns_list() -> List[str]:
    p = _ip("netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(verbose: bool = False) -> List[str]:
    """Remove ``fcnet-<pid>-*`` namespaces whose creating process is gone; returns their names."""
    removed = []
    for ns in _netns_list():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-.*", ns)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
            if verbose:
                print(f"removed stale namespace {ns}")
    return removed


# ---- cleanup on exit and on signals --------------------------------------------------------------

_active: "set[Link]" = set()
_lock = threading.RLock()
_prev_handlers: Dict[int, Any] = {}


def _cleanup_all() -> None:
    with _lock:
        links = list(_active)
    for link in links:
        try:
            link.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


atexit.register(_cleanup_all)


def _on_signal(signum, frame):
    _cleanup_all()
    prev = _prev_handlers.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)  # e.g. the default SIGINT handler raises KeyboardInterrupt
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(link: "Link") -> None:
    with _lock:
        _active.add(link)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                cur = signal.getsignal(sig)
                if cur is not _on_signal:
                    _prev_handlers[sig] = cur
                    signal.signal(sig, _on_signal)


def _unregister(link: "Link") -> None:
    with _lock:
        _active.discard(link)
        if not _active and threading.current_thread() is threading.main_thread():
            for sig, prev in list(_prev_handlers.items()):
                if signal.getsignal(sig) is _on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
                del _prev_handlers[sig]


# ---- the link ------------------------------------------------------------------------------------


class Link:
    """N network namespaces ("nodes") joined by a shaped virtual network (see the module docstring).

    ranks: the number of namespaces (nodes); ranks_per_node: ranks each one holds (default 1).
    rate: ``"1gbit"``-style, or ``"RATE,DELAY"``; delay: ``"0.2ms"``-style (netem, one way).
    burst: tbf bucket in bytes (default: 2 ms at the rate, at least 64 KiB).
    queue_s: tbf's queue limit expressed as latency (default 50 ms: TCP never sees drops).
    require_delay: with a delay on a kernel without netem, refuse (True) or warn and go on.
    """

    def __init__(self, ranks: int = 2, rate: str = "1gbit", delay: Optional[str] = None, *,
                 burst: Optional[int] = None, queue_s: float = 0.05, require_delay: bool = True,
                 ranks_per_node: int = 1):
        if ranks < 2:
            raise ValueError("flatcomm.tools.netlink: a link joins at least 2 ranks (namespaces)")
        if ranks > 250:
            raise ValueError("flatcomm.tools.netlink: at most 250 ranks (one /24)")
        if not isinstance(ranks_per_node, int) or not 1 <= ranks_per_node <= 64:
            raise ValueError(f"flatcomm.tools.netlink: ranks_per_node must be an integer in [1, 64], got "
                             f"{ranks_per_node!r}")
        self.ranks = ranks  # namespaces (nodes); kept under this name for callers of G = 1 links
        self.nodes = ranks
        self.ranks_per_node = ranks_per_node
        self.world = ranks * ranks_per_node
        self.rate_bps, d = parse_link(rate)
        if delay is not None:
            if d is not None:
                raise ValueError("flatcomm.tools.netlink: delay given twice (in rate and delay=)")
            d = parse_delay(delay)
        self.delay_s = d
        self.burst = burst or max(64 << 10, int(self.rate_bps / 8 * 0.002))
        self.queue_s = queue_s
        self.require_delay = require_delay
        self.delay_applied = False
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.namespaces = [f"{self.tag}-{r}" for r in range(ranks)]
        self.bridge_ns = f"{self.tag}-br" if ranks > 2 else None
        self.addresses = [f"{SUBNET}.{r + 1}" for r in range(ranks)]
        self.ifname = IFNAME
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []
        self._closed = False
        self._up = False

    # -- description
    def describe(self) -> str:
        d = f", delay {self.delay_s * 1e3:g} ms one way" if self.delay_s else ""
        if self.delay_s and not self.delay_applied and self._up:
            d += " (NOT applied: no netem)"
        topo = "veth pair" if self.ranks == 2 else "bridge"
        g = f" x {self.ranks_per_node} ranks" if self.ranks_per_node > 1 else ""
        return f"{self.ranks} namespaces{g}, {topo}, tbf {_fmt_rate(self.rate_bps)}{d}"

    def info(self) -> dict:
        return {"ranks": self.ranks, "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "world": self.world, "rate_bps": self.rate_bps, "rate": _fmt_rate(self.rate_bps),
                "delay_s": self.delay_s, "delay_applied": self.delay_applied,
                "topology": "veth" if self.ranks == 2 else "bridge", "burst_bytes": self.burst}

    def __repr__(self) -> str:
        return f"Link({self.describe()}, tag={self.tag})"

    # -- set up / tear down
    def __enter__(self) -> "Link":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def setup(self) -> "Link":
        if self._up:
            return self
        if self._closed:
            raise LinkError("flatcomm.tools.netlink: this Link was closed; make a new one")
        _require()
        cleanup_stale()
        _register(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        for ns in self.namespaces:
            self._add_ns(ns)
        if self.bridge_ns is None:
            a, b = self.namespaces
            _ip("-n", a, "link", "add", IFNAME, "type", "veth", "peer", "name", IFNAME, "netns", b)
        else:
            br = self.bridge_ns
            self._add_ns(br)
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            for r, ns in enumerate(self.namespaces):
                port = f"p{r}"
                _ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("-n", br, "link", "set", port, "master", "br0")
                _ip("-n", br, "link", "set", port, "up")
                self._shape(br, port, delay=False)  # the switch port towards rank r: its ingress
        for r, ns in enumerate(self.namespaces):
            _ip("-n", ns, "addr", "add", f"{self.addresses[r]}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            self._shape(ns, IFNAME, delay=True)

    def _tbf(self) -> List[str]:
        return ["tbf", "rate", f"{int(self.rate_bps)}bit", "burst", str(self.burst),
                "latency", _fmt_time(self.queue_s)]

    def _shape(self, ns: str, dev: str, delay: bool) -> None:
        if delay and self.delay_s:
            p = _cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                      "delay", _fmt_time(self.delay_s), "limit", "100000"], check=False)
            if p.returncode == 0:
                _cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                      *self._tbf()])
                self.delay_applied = True
                return
            why = p.stderr.strip()
            msg = (f"flatcomm.tools.netlink: cannot add a delay: `tc qdisc add ... netem` failed ({why}); "
                   f"this kernel probably lacks sch_netem. Use a link without a delay (e.g. "
                   f"'{_fmt_rate(self.rate_bps)}')")
            if self.require_delay:
                raise LinkUnavailable(msg + " or pass require_delay=False.")
            if not getattr(self, "_warned", False):
                warnings.warn(msg + "; going on WITHOUT the delay.", RuntimeWarning, stacklevel=4)
                self._warned = True
        _cmd(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *self._tbf()])

    def _kill_procs(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = []

    def close(self) -> None:
        """Kill this link's rank processes and delete its namespaces. Idempotent."""
        with _lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._kill_procs()
        finally:
            for ns in reversed(self._created):
                _ip("netns", "del", ns, check=False)
            self._created = []
            self._up = False
            _unregister(self)

    # -- counters
    def tx_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent on its link interface so far (the kernel's counter)."""
        return self._counter(node, "tx_bytes")

    def rx_bytes(self, node: int) -> int:
        return self._counter(node, "rx_bytes")

    def _counter(self, node: int, name: str) -> int:
        if not self._up:
            raise LinkError("flatcomm.tools.netlink: the link is not set up")
        if not 0 <= node < self.nodes:
            raise ValueError(f"flatcomm.tools.netlink: node {node} out of range [0, {self.nodes})")
        p = _ip("-n", self.namespaces[node], "-s", "-j", "link", "show", "dev", IFNAME)
        import json

        stats = json.loads(p.stdout)[0]["stats64"]
        return int(stats["tx" if name == "tx_bytes" else "rx"]["bytes"])

    # -- running ranks
    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def run(self, world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            threads: int = 1, grace_s: float = 10.0, echo: bool = True,
            env: Optional[Dict[str, str]] = None) -> List[Any]:
        """Run ``fn(rank, world, *args)`` in a gloo process group, rank r in namespace
        ``r // ranks_per_node``; return the
        results in rank order (like :func:`flatcomm.tools.spawn.run`). Bounded by ``timeout_s`` (the
        ranks' Python start-up included); any rank's failure raises :class:`LinkError` with its
        traceback. ``echo``: relay the ranks' output to stderr (other ranks' lines prefixed)."""
        if not self._up:
            raise LinkError("flatcomm.tools.netlink: the link is not set up (use `with Link(...) as link`)")
        if not 1 <= world <= self.world:
            raise ValueError(f"flatcomm.tools.netlink: world {world} must be between 1 and {self.world} "
                             f"({self.nodes} nodes x {self.ranks_per_node} ranks)")
        fn = _importable(fn)
        call = pickle.dumps((fn, args))
        with tempfile.TemporaryDirectory(prefix=f"{self.tag}-run-") as tmp:
            payload = {"sys_path": list(sys.path), "call": call, "world": world,
                       "init_file": os.path.join(tmp, "rendezvous"), "timeout_s": float(timeout_s),
                       "threads": threads, "out_dir": tmp}
            ppath = os.path.join(tmp, "payload.pkl")
            with open(ppath, "wb") as f:
                pickle.dump(payload, f)
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            base_env = dict(os.environ)
            base_env.update(env or {})
            base_env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in base_env.get("PYTHONPATH", "").split(os.pathsep) if p])
            base_env.update({"GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME,
                             "MASTER_ADDR": self.addresses[0], "MASTER_PORT": "29577",
                             "WORLD_SIZE": str(world), "OMP_NUM_THREADS": str(threads),
                             "PYTHONUNBUFFERED": "1"})
            tails = [collections.deque(maxlen=60) for _ in range(world)]
            readers = []
            self._procs = []
            try:
                for r in range(world):
                    g = self.ranks_per_node
                    e = dict(base_env, RANK=str(r), LOCAL_RANK=str(r % g), LOCAL_WORLD_SIZE=str(g),
                             GROUP_RANK=str(r // g), ROLE_RANK=str(r), NODE_RANK=str(r // g))
                    argv = ["ip", "netns", "exec", self.namespaces[self.node_of(r)], sys.executable, "-c",
                            "from flatcomm.tools.netlink import _child_main; _child_main()", ppath, str(r)]
                    p = subprocess.Popen(argv, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True)
                    self._procs.append(p)
                    t = threading.Thread(target=_relay, args=(p.stdout, r, tails[r], echo), daemon=True)
                    t.start()
                    readers.append(t)
                self._wait(world, timeout_s, grace_s, tails)
            finally:
                self._kill_procs()
                for t in readers:
                    t.join(timeout=5)
            return self._collect(world, tmp, tails)

    def _wait(self, world: int, timeout_s: float, grace_s: float, tails) -> None:
        deadline = time.monotonic() + timeout_s
        first_fail = None
        while True:
            codes = [p.poll() for p in self._procs]
            if all(c is not None for c in codes):
                return
            now = time.monotonic()
            if first_fail is None and any(c not in (None, 0) for c in codes):
                first_fail = now  # the others are probably stuck in a collective: short grace
            if first_fail is not None and now - first_fail > grace_s:
                return
            if now > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise LinkError(f"flatcomm.tools.netlink: run timed out after {timeout_s:g} s; ranks "
                                f"{running} still running. Last output:\n" + _tails(tails, running))
            time.sleep(0.05)

    def _collect(self, world: int, tmp: str, tails) -> List[Any]:
        import torch

        results: Dict[int, Any] = {}
        errors = []
        for r in range(world):
            path = os.path.join(tmp, f"result-{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r} exited without a result (killed, crashed, or stopped "
                              f"after another rank failed); last output:\n{_tails(tails, [r])}")
                continue
            ok, value = torch.load(path, weights_only=False)
            if ok:
                results[r] = value
            else:
                errors.append(f"rank {r} failed:\n{value}")
        if errors:
            # Put real tracebacks first: ranks that were merely killed are a consequence.
            errors.sort(key=lambda s: "without a result" in s)
            raise LinkError("flatcomm.tools.netlink: " + "\n".join(errors))
        return [results[r] for r in range(world)]


def interface_bytes(ifname: str = IFNAME) -> Tuple[int, int]:
    """(tx, rx) bytes of ``ifname`` in the calling process's network namespace, from the kernel's
    counters (``ip netns exec`` mounts the namespace's own /sys). Inside a rank of a :class:`Link`
    that is what this rank's node sent to / received from the other nodes, headers included."""
    base = f"/sys/class/net/{ifname}/statistics"
    try:
        with open(f"{base}/tx_bytes") as f:
            tx = int(f.read())
        with open(f"{base}/rx_bytes") as f:
            rx = int(f.read())
    except OSError as e:
        raise LinkError(f"flatcomm.tools.netlink: no counters for interface {ifname!r} here ({e}); "
                        f"interface_bytes() is for code running inside a Link's rank") from e
    return tx, rx


def _importable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function of a module run with ``python -m pkg.mod`` lives in ``__main__``; the ranks can
    only import it under its real name."""
    if getattr(fn, "__module__", None) != "__main__":
        return fn
    import importlib

    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None or not spec.name:
        raise ValueError("flatcomm.tools.netlink: fn must be importable by the rank processes "
                         "(define it in a module, not in a script's __main__)")
    return getattr(importlib.import_module(spec.name), fn.__qualname__)


def _tails(tails, ranks) -> str:
    return "\n".join(f"  [rank {r}] {line}" for r in ranks for line in tails[r]) or "  (none)"


def _relay(stream, rank: int, tail, echo: bool) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        if _NOISE.search(line):
            continue
        tail.append(line)
        if echo:
            try:
                sys.stderr.write((line if rank == 0 else f"[rank {rank}] {line}") + "\n")
                sys.stderr.flush()
            except (ValueError, OSError):
                pass
    stream.close()


def _child_main() -> None:
    """Entry point of one rank inside its namespace (argv: payload path, rank)."""
    ppath, rank = sys.argv[1], int(sys.argv[2])
    with open(ppath, "rb") as f:
        payload = pickle.load(f)
    out = os.path.join(payload["out_dir"], f"result-{rank}.pt")
    for p in reversed(payload["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    code = 0
    try:
        fn, args = pickle.loads(payload["call"])
        torch.set_num_threads(payload["threads"])
        world = payload["world"]
        dist.init_process_group("gloo", init_method=f"file://{payload['init_file']}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=payload["timeout_s"]))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save((True, result), buf)
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        buf = io.BytesIO()
        torch.save((False, traceback.format_exc()), buf)
        code = 1
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip slow interpreter teardown (thread pools, gloo)


def run(world: int, fn: Callable[..., Any], *args: Any, link: str = "1gbit", timeout_s: float = 120.0,
        threads: int = 1, ranks_per_node: int = 1, **link_opts: Any) -> List[Any]:
    """One-shot: build a link of ``world / ranks_per_node`` nodes, run ``fn`` on it, tear it down."""
    if world % ranks_per_node:
        raise ValueError(f"flatcomm.tools.netlink: world {world} is not a multiple of ranks_per_node {ranks_per_node}")
    with Link(world // ranks_per_node, link, ranks_per_node=ranks_per_node, **link_opts) as lk:
        return lk.run(world, fn, *args, timeout_s=timeout_s, threads=threads)


# ---- the link check --------------------------------------------------------------------------------


def measure(rank: int, world: int, allreduce_bytes: int = 100_000_000, a2a_bytes: int = 6_000_000,
            reps: int = 3) -> dict:
    """Median (slowest rank) of a gloo fp32 all_reduce and an all_to_all_single of the given sizes."""
    import statistics

    import torch
    import torch.distributed as dist

    def timed(fn, n):
        out = []
        for i in range(n + 1):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i:
                out.append(float(dt))
        return statistics.median(out), out

    x = torch.ones(allreduce_bytes // 4)
    ar, ar_all = timed(lambda: dist.all_reduce(x), reps)
    ok = bool((x == world ** (reps + 1)).all())
    n = a2a_bytes // 4 // world * world
    src, dst = torch.full((n,), float(rank)), torch.empty(n)
    a2a, a2a_all = timed(lambda: dist.all_to_all_single(dst, src), reps)
    ok = ok and bool((dst.view(world, -1) == torch.arange(world, dtype=torch.float32)[:, None]).all())
    return {"all_reduce_s": ar, "all_reduce_all_s": ar_all, "all_reduce_bytes": 4 * x.numel(),
            "all_to_all_s": a2a, "all_to_all_all_s": a2a_all, "all_to_all_bytes": 4 * n, "correct": ok}


def build_parser() -> argparse.ArgumentParser:
    from flatcomm.tools._cli import add_version, positive

    ap = argparse.ArgumentParser(prog="python -m flatcomm.tools.netlink", description=__doc__.split("\n")[0])
    add_version(ap)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="measure a gloo all_reduce and all_to_all across the link")
    c.add_argument("--link", type=link_arg, default="1gbit", help="RATE[,DELAY] (default 1gbit)")
    c.add_argument("--ranks", type=positive(int), default=2)
    c.add_argument("--allreduce-mb", type=positive(float), default=100)
    c.add_argument("--a2a-mb", type=positive(float), default=6)
    c.add_argument("--reps", type=positive(int), default=3)
    c.add_argument("--timeout", type=positive(float), default=120)
    sub.add_parser("cleanup", help="remove namespaces left behind by killed runs")
    sub.add_parser("available", help="say whether links can be built here")
    return ap


def _main(argv: Optional[List[str]] = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cmd == "available":
        ok, why = available()
        print("yes" if ok else f"no: {why}")
        return 0 if ok else 1
    if a.cmd == "cleanup":
        _require()
        removed = cleanup_stale(verbose=True)
        print(f"{len(removed)} stale namespace(s) removed")
        return 0
    rate, _ = parse_link(a.link)
    if a.ranks < 2:
        ap.error("--ranks must be >= 2 (a link joins at least 2 ranks)")
    with Link(a.ranks, a.link) as link:
        print(f"[netlink] link: {link.describe()}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = link.run(a.ranks, measure, int(a.allreduce_mb * 1e6), int(a.a2a_mb * 1e6), a.reps,
                       timeout_s=a.timeout)[0]
    # Floors: ring all-reduce sends 2(W-1)/W x S per rank; all-to-all (W-1)/W x S.
    w = a.ranks
    ar_floor = 2 * (w - 1) / w * res["all_reduce_bytes"] * 8 / rate
    a2a_floor = (w - 1) / w * res["all_to_all_bytes"] * 8 / rate
    print(f"all_reduce fp32 {res['all_reduce_bytes'] / 1e6:.0f} MB: {res['all_reduce_s'] * 1e3:8.1f} ms "
          f"(floor {ar_floor * 1e3:.0f} ms at {_fmt_rate(rate)}; reps {', '.join(f'{t * 1e3:.0f}' for t in res['all_reduce_all_s'])})")
    print(f"all_to_all_single {res['all_to_all_bytes'] / 1e6:.0f} MB: {res['all_to_all_s'] * 1e3:8.1f} ms "
          f"(floor {a2a_floor * 1e3:.0f} ms; reps {', '.join(f'{t * 1e3:.1f}' for t in res['all_to_all_all_s'])})")
    print(f"results correct: {res['correct']}; {time.perf_counter() - t0:.1f} s")
    return 0 if res["correct"] else 1


if __name__ == "__main__":
    sys.exit(_main())
