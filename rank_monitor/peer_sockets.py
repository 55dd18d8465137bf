"""The TCP connections a failed training cycle left open to the job's other nodes, and closing them.

Why: a DDP reducer keeps its gloo process group (and the group's sockets) alive after
`destroy_process_group` (torch 2.13), and gloo cannot abort a collective. A rank that restarts in
place would then leave its peers blocked in a collective that waits for its data: they learn that
it is gone only when its sockets close. So at the restart point rank_monitor.rank_side.inprocess shuts down
(`shutdown(2)`, both directions; the descriptors stay valid for whoever still owns them) every
established TCP connection that this process opened during the failed cycle to an address of the
job (the nodes' addresses the agent passes in FT_LAUNCHER_JOB_ADDRS, and this host's own).
Connections that were open before the cycle began, and those to other hosts (a metrics or object
store service), are left alone. Linux only (/proc/net/tcp*); elsewhere it does nothing.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import Dict, Set, Tuple

ENV_JOB_ADDRS = "FT_LAUNCHER_JOB_ADDRS"
ESTABLISHED = "01"


def socket_inodes() -> Dict[int, int]:
    """inode -> fd of this process's sockets."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(name)
    return out


def _addr(hex_addr: str) -> str:
    """/proc/net/tcp's address field -> an IP string (IPv4-mapped IPv6 as IPv4)."""
    raw = bytes.fromhex(hex_addr.split(":")[0])
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    ip = ipaddress.IPv6Address(words)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)


def tcp_table(state: str):
    """(local address field, remote address field, inode) of this host's TCP sockets in `state`
    (/proc/net/tcp's hex code: 01 established, 0A listening)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh)
                for line in fh:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == state:
                        yield parts[1], parts[2], int(parts[9])
        except (OSError, StopIteration, ValueError):
            continue


def established() -> Dict[int, Tuple[str, str]]:
    """inode -> (local IP, remote IP) of the established TCP connections on this host."""
    return {inode: (_addr(local), _addr(remote)) for local, remote, inode in tcp_table(ESTABLISHED)}


def job_addresses() -> Set[str]:
    """IP addresses of the job's nodes (FT_LAUNCHER_JOB_ADDRS, resolved) and of this host."""
    names = [n for n in os.environ.get(ENV_JOB_ADDRS, "").split(",") if n]
    names += [os.environ.get("MASTER_ADDR", ""), socket.gethostname(), "localhost"]
    out = {"127.0.0.1", "::1"}
    for name in filter(None, names):
        try:
            out.update(info[4][0] for info in socket.getaddrinfo(name, None))
        except (socket.gaierror, UnicodeError):
            continue
    return out


def shut_down_new_peer_connections(before: Set[int]) -> int:
    """Shut down the established connections to the job's addresses that are not in `before`
    (socket inodes open when the cycle began). Returns how many."""
    mine = socket_inodes()
    new = {inode: fd for inode, fd in mine.items() if inode not in before}
    if not new:
        return 0
    table = established()
    addrs = None
    done = 0
    for inode, fd in new.items():
        ends = table.get(inode)
        if ends is None:
            continue
        if addrs is None:
            addrs = job_addresses()
        if ends[1] not in addrs:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        finally:
            sock.close()
    return done
