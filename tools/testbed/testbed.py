#!/usr/bin/env python
"""A cluster of N hosts on this machine: build it, run a command on every host, tear it down.

Hosts are network namespaces joined by tbf-shaped veth links (``tools/testbed/netns.py``). Every
command runs with ``TESTBED_HOST`` (its index), ``TESTBED_HOSTS``, ``TESTBED_ADDR``,
``TESTBED_MASTER_ADDR`` (host 0) and ``GLOO_SOCKET_IFNAME`` set; ``{host}``, ``{hosts}``,
``{addr}`` and ``{master}`` in its words are replaced the same way. Everything is removed on exit,
on failure, on Ctrl-C and on SIGTERM; every run is bounded by ``--timeout``.

    # a command on each of 2 hosts at 1 Gbit/s
    sudo python tools/testbed/testbed.py run --hosts 2 --rate 1gbit -- sh -c 'echo host $TESTBED_HOST'
    # a torchrun node per host, c10d rendezvous on host 0
    sudo python tools/testbed/testbed.py torchrun --hosts 2 --nproc-per-node 2 -- pretrain_gpt.py ...
    # real SLURM (slurmctld + one slurmd per host); the command runs on host 0, then waits for the jobs
    sudo python tools/testbed/testbed.py slurm --hosts 2 -- sh -c 'TINY=1 NNODES=2 sbatch examples/olmoe/olmoe.sbatch'
    sudo python tools/testbed/testbed.py cleanup     # namespaces left by a SIGKILLed run
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from tools.testbed.netns import (LinkSpec, Testbed, TestbedConfig, TestbedUnavailable,
                                 remove_stale)


class Terminated(BaseException):
    """SIGTERM / SIGHUP arrived: unwind so every ``finally`` tears down."""


def _on_signal(signum, _frame):
    raise Terminated(signal.Signals(signum).name)


def _config(a) -> TestbedConfig:
    link = LinkSpec(rate=None if a.rate in ("none", "0") else a.rate, delay_ms=a.delay_ms, loss_pct=a.loss_pct)
    overrides: list[LinkSpec | None] = [None] * a.hosts
    for spec in a.host_rate or []:
        i, _, rate = spec.partition("=")
        if not i.isdigit() or int(i) >= a.hosts or not rate:
            raise SystemExit(f"--host-rate {spec!r}: expected HOST=RATE with HOST < {a.hosts}")
        overrides[int(i)] = LinkSpec(rate=rate, delay_ms=a.delay_ms, loss_pct=a.loss_pct)
    return TestbedConfig(hosts=a.hosts, link=link, host_links=tuple(overrides), topology=a.topology)


def _subst(words: list[str], tb: Testbed, i: int) -> list[str]:
    fmt = dict(host=i, hosts=tb.hosts, addr=tb.addr(i), master=tb.addr(0))
    return [w.format(**fmt) if "{" in w else w for w in words]


def torchrun_command(tb: Testbed, i: int, *, nproc_per_node: int, port: int, script: list[str],
                     python: str = sys.executable) -> list[str]:
    """torchrun for host i: c10d rendezvous on host 0's address (the elastic agent's own store).
    With the testbed's ``autogroup_nice`` set, each worker first takes that priority
    (``autogroup_exec.py``: torchrun gives every worker a session of its own)."""
    if tb.config.autogroup_nice is not None:
        script = [str(Path(__file__).with_name("autogroup_exec.py")), *script]
    return [python, "-m", "torch.distributed.run", "--nnodes", str(tb.hosts), "--node-rank", str(i),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{tb.addr(0)}:{port}", "--rdzv-id", tb.name, "--max-restarts", "0",
            *script]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "torchrun", "slurm"):
        s = sub.add_parser(name)
        s.add_argument("--hosts", type=int, default=2)
        s.add_argument("--rate", default="1gbit", help="every host's link: '1gbit', '2.5gbit', '10gbit', 'none'")
        s.add_argument("--host-rate", action="append", metavar="HOST=RATE", help="one host's own rate")
        s.add_argument("--delay-ms", type=float, default=0.0, help="netem delay per host egress (needs netem)")
        s.add_argument("--loss-pct", type=float, default=0.0, help="netem loss per host egress (needs netem)")
        s.add_argument("--topology", choices=["bridge", "pair"], default="bridge")
        s.add_argument("--timeout", type=float, default=600, help="seconds before everything is killed")
        s.add_argument("--log-dir", type=Path, default=None, help="host<i>.log per host (default: stdout)")
        if name == "torchrun":
            s.add_argument("--nproc-per-node", type=int, default=1)
            s.add_argument("--port", type=int, default=29400)
        s.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("cleanup", help="remove namespaces left by a killed run (ctb*)")
    a = p.parse_args(argv)

    if a.cmd == "cleanup":
        print("removed:", " ".join(remove_stale()) or "nothing")
        return 0
    words = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not words:
        p.error(f"{a.cmd}: give the command after --")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    # Python leaves SIGINT ignored when it starts ignored (a background job of a non-interactive
    # shell: `cmd &`, nohup); the testbed must still tear down on it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Testbed(_config(a)) as tb:
            print(f"testbed {tb.name}: {tb.hosts} hosts {', '.join(tb.addr(i) for i in range(tb.hosts))}, "
                  f"link {a.rate}", flush=True)
            if a.cmd == "slurm":
                return _slurm(tb, words, a)
            if a.cmd == "torchrun":
                cmds = [torchrun_command(tb, i, nproc_per_node=a.nproc_per_node, port=a.port, script=words)
                        for i in range(tb.hosts)]
            else:
                cmds = [_subst(words, tb, i) for i in range(tb.hosts)]
            log_dir = a.log_dir
            if log_dir:
                log_dir.mkdir(parents=True, exist_ok=True)
            codes = _run_all(tb, cmds, a.timeout, log_dir)
            print(f"testbed {tb.name}: exit codes {codes}", flush=True)
            return 0 if all(c == 0 for c in codes) else (124 if 124 in codes else 1)
    except TestbedUnavailable as e:
        print(f"testbed: cannot run here: {e}", file=sys.stderr)
        return 77
    except (KeyboardInterrupt, Terminated) as e:
        print(f"testbed: interrupted ({e or 'SIGINT'}); torn down", file=sys.stderr)
        return 130


def _run_all(tb: Testbed, cmds, timeout, log_dir) -> list[int]:
    if log_dir is not None:
        return tb.run_all(cmds, timeout=timeout, log_dir=log_dir)
    with tempfile.TemporaryDirectory() as tmp:
        codes = tb.run_all(cmds, timeout=timeout, log_dir=Path(tmp))
        for i in range(len(cmds)):
            for line in (Path(tmp) / f"host{i}.log").read_text(errors="replace").splitlines():
                print(f"[host{i}] {line}")
    return codes


def _slurm(tb: Testbed, words: list[str], a) -> int:
    from tools.testbed.slurm import SlurmCluster

    with SlurmCluster(tb) as slurm:
        print(f"slurm: nodes {' '.join(slurm.nodelist())}; SLURM_CONF={slurm.conf}", flush=True)
        deadline = time.monotonic() + a.timeout
        res = slurm.run(["sh", "-c", 'exec "$@"', "sh", *words], timeout=a.timeout, check=False,
                        cwd=os.getcwd())
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        if res.returncode != 0:
            return res.returncode
        return slurm.wait_idle(timeout=max(1.0, deadline - time.monotonic()))


if __name__ == "__main__":
    raise SystemExit(main())
