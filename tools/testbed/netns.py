"""N hosts on one machine: network namespaces joined by shaped veth links.

Topology (``topology='bridge'``, the default)::

    [prefix-h0] tb0 ──veth── h0 ┐
    [prefix-h1] tb0 ──veth── h1 ├─ br0   [prefix-sw]
    ...                         ┘

Every host is a network namespace with one interface ``tb0`` (address ``10.A.B.(i+1)/24``) and
loopback. The bridge lives in a namespace of its own (``prefix-sw``), so nothing is created in the
machine's own namespace: no interface, route or address there changes, and no packet can leave the
namespaces (the switch has no uplink and the hosts no other route). ``topology='pair'`` (2 hosts)
joins the two hosts by one veth pair directly.

Shaping (``tc``), per host, on both directions of its link: egress on the host's ``tb0`` and on the
switch-side end (which is the host's ingress): a ``tbf`` (rate); with a delay or loss, ``netem`` as
root with the ``tbf`` child (needs the kernel's netem; refused clearly without it). One-way delay
between hosts i and j is ``delay_i + delay_j``.

Teardown deletes the namespaces (which deletes their veths and the bridge) after killing every
process still running inside them (``ip netns pids``: only processes in namespaces this testbed
created), and removes ``/etc/netns/<name>/`` (the per-namespace ``hosts`` file that maps host names
to addresses; ``ip netns exec`` bind-mounts it over ``/etc/hosts``).

    with Testbed(TestbedConfig(hosts=2, link=LinkSpec(rate="1gbit"))) as tb:
        tb.run(0, ["ip", "addr"])
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

TOPOLOGIES = ("bridge", "pair")
HOST_IFACE = "tb0"
"""Interface name of the host's link inside every host namespace (GLOO_SOCKET_IFNAME)."""
NETNS_ETC = Path("/etc/netns")
NAME_PREFIX = "ctb"
"""Every namespace this module creates is named ``ctb<hex>-...``; :func:`stale_namespaces` finds leftovers."""

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class TestbedUnavailable(RuntimeError):
    """This machine cannot run the testbed (not root, no ``ip``/``tc``, no namespace support)."""


def parse_rate(text: str | float) -> float:
    """``'1gbit'``, ``'2.5gbit'``, ``'100mbit'`` or a number of bits/s -> bits per second."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = text.strip().lower()
        if s.endswith("bit"):
            s = s[:-3]
        elif s.endswith("bps"):
            raise ValueError(f"rate {text!r}: use bits ('1gbit'), not bytes ('bps')")
        unit = s[-1] if s and s[-1] in _UNITS else ""
        try:
            value = float(s[:-1] if unit else s) * _UNITS[unit]
        except ValueError:
            raise ValueError(f"rate {text!r}: expected e.g. '1gbit', '2.5gbit', '800mbit'") from None
    if not value > 0:
        raise ValueError(f"rate {text!r} must be > 0")
    return value


@dataclass(frozen=True)
class LinkSpec:
    """One host's link to the switch (both directions shaped alike)."""

    rate: str | None = "1gbit"
    """tbf rate (``'1gbit'``, ``'2.5gbit'``, ``'10gbit'``); None: unshaped veth."""

    delay_ms: float = 0.0
    """netem one-way delay added to the host's egress, in milliseconds."""

    loss_pct: float = 0.0
    """netem random loss on the host's egress, percent (TCP retransmits: slower, never wrong)."""

    def __post_init__(self):
        if self.rate is not None:
            parse_rate(self.rate)
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"LinkSpec: delay_ms={self.delay_ms} must be in [0, 10000]")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"LinkSpec: loss_pct={self.loss_pct} must be in [0, 100)")

    @property
    def rate_bit_s(self) -> float | None:
        return None if self.rate is None else parse_rate(self.rate)


@dataclass(frozen=True)
class TestbedConfig:
    """What to build."""

    __test__ = False  # not a pytest class

    hosts: int = 2
    """Number of host namespaces (>= 1)."""

    link: LinkSpec = field(default_factory=LinkSpec)
    """Every host's link, unless ``host_links`` overrides it."""

    host_links: tuple[LinkSpec | None, ...] = ()
    """Per-host override (index i -> host i); None or missing entries use ``link``."""

    topology: str = "bridge"
    """``bridge`` (a switch namespace) or ``pair`` (2 hosts, one veth pair)."""

    subnet: str | None = None
    """``'10.A.B'``: the hosts get ``10.A.B.1 ...``; None: a random ``10.x.y`` (only inside the namespaces)."""

    name: str | None = None
    """Namespace prefix (``ctb<hex>``); None: random, so concurrent testbeds never collide."""

    autogroup_nice: int | None = None
    """Scheduler priority of each host's session (``/proc/self/autogroup``, -20..19), or None to
    leave it. Every host command runs in its own session, and with autogroup scheduling
    (``/proc/sys/kernel/sched_autogroup_enabled``) sessions share the CPU equally whatever their
    processes' ``nice``: a timing run sets this so that work elsewhere at ``nice 19`` yields to it
    as ``nice`` intends. Negative values need root (the testbed needs it anyway)."""

    def __post_init__(self):
        if self.hosts < 1 or self.hosts > 200:
            raise ValueError(f"TestbedConfig: hosts={self.hosts} must be in [1, 200]")
        if self.autogroup_nice is not None and not -20 <= self.autogroup_nice <= 19:
            raise ValueError(f"TestbedConfig: autogroup_nice={self.autogroup_nice} must be in [-20, 19]")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"TestbedConfig: topology={self.topology!r} must be one of {TOPOLOGIES}")
        if self.topology == "pair" and self.hosts != 2:
            raise ValueError(f"TestbedConfig: topology 'pair' joins exactly 2 hosts, got hosts={self.hosts}")
        if len(self.host_links) > self.hosts:
            raise ValueError(f"TestbedConfig: {len(self.host_links)} host_links for {self.hosts} hosts")
        if self.subnet is not None:
            parts = self.subnet.split(".")
            if len(parts) != 3 or parts[0] != "10" or not all(p.isdigit() and int(p) < 256 for p in parts):
                raise ValueError(f"TestbedConfig: subnet={self.subnet!r} must look like '10.A.B'")
        if self.name is not None and (not self.name.startswith(NAME_PREFIX) or len(self.name) > 12
                                      or not self.name.replace("-", "").isalnum()):
            raise ValueError(f"TestbedConfig: name={self.name!r} must start with {NAME_PREFIX!r}, "
                             "be alphanumeric and at most 12 characters")

    def link_of(self, i: int) -> LinkSpec:
        if i < len(self.host_links) and self.host_links[i] is not None:
            return self.host_links[i]
        return self.link


def check_available() -> None:
    """Raise :class:`TestbedUnavailable` naming what is missing."""
    if os.geteuid() != 0:
        raise TestbedUnavailable("the testbed needs root (network namespaces, veth, tc); run as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(f"'{tool}' not found on PATH (Debian: apt-get install iproute2)")
    name = f"{NAME_PREFIX}{secrets.token_hex(3)}-probe"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        raise TestbedUnavailable(f"cannot create a network namespace: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def stale_namespaces(prefix: str = NAME_PREFIX) -> list[str]:
    """Namespaces named like this module's (``ctb...``), e.g. left by a SIGKILLed run."""
    return [n for n in list_namespaces() if n.startswith(prefix)]


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    res = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"testbed: `{' '.join(full)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _shape(ns: str, dev: str, link: LinkSpec) -> None:
    """``dev``'s egress: tbf (rate) at the root, or netem (delay, loss) at the root with a tbf child."""
    rate = link.rate_bit_s
    # Burst: at least a few 64 KiB GSO super-packets, or 2 ms at the rate; queue: 50 ms.
    tbf = [] if rate is None else ["tbf", "rate", f"{int(rate)}bit",
                                   "burst", str(max(256 * 1024, int(rate / 8 * 0.002))), "latency", "50ms"]
    if link.delay_ms == 0 and link.loss_pct == 0:
        if tbf:
            _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf, ns=ns)
        return
    netem = ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "limit", "100000"]
    if link.delay_ms:
        netem += ["delay", f"{link.delay_ms}ms"]
    if link.loss_pct:
        netem += ["loss", f"{link.loss_pct}%"]
    res = _sh(*netem, ns=ns, check=False)
    if res.returncode != 0:
        raise TestbedUnavailable(
            f"delay/loss need the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which `tc` could not "
            f"load here ({res.stderr.strip()}); rate shaping (tbf) works without it")
    if tbf:
        _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf, ns=ns)


class Testbed:
    """Builds the namespaces on ``__enter__`` (or :meth:`up`), removes them on exit, always."""

    def __init__(self, config: TestbedConfig):
        self.config = config
        self.name = config.name or f"{NAME_PREFIX}{secrets.token_hex(3)}"
        if config.subnet:
            self.subnet = config.subnet
        else:
            b = secrets.randbelow(200 * 256)
            self.subnet = f"10.{50 + b // 256}.{b % 256}"
        self.namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # -- names -------------------------------------------------------------------------------
    def host_ns(self, i: int) -> str:
        return f"{self.name}-h{i}"

    def hostname(self, i: int) -> str:
        """Host i's name, resolvable inside every host namespace (``/etc/netns/<ns>/hosts``)."""
        return f"{self.name}h{i}"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def hosts(self) -> int:
        return self.config.hosts

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        check_available()
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _add_ns(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _sh("ip", "link", "set", "lo", "up", ns=ns)

    def _build(self) -> None:
        cfg = self.config
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{self.addr(i)} {self.hostname(i)}\n" for i in range(cfg.hosts))
        for i in range(cfg.hosts):
            ns = self.host_ns(i)
            self._add_ns(ns)
            etc = NETNS_ETC / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
        if cfg.topology == "bridge":
            sw = f"{self.name}-sw"
            self._add_ns(sw)
            _sh("ip", "link", "add", "br0", "type", "bridge", ns=sw)
            _sh("ip", "link", "set", "br0", "up", ns=sw)
            for i in range(cfg.hosts):
                # Created inside the switch namespace; the host end is moved to the host.
                _sh("ip", "link", "add", f"h{i}", "type", "veth", "peer", "name", f"p{i}", ns=sw)
                _sh("ip", "link", "set", f"p{i}", "netns", self.host_ns(i), ns=sw)
                _sh("ip", "link", "set", f"h{i}", "master", "br0", ns=sw)
                _sh("ip", "link", "set", f"h{i}", "up", ns=sw)
                _shape(sw, f"h{i}", cfg.link_of(i))
        else:
            h0 = self.host_ns(0)
            _sh("ip", "link", "add", "p0", "type", "veth", "peer", "name", "p1", ns=h0)
            _sh("ip", "link", "set", "p1", "netns", self.host_ns(1), ns=h0)
        for i in range(cfg.hosts):
            ns = self.host_ns(i)
            _sh("ip", "link", "set", f"p{i}", "name", HOST_IFACE, ns=ns)
            _sh("ip", "addr", "add", f"{self.addr(i)}/24", "dev", HOST_IFACE, ns=ns)
            _sh("ip", "link", "set", HOST_IFACE, "up", ns=ns)
            # The host's upload; with 'pair' the peer's tb0 egress is this host's download.
            _shape(ns, HOST_IFACE, cfg.link_of(i))
        for i in range(1, cfg.hosts):
            self._wait_reachable(0, self.addr(i))

    def _wait_reachable(self, src: int, addr: str, timeout: float = 10.0) -> None:
        """A TCP connection from host ``src`` to a listener on ``addr`` (no ping needed)."""
        dst = next(i for i in range(self.hosts) if self.addr(i) == addr)
        listen = ("import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                  f"s.bind(('{addr}',29399));s.listen(1);s.settimeout({timeout});c,_=s.accept();c.sendall(b'ok')")
        connect = ("import socket,time,sys\nfor _ in range(100):\n try:\n"
                   f"  c=socket.create_connection(('{addr}',29399),timeout=1);sys.exit(0 if c.recv(2)==b'ok' else 1)\n"
                   " except OSError: time.sleep(0.1)\nsys.exit(1)")
        server = subprocess.Popen(["ip", "netns", "exec", self.host_ns(dst), sys.executable, "-c", listen],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            res = _sh(sys.executable, "-c", connect, ns=self.host_ns(src), check=False)
            if res.returncode != 0:
                raise RuntimeError(f"testbed: host {src} cannot reach {addr} over TCP: {res.stderr.strip()}")
        finally:
            try:
                server.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    def down(self) -> None:
        """Kill every process in our namespaces, delete them, remove /etc/netns/<ns>. Idempotent."""
        for p in self._procs:
            if p.poll() is None:
                _kill_group(p)
        for ns in list(self.namespaces):
            _kill_ns_processes(ns)
        for ns in list(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
            self.namespaces.remove(ns)
        try:
            NETNS_ETC.rmdir()  # only when empty (ours were the only ones)
        except OSError:
            pass

    # -- running things ----------------------------------------------------------------------
    def env(self, i: int, base: dict | None = None) -> dict:
        """Environment for a command on host i: the rendezvous address and gloo's interface."""
        env = dict(os.environ if base is None else base)
        if self.config.autogroup_nice is not None:
            env["TESTBED_AUTOGROUP_NICE"] = str(self.config.autogroup_nice)
        env.update(TESTBED_HOST=str(i), TESTBED_HOSTS=str(self.hosts), TESTBED_ADDR=self.addr(i),
                   TESTBED_MASTER_ADDR=self.addr(0), GLOO_SOCKET_IFNAME=HOST_IFACE,
                   TP_SOCKET_IFNAME=HOST_IFACE)
        return env

    def wrap(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` inside host i: its network namespace, and a UTS namespace whose hostname is
        :meth:`hostname` (SLURM checks it; gloo resolves it to the host's own address)."""
        prio = "" if self.config.autogroup_nice is None else (
            f"echo {int(self.config.autogroup_nice)} > /proc/self/autogroup 2>/dev/null; ")
        return ["ip", "netns", "exec", self.host_ns(i), "unshare", "--uts", "sh", "-c",
                prio + 'hostname "$0" && exec "$@"', self.hostname(i), *cmd]

    def popen(self, i: int, cmd: Sequence[str], *, env: dict | None = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` inside host i (:meth:`wrap`), in its own process group."""
        p = subprocess.Popen(self.wrap(i, cmd),
                             env=self.env(i, env), start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, cmd: Sequence[str], *, timeout: float = 60, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run(self.wrap(i, cmd), env=self.env(i, env),
                             capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"host {i}: {' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def run_all(self, cmds: Sequence[Sequence[str]], *, timeout: float, env: dict | None = None,
                log_dir: Path | None = None) -> list[int]:
        """Run ``cmds[i]`` on host i concurrently; wait at most ``timeout`` s. Returns exit codes.

        When one host fails, the others are stopped (a distributed job would hang without it); past
        the timeout every host is killed and its code is reported as 124."""
        procs, logs = [], []
        for i, cmd in enumerate(cmds):
            out = open(log_dir / f"host{i}.log", "w") if log_dir else subprocess.DEVNULL
            logs.append(out)
            procs.append(self.popen(i, cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(procs)
        try:
            while any(c is None for c in codes):
                for k, p in enumerate(procs):
                    if codes[k] is None and p.poll() is not None:
                        codes[k] = p.returncode
                if any(c not in (None, 0) for c in codes) or time.monotonic() > deadline:
                    timed_out = time.monotonic() > deadline
                    for k, p in enumerate(procs):
                        if codes[k] is None:
                            _kill_group(p)
                            codes[k] = 124 if timed_out else -signal.SIGTERM
                    break
                time.sleep(0.1)
        finally:
            for k, p in enumerate(procs):
                if p.poll() is None:
                    _kill_group(p)
            for out in logs:
                if out is not subprocess.DEVNULL:
                    out.close()
        return [int(c) for c in codes]


def _kill_group(p: subprocess.Popen, grace: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_ns_processes(ns: str, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, every process inside namespace ``ns`` (one we created)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(x) for x in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                                text=True).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                return
            time.sleep(0.1)


def remove_stale(prefix: str = NAME_PREFIX) -> list[str]:
    """Delete leftover ``ctb*`` namespaces (after a SIGKILL); returns the names removed."""
    removed = []
    for ns in stale_namespaces(prefix):
        _kill_ns_processes(ns)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        removed.append(ns)
    return removed
