"""A lost network link between nodes, named in one line instead of a screen of gloo
tracebacks: which address and ranks went silent, and where the run can go on from.

Each rank records, once at start-up, the address it reaches the rendezvous host from (the
interface gloo's connections use between nodes); the ranks share them. When a collective
then fails with a broken connection (gloo names the peer as ``[ADDRESS]:PORT``), the ranks
behind that address are the lost ones. Under torchrun each node's first local rank says
so; torchrun's ``--max-restarts`` then restarts the job, which resumes from the newest
complete checkpoint by itself (docs/runs.md).
"""

from __future__ import annotations

import re
import socket

import torch.distributed as dist

_BROKEN = re.compile(r"Connection (reset by peer|timed out|refused|closed)|Broken pipe|"
                     r"Read error|Write error|No route to host|Network is unreachable")
_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def local_address(master: str, port: int = 29500) -> str:
    """The address this host reaches ``master`` from (no packet is sent: a UDP socket's
    connect only picks the route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def share_addresses(master: str) -> list[str]:
    """Every rank's ``local_address`` (collective over the world)."""
    addresses: list = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, local_address(master))
    return addresses


def _messages(exc: BaseException) -> str:
    """The exception and its causes, as text."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


def describe_lost_link(exc: BaseException, addresses: list[str], rank: int) -> str | None:
    """One line naming the lost peer and its ranks, or None when ``exc`` is not a broken
    connection between ranks."""
    text = _messages(exc)
    if not _BROKEN.search(text):
        return None
    mine = addresses[rank] if 0 <= rank < len(addresses) else None
    peers = [a for a in _PEER.findall(text) if a != mine]
    if peers:
        address = peers[0]
        ranks = [r for r, a in enumerate(addresses) if a == address]
        where = (f"{address} (ranks {_span(ranks)})" if ranks else
                 f"{address} (not an address any rank started from)")
    else:
        others = sorted({a for a in addresses if a != mine})
        where = f"another node ({', '.join(others)})" if others else "another rank"
    why = re.search(r"Connection [a-z ]+?(?=[.:\n]|$)|No route to host|Network is unreachable", text)
    reason = (why or _BROKEN.search(text)).group(0).lower()
    return f"rank {rank} lost the network link to {where}: {reason}"


def unreachable(silent: list[int], addresses: list[str] | None, rank: int,
                store_lost: bool = False) -> str | None:
    """For a hang: when every peer that did not arrive started from another address than
    this rank, the link between the nodes is the likely cause; when no heartbeat could be
    read at all (``store_lost``), this node lost the store on rank 0's. A line saying so,
    or None."""
    if not addresses or not silent or rank >= len(addresses):
        return None
    mine = addresses[rank]
    if store_lost and addresses[0] != mine:
        return (f"network: no rank's heartbeat could be read, not even this node's: the store on "
                f"{addresses[0]} (rank 0's node) is unreachable from {mine}: this node lost its "
                f"link to the others (a partition), or that node stopped")
    theirs = sorted({addresses[r] for r in silent if r < len(addresses)})
    if mine in theirs or not theirs:
        return None
    return (f"network: ranks {_span(sorted(silent))} at {', '.join(theirs)} are unreachable from "
            f"{mine}: the link between the nodes is down (a partition) or that node stopped")


def _span(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
