"""Bytes this process moved over TCP, counted by the kernel: a counter the code under test
does not write.

    from labkit.observe import netcount
    with netcount.socket_bytes() as c:        # inside a rank (labkit.launch.run)
        dist.all_gather_into_tensor(out, x)
    c.sent, c.received                        # bytes, this rank, this block (None: cannot count)
    c.reason                                  # why not, when it cannot (NCCL, no /proc, ...)

How: Gloo moves every byte over TCP sockets between the ranks' processes. The kernel keeps, per
socket, how many bytes of payload the peer has acknowledged (`tcpi_bytes_acked`) and how many it
has received (`tcpi_bytes_received`), readable with getsockopt(TCP_INFO). On entry and exit the
counter lists this process's TCP sockets (/proc/self/fd -> socket:[inode], matched against
/proc/self/net/tcp{,6}), keeps those between two loopback addresses, reads each one's TCP_INFO
and reports the difference. These are payload bytes (what Gloo wrote: its data plus its small
per-message headers), not TCP/IP headers; they belong to this process only, so other programs
on the machine do not pollute them (unlike the interface counters of `lo`).

What is left out: a TorchElastic/TCPStore rendezvous socket (its port, MASTER_PORT, is skipped;
labkit.launch's own rendezvous is a file and has no socket), and sockets that were both opened
and closed inside the block. A socket connected inside the block adds 1 byte (the kernel counts
its SYN as acknowledged); Gloo connects when the process group starts, before any block. On exit the
counter waits (up to `settle_s`) until the data this process wrote has been acknowledged, so a send
still in flight is not missed.

NCCL moves data over NVLink, PCIe, shared memory or InfiniBand, which no TCP counter sees:
there `sent` and `received` are None and `reason` says so. `lo_bytes()` reads /proc/net/dev
(the whole machine's loopback, TCP/IP headers included) as a cross-check only.
"""
from __future__ import annotations

import os
import socket
import struct
import time

# struct tcp_info (include/uapi/linux/tcp.h): offsets in bytes, stable since Linux 4.2 / 4.6
_UNACKED = 24             # __u32 tcpi_unacked (segments sent, not yet acknowledged)
_BYTES_ACKED = 120        # __u64 tcpi_bytes_acked
_BYTES_RECEIVED = 128     # __u64 tcpi_bytes_received
_NOTSENT = 144            # __u32 tcpi_notsent_bytes (written by the process, not yet sent)
_INFO_LEN = 160

_LOOPBACK4 = "0100007F"   # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex)
_LOOPBACK6 = ("00000000000000000000000001000000",   # ::1
              "0000000000000000FFFF00000100007F")   # ::ffff:127.0.0.1


def tcp_info(sock: socket.socket) -> dict:
    """The kernel's counters of one TCP socket: bytes_acked, bytes_received, unacked, notsent."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
    if len(raw) < _INFO_LEN:
        raise OSError(f"TCP_INFO returned {len(raw)} bytes; this kernel is too old (< 4.6)")
    return {"bytes_acked": struct.unpack_from("=Q", raw, _BYTES_ACKED)[0],
            "bytes_received": struct.unpack_from("=Q", raw, _BYTES_RECEIVED)[0],
            "unacked": struct.unpack_from("=I", raw, _UNACKED)[0],
            "notsent": struct.unpack_from("=I", raw, _NOTSENT)[0]}


def _is_loopback(addr: str) -> bool:
    host = addr.split(":")[0]
    return host.endswith("7F") and len(host) == 8 or host in _LOOPBACK6 or host == _LOOPBACK4


def _tcp_table() -> dict:
    """inode -> (local port, remote port, both ends loopback) for this network namespace."""
    out = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] == "0A":          # 0A: LISTEN, carries no data
                continue
            local, remote = cols[1], cols[2]
            out[int(cols[9])] = (int(local.split(":")[1], 16), int(remote.split(":")[1], 16),
                                 _is_loopback(local) and _is_loopback(remote))
    return out


def _own_sockets() -> dict:
    """fd -> inode of every socket this process holds."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(fd)] = int(target[8:-1])
    return out


def _store_ports() -> set:
    """Ports of a TCPStore rendezvous (torchrun's MASTER_PORT): not the collectives' traffic."""
    port = os.environ.get("MASTER_PORT", "")
    return {int(port)} if port.isdigit() else set()


def snapshot(exclude_ports=()) -> dict:
    """inode -> tcp_info of this process's loopback TCP sockets, store sockets left out."""
    table, skip, out = _tcp_table(), set(exclude_ports) | _store_ports(), {}
    for fd, inode in _own_sockets().items():
        row = table.get(inode)
        if row is None or not row[2] or row[0] in skip or row[1] in skip or inode in out:
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:   # a duplicate: closing it closes nothing
                out[inode] = tcp_info(s)
        except OSError:
            continue                                        # closed meanwhile
    return out


def why_not(group=None) -> str | None:
    """None when the kernel can count this group's traffic, else the reason it cannot."""
    if not os.path.isdir("/proc/self/fd") or not os.path.exists("/proc/self/net/tcp"):
        return "no /proc: the kernel's per-socket counters are read on Linux only"
    if not hasattr(socket, "TCP_INFO"):
        return "this platform has no TCP_INFO socket option"
    import torch.distributed as dist  # on use: the counters themselves need no torch

    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            return ("NCCL moves data over NVLink/PCIe/shared memory/InfiniBand, not TCP sockets: "
                    "the kernel's socket counters cannot see it (use NCCL's own logs or "
                    "nvidia-smi nvlink counters)")
        if "gloo" not in backend:
            return f"backend {backend!r}: only Gloo's TCP transport is counted"
    return None


class SocketBytes:
    """Context manager: payload bytes this process sent/received over loopback TCP inside it."""

    def __init__(self, group=None, exclude_ports=(), settle_s: float = 0.5):
        self.group, self.exclude_ports, self.settle_s = group, tuple(exclude_ports), settle_s
        self.sent = self.received = None
        self.sockets = 0
        self.reason = why_not(group)
        self._start: dict = {}

    def _settled(self) -> dict:
        """A snapshot taken once what this process wrote has been acknowledged (or settle_s
        passed): bytes written before the block but acknowledged inside it are not the block's,
        and bytes written inside it but acknowledged after it are."""
        snap = snapshot(self.exclude_ports)
        deadline = time.monotonic() + self.settle_s
        while any(i["unacked"] or i["notsent"] for i in snap.values()) \
                and time.monotonic() < deadline:
            time.sleep(0.002)
            snap = snapshot(self.exclude_ports)
        return snap

    def __enter__(self):
        if self.reason is None:
            self._start = self._settled()
        return self

    def __exit__(self, *exc):
        if self.reason is not None:
            return False
        end = self._settled()
        zero = {"bytes_acked": 0, "bytes_received": 0}
        self.sent = sum(i["bytes_acked"] - self._start.get(k, zero)["bytes_acked"]
                        for k, i in end.items())
        self.received = sum(i["bytes_received"] - self._start.get(k, zero)["bytes_received"]
                            for k, i in end.items())
        self.sockets = len(end)
        return False

    def __repr__(self):
        if self.reason:
            return f"SocketBytes(cannot count: {self.reason})"
        return f"SocketBytes(sent={self.sent}, received={self.received}, sockets={self.sockets})"


def socket_bytes(group=None, exclude_ports=(), settle_s: float = 0.5) -> SocketBytes:
    """`with socket_bytes() as c: ...` then c.sent / c.received (None and c.reason: cannot)."""
    return SocketBytes(group, exclude_ports, settle_s)


class LoBytes:
    """Context manager: bytes through the loopback interface (/proc/net/dev, `lo`) inside it.

    Machine-wide: every process's loopback traffic, TCP/IP headers included (about 52-66 bytes
    per segment). A cross-check of socket_bytes on a quiet machine, never a per-rank count."""

    def __init__(self):
        self.bytes = None

    @staticmethod
    def read() -> int | None:
        try:
            with open("/proc/net/dev") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    if name.strip() == "lo":
                        return int(rest.split()[0])    # received = sent on loopback
        except OSError:
            return None
        return None

    def __enter__(self):
        self._start = self.read()
        return self

    def __exit__(self, *exc):
        end = self.read()
        self.bytes = None if end is None or self._start is None else end - self._start
        return False


def lo_bytes() -> LoBytes:
    return LoBytes()
