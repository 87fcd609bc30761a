"""ferry.mooncake.TransferEngine: Mooncake's Python API, as SGLang and vLLM
call it, on every backend — every batch method present, return conventions
kept, failures negative (never a crash)."""

import ctypes
import logging
import time

import pytest

import ferry
from ferry.mooncake import Read, TransferEngine, TransferNotify, TransferOpcode, Write
from conftest import address, pattern


def started(backend, hostname=None):
    te = TransferEngine(backend.compat_url())
    hostname = hostname or backend.hostname()
    metadata = backend.metadata or "P2PHANDSHAKE"
    # SGLang's and vLLM's call: initialize(hostname, "P2PHANDSHAKE", protocol,
    # device). These hosts have no RDMA device, and Ferry's own transports
    # refuse "rdma" unless the fallback is asked for
    # (test_tcp_backend_fails_loudly): "tcp" everywhere.
    protocol = "tcp"
    assert te.initialize(hostname, metadata, protocol, "") == 0, te.last_error()
    return te


def session(backend, te):
    """The name peers use: SGLang's f"{hostname}:{get_rpc_port()}" — on
    every backend whose names are addresses (all but inproc://), including
    v0.2.0-era Mooncake with a metadata server, which publishes
    local_hostname "host:port" as the name."""
    if backend.name.startswith("inproc"):
        return te.get_engine().segment_name
    sid = f"127.0.0.1:{te.get_rpc_port()}"
    assert sid == te.get_engine().segment_name
    return sid


def test_sglang_flow(backend):
    """What SGLang's MooncakeTransferEngine wrapper does, step by step."""
    prefill = started(backend)
    decode = started(backend)
    kv_src = [bytearray(pattern(64 * 1024, seed=i)) for i in range(4)]
    kv_dst = [bytearray(64 * 1024) for _ in range(4)]
    # register(ptr, length) / batch_register(ptrs, lengths)
    assert prefill.register_memory(address(kv_src[0]), len(kv_src[0])) == 0
    assert prefill.batch_register_memory([address(b) for b in kv_src[1:]], [len(b) for b in kv_src[1:]]) == 0
    assert decode.batch_register_memory([address(b) for b in kv_dst], [len(b) for b in kv_dst]) == 0
    sid = session(backend, decode)
    # transfer_sync(session_id, buffer, peer_buffer_address, length)
    assert prefill.transfer_sync_write(sid, address(kv_src[0]), address(kv_dst[0]), 4096) == 0
    assert kv_dst[0][:4096] == kv_src[0][:4096]
    # batch_transfer_sync(session_id, buffers, peer_buffer_addresses, lengths)
    ret = prefill.batch_transfer_sync_write(
        sid, [address(b) for b in kv_src], [address(b) for b in kv_dst], [len(b) for b in kv_src]
    )
    assert ret == 0, prefill.last_error()
    assert kv_dst == kv_src
    assert prefill.send_probe(sid) == 0
    # deregister / batch_deregister
    assert prefill.unregister_memory(address(kv_src[0])) == 0
    assert prefill.batch_unregister_memory([address(b) for b in kv_src[1:]]) == 0
    assert decode.batch_unregister_memory([address(b) for b in kv_dst]) == 0


def test_every_method_exists_and_is_reported(backend):
    te = started(backend)
    mooncake_methods = [
        "initialize", "initialize_ext", "get_rpc_port", "get_engine", "register_memory",
        "unregister_memory", "batch_register_memory", "batch_unregister_memory",
        "transfer_sync_write", "transfer_sync_read", "transfer_sync",
        "batch_transfer_sync_write", "batch_transfer_sync_read", "batch_transfer_sync",
        "batch_transfer_async_write", "batch_transfer_async_read", "batch_transfer_async",
        "get_batch_transfer_status", "transfer_submit_write", "transfer_check_status",
        "get_notifies", "allocate_managed_buffer", "free_managed_buffer",
        "write_bytes_to_buffer", "read_bytes_from_buffer", "get_first_buffer_address",
        "send_probe", "get_local_topology", "warmup_efa_segment",
    ]
    for m in mooncake_methods:
        assert callable(getattr(te, m)), m
    support = te.ferry_support()
    batch = [m for m in support if m.startswith("batch_") or m in ("get_batch_transfer_status",)]
    for m in batch:
        expected = "emulated" if backend.emulated else "native"
        assert support[m]["support"] == expected, (m, support[m])
        if backend.emulated:
            assert support[m]["via"] and support[m]["reason"]
    assert support["get_notifies"]["support"] == ("native" if backend.notify else "unsupported")


def test_async_batches_and_status(backend):
    a = started(backend)
    b = started(backend)
    src = a.allocate_managed_buffer(1 << 20)
    assert src != 0, a.last_error()
    payload = pattern(1 << 20, seed=2)
    assert a.write_bytes_to_buffer(src, payload, len(payload)) == 0
    dst = bytearray(1 << 20)
    assert b.register_memory(address(dst), len(dst)) == 0
    sid = session(backend, b)
    n = 64
    blk = (1 << 20) // n
    ids = [
        a.batch_transfer_async_write(sid, [src + i * blk], [address(dst) + i * blk], [blk])
        for i in range(n)
    ]
    assert all(i > 0 for i in ids) and len(set(ids)) == n
    assert a.get_batch_transfer_status(ids) == 0
    assert bytes(dst) == payload
    # read back through the async read path into a second managed buffer
    back = a.allocate_managed_buffer(1 << 20)
    bid = a.batch_transfer_async(sid, [back], [address(dst)], [1 << 20], TransferOpcode.Read)
    assert bid > 0 and a.get_batch_transfer_status([bid]) == 0
    assert a.read_bytes_from_buffer(back, 1 << 20) == payload
    # transfer_submit_write + transfer_check_status (1 done, 0 pending)
    bid = a.transfer_submit_write(sid, src, address(dst), 4096)
    deadline = time.time() + 30
    while (st := a.transfer_check_status(bid)) == 0 and time.time() < deadline:
        time.sleep(0.0005)
    assert st == 1
    assert a.transfer_check_status(bid) == -1  # released: unknown now
    # sync read and the generic transfer_sync with an opcode
    assert a.transfer_sync_read(sid, back, address(dst) + 100, 100) == 0
    assert a.transfer_sync(sid, back, address(dst), 100, Read) == 0
    assert a.batch_transfer_sync_read(sid, [back], [address(dst)], [64]) == 0
    assert a.batch_transfer_sync(sid, [src], [address(dst)], [64], Write) == 0
    assert a.free_managed_buffer(src, 1 << 20) == 0
    assert a.free_managed_buffer(back, 1 << 20) == 0
    assert a.free_managed_buffer(back, 1 << 20) == -1


def test_failures_are_negative_returns(backend):
    a = started(backend)
    b = started(backend)
    src = bytearray(pattern(8192))
    dst = bytearray(8192)
    assert a.register_memory(address(src), len(src)) == 0
    assert b.register_memory(address(dst), len(dst)) == 0
    sid = session(backend, b)
    # unregistered remote and local addresses
    assert a.transfer_sync_write(sid, address(src), address(dst) + 8192, 16) < 0
    assert isinstance(a.last_error(), ferry.AddressNotRegistered)
    assert a.transfer_sync_write(sid, address(src) + 8190, address(dst), 16) < 0
    assert a.batch_transfer_sync_write(sid, [address(src)] * 2, [address(dst), address(dst) + 10**6], [16, 16]) < 0
    # a batch of one (sent as one transfer) fails as any batch does
    assert a.batch_transfer_sync_write(sid, [address(src)], [address(dst) + 8192], [16]) < 0
    assert isinstance(a.last_error(), ferry.AddressNotRegistered)
    assert a.batch_transfer_sync_write(sid, [address(src) + 8190], [address(dst)], [16]) < 0
    assert isinstance(a.last_error(), ferry.AddressNotRegistered)
    with pytest.raises(TypeError):
        a.batch_transfer_sync_write(sid, ["buffer"], [address(dst)], [16])
    with pytest.raises((TypeError, OverflowError)):
        a.batch_transfer_sync_write(sid, [-1], [address(dst)], [16])
    assert dst[16:] == bytearray(8192 - 16)
    # different list lengths
    assert a.batch_transfer_sync_write(sid, [address(src)], [address(dst)] * 2, [16]) < 0
    assert a.batch_transfer_async_write(sid, [address(src)], [], [16]) == 0
    assert a.batch_register_memory([address(src)], [1, 2]) < 0
    # unknown peer, unknown batch ids, double registration, unknown region
    assert a.transfer_sync_write("127.0.0.1:1", address(src), address(dst), 16) < 0
    assert a.batch_transfer_async_write("127.0.0.1:1", [address(src)], [address(dst)], [16]) == 0
    assert a.send_probe("127.0.0.1:1") < 0
    assert a.get_batch_transfer_status([12345]) < 0
    assert a.transfer_check_status(12345) < 0
    assert a.register_memory(address(src), len(src)) < 0
    assert isinstance(a.last_error(), ferry.RegionOverlap)
    assert a.unregister_memory(address(src) + 1) < 0
    # a failed async batch: status -1, and it is released
    bid = a.batch_transfer_async_write(sid, [address(src)], [address(dst) + 9000], [16])
    if bid:
        assert a.get_batch_transfer_status([bid]) == -1
    # copies outside registered memory are refused, not performed
    assert a.write_bytes_to_buffer(address(src) + 8000, b"x" * 500, 500) < 0
    with pytest.raises(ferry.AddressNotRegistered):
        a.read_bytes_from_buffer(address(dst), 10)  # dst is b's, not a's
    # wrong types raise TypeError, as Mooncake's pybind11 binding does
    with pytest.raises(TypeError):
        a.transfer_sync_write(sid, "buffer", address(dst), 16)
    with pytest.raises(TypeError):
        a.batch_transfer_sync_write(sid, None, [address(dst)], [16])
    with pytest.raises(TypeError):
        a.transfer_sync(sid, address(src), address(dst), 16, "sideways-opcode-object" and object())


def test_uninitialized_engine_is_an_error_not_a_crash():
    te = TransferEngine("tcp://")
    with pytest.raises(RuntimeError):
        te.get_rpc_port()
    bad = TransferEngine("mooncake://?lib=/nonexistent/libtransfer_engine.so")
    assert bad.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert isinstance(bad.last_error(), ferry.Unavailable)


def test_notifications(backend):
    a = started(backend)
    b = started(backend)
    src = bytearray(pattern(4096))
    dst = bytearray(4096)
    a.register_memory(address(src), 4096)
    b.register_memory(address(dst), 4096)
    sid = session(backend, b)
    note = TransferNotify("prefill-0", "room 42 done")
    ret = a.transfer_sync(sid, address(src), address(dst), 4096, Write, note)
    if not backend.notify:
        assert ret < 0 and isinstance(a.last_error(), ferry.Unsupported)
        assert b.get_notifies() == []
        return
    assert ret == 0 and dst == src
    got = []
    deadline = time.time() + 10
    while not got and time.time() < deadline:
        got = b.get_notifies()
        time.sleep(0.001)
    assert got == [note]
    ret = a.batch_transfer_sync(sid, [address(src)], [address(dst)], [16], Write, TransferNotify("p", "again"))
    assert ret == 0
    deadline = time.time() + 10
    got = []
    while not got and time.time() < deadline:
        got = b.get_notifies()
        time.sleep(0.001)
    assert [(n.name, n.msg) for n in got] == [("p", "again")]


def test_first_buffer_address_and_topology():
    te = TransferEngine("tcp://")
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = bytearray(64)
    assert te.get_first_buffer_address(te.get_engine().segment_name) == 0
    te.register_memory(address(buf), 64)
    assert te.get_first_buffer_address(te.get_engine().segment_name) == address(buf)
    assert te.get_first_buffer_address("127.0.0.1:1") == 0
    assert te.get_local_topology() == "{}"
    assert te.warmup_efa_segment("x") == 0


def test_concurrent_threads(backend):
    """SGLang transfers from a thread pool: one engine, many threads."""
    from concurrent.futures import ThreadPoolExecutor

    a = started(backend)
    b = started(backend)
    threads, rounds, blk = 8, 20, 8192
    src = bytearray(pattern(threads * blk, seed=4))
    dst = bytearray(threads * blk)
    assert a.register_memory(address(src), len(src)) == 0
    assert b.register_memory(address(dst), len(dst)) == 0
    sid = session(backend, b)

    def worker(t):
        codes = []
        for r in range(rounds):
            half = blk // 2
            codes.append(
                a.batch_transfer_sync_write(
                    sid,
                    [address(src) + t * blk, address(src) + t * blk + half],
                    [address(dst) + t * blk, address(dst) + t * blk + half],
                    [half, half],
                )
            )
            bid = a.batch_transfer_async_write(sid, [address(src) + t * blk], [address(dst) + t * blk], [blk])
            codes.append(a.get_batch_transfer_status([bid]) if bid else -99)
        return codes

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(worker, range(threads)))
    assert all(c == 0 for codes in results for c in codes), results
    assert dst == src


def test_tcp_backend_fails_loudly(caplog, monkeypatch):
    """On tcp:// nothing is downgraded silently: a transport it cannot
    honour, an unknown protocol, a missing device and a metadata server it
    cannot use are initialize() == -1, logged at WARNING with the reason."""
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.delenv("FERRY_ALLOW_PROTOCOL_FALLBACK", raising=False)
    cases = [
        (("127.0.0.1", "P2PHANDSHAKE", "rdma", ""), "cannot be honoured"),
        (("127.0.0.1", "P2PHANDSHAKE", "rmda", ""), "unknown protocol 'rmda'"),
        (("127.0.0.1", "P2PHANDSHAKE", "tcp", "nonexistent0"), "nonexistent0"),
        (("127.0.0.1", "redis://10.0.0.9:6379", "tcp", ""), "metadata server"),
        (("127.0.0.1", "http://10.0.0.9:8080/metadata", "tcp", ""), "metadata server"),
    ]
    for args, why in cases:
        caplog.clear()
        te = TransferEngine("tcp://")
        with caplog.at_level(logging.WARNING, logger="ferry.mooncake"):
            assert te.initialize(*args) == -1, args
        assert why in str(te.last_error()), (args, te.last_error())
        assert any(
            r.levelno == logging.WARNING and why in r.getMessage() for r in caplog.records
        ), args


def test_tcp_protocol_fallback_is_opt_in(caplog, monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.delenv("FERRY_ALLOW_PROTOCOL_FALLBACK", raising=False)
    te = TransferEngine("tcp://?allow_protocol_fallback=1")
    with caplog.at_level(logging.WARNING, logger="ferry.mooncake"):
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0, te.last_error()
    assert any("falling back" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("FERRY_ALLOW_PROTOCOL_FALLBACK", "1")
    assert TransferEngine("tcp://").initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    monkeypatch.delenv("FERRY_ALLOW_PROTOCOL_FALLBACK")
    # MC_FORCE_TCP (set to any value): Mooncake's TCP transport only.
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert TransferEngine("tcp://").initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0


def test_default_url_without_the_wheel(monkeypatch):
    monkeypatch.delenv("FERRY_URL", raising=False)
    import importlib.util

    from ferry import mooncake as fm

    expected = "mooncake-py://" if importlib.util.find_spec("mooncake") else "tcp://"
    assert fm.default_url() == expected
    assert TransferEngine()._base_url == expected


def test_get_engine_ptr_without_a_wheel(backend):
    te = started(backend)
    assert te.get_engine_ptr() == 0
    assert "no Mooncake C++ engine" in str(te.last_error())
    assert te.get_engine() is te.ferry_engine()
