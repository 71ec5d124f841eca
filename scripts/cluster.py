#!/usr/bin/env python3
"""A two-node cluster on one machine: two network namespaces joined by a veth pair whose
link is shaped with tc, one torchrun agent in each.

    python scripts/cluster.py [--bandwidth 1gbit] [--latency 0.5ms] [--nproc-per-node 2] \\
        -- -m paratrain train --model small --dp 4 --compress powersgd:4

Everything after ``--`` is what torchrun runs on each node (a script or ``-m module``).
Node 0 is 10.77.0.1, node 1 is 10.77.0.2 (namespace-private addresses: parallel
invocations use their own namespaces and do not collide). The rendezvous (c10d) runs at
node 0's address over the shaped link. Ranks of one node talk over that namespace's
loopback; ranks of different nodes over the veth pair, whose egress on each side is a
token bucket (``--bandwidth``) followed by a delay (``--latency``, one way). gloo is told
to use the veth interface (``GLOO_SOCKET_IFNAME``); a peer on the same node has a local
address, so the kernel still carries that traffic on loopback.

On exit, failure or a signal, both agents' process groups are killed and both namespaces
deleted (which deletes the veth pair and its qdiscs). At the end the tool prints the
bytes that crossed the link in each direction. Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

SUBNET = "10.77.0"


@dataclass(frozen=True)
class Node:
    index: int
    ns: str
    """Network namespace name (unique per invocation)."""
    dev: str
    """This node's end of the veth pair (at most 15 characters)."""

    @property
    def addr(self) -> str:
        return f"{SUBNET}.{self.index + 1}"


def sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, check=check, capture_output=True, text=True)


def nodes_for(tag: str) -> list[Node]:
    return [Node(i, f"ptc{tag}n{i}", f"ptc{tag}v{i}") for i in range(2)]


def create(nodes: list[Node], bandwidth: str, latency: str, burst: str) -> bool:
    """Namespaces, the veth pair between them, addresses, and the shaping on both ends.
    Returns whether the delay could be applied (kernels built without netem cannot)."""
    a, b = nodes
    for n in nodes:
        sh("ip", "netns", "add", n.ns)
    sh("ip", "link", "add", a.dev, "netns", a.ns, "type", "veth", "peer", "name", b.dev, "netns", b.ns)
    for n in nodes:
        sh("ip", "link", "set", "lo", "up", ns=n.ns)
        sh("ip", "addr", "add", f"{n.addr}/24", "dev", n.dev, ns=n.ns)
        sh("ip", "link", "set", n.dev, "up", ns=n.ns)
        # Token bucket for the rate, netem under it for the delay (each direction's egress).
        sh("tc", "qdisc", "add", "dev", n.dev, "root", "handle", "1:", "tbf", "rate", bandwidth,
           "burst", burst, "latency", "100ms", ns=n.ns)
    return all(latency in ("0", "0ms") or sh(
        "tc", "qdisc", "add", "dev", n.dev, "parent", "1:1", "handle", "10:", "netem",
        "delay", latency, "limit", "100000", ns=n.ns, check=False).returncode == 0 for n in nodes)


def ns_pids(ns: str) -> list[int]:
    """Processes living in namespace ``ns`` (all started by this tool: the name is ours)."""
    return [int(x) for x in sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def destroy(nodes: list[Node]) -> None:
    """Kill every process left in the namespaces (torchrun puts its workers in sessions of
    their own, so killing an agent's group may miss them), then delete the namespaces:
    that deletes the veth pair and its qdiscs too."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for n in nodes for pid in ns_pids(n.ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for _ in range(50):
            if not any(ns_pids(n.ns) for n in nodes):
                break
            time.sleep(0.1)
    for n in nodes:
        sh("ip", "netns", "del", n.ns, check=False)


def tx_bytes(node: Node, dev: str) -> int:
    """Bytes device ``dev`` of a node has sent so far (its veth end, or ``lo``)."""
    out = sh("cat", f"/sys/class/net/{dev}/statistics/tx_bytes", ns=node.ns, check=False).stdout
    return int(out) if out.strip().isdigit() else 0


_SINK = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
         "s.bind((sys.argv[1],29499));s.listen(1);print('ready',flush=True);c,_=s.accept();n=0\n"
         "while (b:=c.recv(1<<20)):n+=len(b)\nprint(n)")
_SOURCE = ("import socket,sys,time;c=socket.create_connection((sys.argv[1],29499));m=int(sys.argv[2]);"
           "t=time.perf_counter();c.sendall(bytes(m));c.shutdown(socket.SHUT_WR);c.recv(1);"
           "print(time.perf_counter()-t)")


def measure_link(nodes: list[Node], nbytes: int = 32 << 20) -> float:
    """Bytes/s one TCP stream achieves from node 0 to node 1 (checks the shaping)."""
    sink = subprocess.Popen(["ip", "netns", "exec", nodes[1].ns, sys.executable, "-c", _SINK, nodes[1].addr],
                            stdout=subprocess.PIPE, text=True)
    try:
        sink.stdout.readline()
        took = sh(sys.executable, "-c", _SOURCE, nodes[1].addr, str(nbytes), ns=nodes[0].ns).stdout
        return nbytes / float(took)
    finally:
        sink.kill()
        sink.wait()


def agent_command(node: Node, master: Node, nproc: int, port: int, run_id: str, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", node.ns, sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{master.addr}:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={str(node.index == 0).lower()}",
            "--local-addr", node.addr, "--max-restarts", "0", *cmd]


def _pump(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def run_agents(nodes: list[Node], nproc: int, cmd: list[str], timeout_s: float | None,
               cut_after_s: float = 0) -> int:
    """Start one torchrun agent per node; wait for both; kill both if either fails. With
    ``cut_after_s``, take the link down that long after the start (a partition)."""
    run_id = nodes[0].ns
    procs = []
    cut = threading.Timer(cut_after_s, _cut, args=(nodes,)) if cut_after_s > 0 else None
    try:
        if cut is not None:
            cut.start()
        for n in nodes:
            env = {**os.environ, "GLOO_SOCKET_IFNAME": n.dev, "PYTHONUNBUFFERED": "1"}
            procs.append(subprocess.Popen(agent_command(n, nodes[0], nproc, 29400, run_id, cmd),
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, start_new_session=True))
        pumps = [threading.Thread(target=_pump, args=(p, f"[node{i}]"), daemon=True)
                 for i, p in enumerate(procs)]
        for t in pumps:
            t.start()
        deadline = time.monotonic() + (timeout_s or float("inf"))
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break  # one node failed (or time is up): the other cannot finish alone
            time.sleep(0.2)
        if time.monotonic() > deadline:
            print(f"cluster: timed out after {timeout_s:.0f} s", file=sys.stderr)
            return 124
        codes = [p.poll() for p in procs]
        for t in pumps:
            t.join(timeout=5)
        return 0 if all(c == 0 for c in codes) else max((c for c in codes if c), default=1)
    finally:
        if cut is not None:
            cut.cancel()
        for p in procs:
            _kill_group(p)


def _cut(nodes: list[Node]) -> None:
    sh("ip", "link", "set", nodes[1].dev, "down", ns=nodes[1].ns, check=False)
    print(f"cluster: link cut ({nodes[1].ns}'s {nodes[1].dev} down)", flush=True)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="cluster.py [options] -- TORCHRUN_SCRIPT_AND_ARGS")
    p.add_argument("--bandwidth", default="1gbit", help="link rate per direction, tc units (default 1gbit)")
    p.add_argument("--latency", default="0.5ms", help="one-way delay, tc units (default 0.5ms)")
    p.add_argument("--burst", default="", help="token bucket size (default: rate x 8 ms, at least 64kb)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="processes per node (default 2)")
    p.add_argument("--timeout", type=float, default=0, help="seconds before the job is killed (0: none)")
    p.add_argument("--measure-link", action="store_true",
                   help="first time one TCP stream across the link and print its rate")
    p.add_argument("--tag", default="", help="namespace name tag (default: this process id)")
    p.add_argument("--cut-after", type=float, default=0, metavar="S",
                   help="take the link down S seconds after the agents start: a network "
                        "partition (0: never)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="after --: what torchrun runs on each node")
    args = p.parse_args(argv)
    args.cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not args.cmd:
        p.error("give the command torchrun runs after --, e.g. -- -m paratrain train --dp 4")
    return args


def default_burst(bandwidth: str) -> str:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
    for unit, factor in units.items():
        if bandwidth.endswith(unit):
            bits = float(bandwidth[:-len(unit)]) * factor
            # 8 ms of tokens: smaller buckets cap a TCP stream well below the rate (measured:
            # 1 ms gave 380 Mbit/s at 1gbit, 8 ms 825, as fast as this machine's loopback).
            return f"{max(64_000, int(bits / 8 * 0.008))}b"
    return "128kb"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("cluster: needs root (ip netns, tc); run it as root", file=sys.stderr)
        return 2
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        print(f"cluster: {', '.join(missing)} not found; install iproute2", file=sys.stderr)
        return 2
    nodes = nodes_for(args.tag or str(os.getpid()))
    # A signal becomes an exception, so the finally block below always tears down.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        delayed = create(nodes, args.bandwidth, args.latency, args.burst or default_burst(args.bandwidth))
        delay = (f"{args.latency} one-way delay" if delayed else
                 f"NO added delay (this kernel has no netem qdisc, CONFIG_NET_SCH_NETEM; "
                 f"--latency {args.latency} not applied)")
        print(f"cluster: {nodes[0].ns} ({nodes[0].addr}) <-> {nodes[1].ns} ({nodes[1].addr}): "
              f"{args.bandwidth} each way, {delay}; {args.nproc_per_node} processes per node",
              flush=True)
        if args.measure_link:
            print(f"cluster: one TCP stream node0->node1: {measure_link(nodes) * 8 / 1e6:,.0f} Mbit/s", flush=True)
        before = {(n.index, dev): tx_bytes(n, dev) for n in nodes for dev in (n.dev, "lo")}
        code = run_agents(nodes, args.nproc_per_node, args.cmd, args.timeout or None, args.cut_after)
        sent = {k: tx_bytes(nodes[k[0]], k[1]) - v for k, v in before.items()}
        print(f"cluster: bytes sent over the link node0->node1 {sent[0, nodes[0].dev]:,}, node1->node0 "
              f"{sent[1, nodes[1].dev]:,}; inside the nodes (loopback) {sent[0, 'lo']:,} and "
              f"{sent[1, 'lo']:,}; exit code {code}", flush=True)
        return code
    except subprocess.CalledProcessError as exc:
        print(f"cluster: {' '.join(exc.cmd)} failed: {exc.stderr.strip()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cluster: interrupted; tearing down", file=sys.stderr)
        return 130
    finally:
        destroy(nodes)


if __name__ == "__main__":
    sys.exit(main())
