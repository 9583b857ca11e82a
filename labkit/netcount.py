"""Moved to labkit.observe.netcount; this name stays for the notebooks and the code that import
`from labkit import netcount` (chapters 01-10, labkit.zero, labkit.check, labkit.labs)."""
from labkit.observe.netcount import (  # noqa: F401
                                     LoBytes,
                                     SocketBytes,
                                     lo_bytes,
                                     snapshot,
                                     socket_bytes,
                                     tcp_info,
                                     why_not,
)
