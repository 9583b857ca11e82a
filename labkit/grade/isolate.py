"""The sandbox without a network: a network namespace of its own where Linux allows it, else
Python's audit hooks refusing sockets.

    preexec_fn=functools.partial(prepare, memory, True)   # in the judge's fork, before exec
    install_fallback()                                     # in the sandbox, when that failed

`namespace`: before the sandbox's interpreter starts, its process leaves the judge's network for
a new, empty one (unshare(2) with CLONE_NEWUSER | CLONE_NEWNET, which an unprivileged user may do
where the kernel allows user namespaces: `unshare -rn true` says whether it does), maps its own
user and group ids onto themselves in the new user namespace and brings up its loopback
interface, so that the sandbox's ranks still reach each other over 127.0.0.1 (Gloo's sockets).
The sandbox, its forks and its ranks then see one interface, `lo`, of their own: no other
machine, and not the judge's 127.0.0.1 (a service on the grading machine's localhost is out of
reach). Unix-domain sockets named by a path on disk are files, not network: still reachable.

`audit` (the fallback, where unshare is refused): the sandbox's own interpreter and its forks
refuse, by an audit hook (PEP 578, which cannot be removed), to create any socket but a Unix one
or to connect, bind or send to an address. Not stopped there: the sandbox's ranks (fresh
interpreters the launcher starts), ctypes calls of libc's socket(2), and programs it runs.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import resource
import socket
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SIOCSIFFLAGS = 0x8914
IFF_UP, IFF_LOOPBACK, IFF_RUNNING = 0x1, 0x8, 0x40
CPU_LIMIT = 3600            # CPU seconds per sandbox process
ENV = "LABKIT_SANDBOX_NETWORK"   # how the sandbox is cut off: "namespace" or "audit"


def _write(name: str, text: str) -> None:
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)


def unshare_network() -> None:
    """This process in a new user and network namespace, its ids its own, its loopback up;
    OSError where the kernel refuses."""
    uid, gid = os.getuid(), os.getgid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER | CLONE_NEWNET): {os.strerror(err)}")
    _write("setgroups", "deny")
    _write("uid_map", f"{uid} {uid} 1")
    _write("gid_map", f"{gid} {gid} 1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFFLAGS,
                    struct.pack("16sH14s", b"lo", IFF_UP | IFF_LOOPBACK | IFF_RUNNING, b""))


def prepare(memory: int | None, network: bool) -> None:
    """The sandbox's process, between fork and exec: its limits, and its own network if asked."""
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_LIMIT, CPU_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if network:
        unshare_network()


class NoNetwork(PermissionError):
    """A socket the grader's sandbox refuses (the audit-hook fallback)."""


def _hook(event: str, args) -> None:
    if event == "socket.__new__":
        family = args[1]
        if family not in (socket.AF_UNIX, -1):
            raise NoNetwork(f"the grader's sandbox has no network: a socket of family {family} "
                            f"was refused")
    elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
        sock = args[0]
        if getattr(sock, "family", socket.AF_UNIX) != socket.AF_UNIX:
            raise NoNetwork(f"the grader's sandbox has no network: {event} "
                            f"{args[1] if len(args) > 1 else ''!r} was refused")
    elif event in ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr"):
        raise NoNetwork(f"the grader's sandbox has no network: {event} was refused")


def install_fallback() -> None:
    """In the sandbox where it has the judge's network: refuse sockets from Python on."""
    sys.addaudithook(_hook)
