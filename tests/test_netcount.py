"""observe.netcount: the kernel's per-socket counters, checked against bytes we know we sent, and
what Gloo's collectives really move (the facts chapter 03 and 04 rely on)."""
import socket
import threading

import pytest
import torch

from labkit.launch import run
from labkit.observe import netcount


def _loopback_pair():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    return a, b


def _send_all(src, dst, nbytes):
    got = bytearray()

    def read():
        while len(got) < nbytes:
            got.extend(dst.recv(1 << 20))
    t = threading.Thread(target=read)
    t.start()
    src.sendall(b"x" * nbytes)
    t.join()
    return len(got)


def test_tcp_info_offsets_read_known_bytes():
    a, b = _loopback_pair()
    with a, b:
        before_a, before_b = netcount.tcp_info(a), netcount.tcp_info(b)
        assert _send_all(a, b, 1_000_003) == 1_000_003
        after_a, after_b = netcount.tcp_info(a), netcount.tcp_info(b)
    assert after_a["bytes_acked"] - before_a["bytes_acked"] == 1_000_003
    assert after_b["bytes_received"] - before_b["bytes_received"] == 1_000_003
    assert after_a["bytes_received"] == before_a["bytes_received"]


def test_socket_bytes_counts_this_process_both_ways():
    a, b = _loopback_pair()
    with a, b:
        with netcount.socket_bytes() as c:
            _send_all(a, b, 300_000)
            _send_all(b, a, 12_345)
    # both ends live in this process: each direction is sent once and received once
    assert c.reason is None and c.sockets >= 2
    assert c.sent == c.received == 312_345


def test_lo_interface_cross_check_sees_at_least_the_payload():
    a, b = _loopback_pair()
    with a, b, netcount.lo_bytes() as lo:
        _send_all(a, b, 500_000)
    if lo.bytes is None:
        pytest.skip("no /proc/net/dev")
    # machine-wide and with TCP/IP headers: at least our payload, maybe others' traffic too
    assert lo.bytes >= 500_000


def test_nccl_says_it_cannot_count(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with netcount.socket_bytes() as c:
        pass
    assert c.sent is None and c.received is None and "NCCL" in c.reason
    assert "cannot count" in repr(c)


def _collectives(numel):
    import torch.distributed as dist

    from labkit.collectives import ring_all_reduce, ring_reduce_scatter

    n = dist.get_world_size()
    x = torch.randn(numel)                                   # D = 4 * numel bytes
    calls = {
        "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(numel), x[:numel // n]),
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(numel // n), x),
        "ring_reduce_scatter": lambda: ring_reduce_scatter(x.clone()),
        "ring_all_reduce": lambda: ring_all_reduce(x),
    }
    out = {}
    for name, call in calls.items():
        dist.barrier()
        with netcount.socket_bytes() as c:
            call()
        out[name] = (c.sent, c.received)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_collectives_counted_by_the_kernel(world):
    numel = 12 * 2**16                                       # 3 MiB: divides by 2, 3, 4
    D = 4 * numel
    per_rank = run(_collectives, world, args=(numel,), timeout=120, echo=False)
    one, two = (world - 1) / world * D, 2 * (world - 1) / world * D
    expect = {"all_gather": one, "all_reduce": two, "ring_reduce_scatter": one,
              "ring_all_reduce": two,
              # Gloo's reduce-scatter reduces the whole buffer everywhere and keeps a chunk: it
              # moves all-reduce bytes, 2x the ring's (why labkit.zero uses the ring on Gloo)
              "reduce_scatter_tensor": two}
    for rank, res in enumerate(per_rank):
        for name, want in expect.items():
            # payload plus Gloo's per-message headers: within 1%. (Only what this rank sent:
            # a peer that leaves the barrier first may send before this rank starts counting.)
            sent = res[name][0]
            assert sent == pytest.approx(want, rel=0.01), (rank, name, sent / D)


def test_a_socket_opened_inside_the_block_is_counted_and_store_ports_are_left_out():
    with netcount.socket_bytes() as c:
        a, b = _loopback_pair()                    # opened after the counter started
        _send_all(a, b, 70_000)
        port = a.getsockname()[1]
        with netcount.socket_bytes(exclude_ports=(port,)) as without:
            _send_all(a, b, 50_000)
    a.close()
    b.close()
    # + 1: the kernel counts the connecting side's SYN as one acknowledged byte
    assert c.sent == 120_001 and c.sockets >= 2
    # a's own port is skipped (as a TCPStore's MASTER_PORT is): b's side has it as the peer port
    assert without.sent == 0 and without.received == 0
