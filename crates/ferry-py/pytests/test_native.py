"""The native API (ferry.Engine) on every backend: bytes really move, results
and errors are what the API promises."""

import array
import asyncio
import ctypes
import gc
import weakref

import pytest

import ferry
from conftest import address, pattern


def test_open_and_report(backend):
    e = ferry.Engine.open(backend.url())
    assert e.segment_name
    assert e.backend in ferry.BACKENDS + ("inproc",)
    r = e.report()
    assert set(r["operations"]) == {
        "batch_register",
        "batch_unregister",
        "batch_transfer",
        "async_batch",
        "batch_wait",
        "notify",
    }
    assert set(r["guarantees"]) == {"landed_writes", "peer_validation"}
    assert "operations:" in r["text"]
    for op in ("batch_register", "batch_unregister", "batch_transfer", "async_batch", "batch_wait"):
        support = r["operations"][op]["support"]
        assert support == ("emulated" if backend.emulated else "native"), (op, r["text"])
        assert r["effective"][op] is True
    notify = r["operations"]["notify"]
    assert notify["support"] in (("native",) if backend.notify else ("unsupported",)), r["text"]
    if not backend.notify:
        assert notify["reason"]


def test_write_read_bytes(pair):
    a, b = pair
    src = bytearray(pattern(64 * 1024))
    dst = bytearray(128 * 1024)
    sa, sl = a.register(src)
    da, dl = b.register(dst)
    assert (sa, sl) == (address(src), len(src))
    assert (da, dl) == (address(dst), len(dst))
    seg = a.open_segment(b.segment_name)
    a.write(seg, sa, da + 4096, len(src))
    assert bytes(dst[4096 : 4096 + len(src)]) == bytes(src)
    assert dst[:4096] == bytearray(4096) and dst[4096 + len(src) :] == bytearray(len(dst) - 4096 - len(src))
    # read back into another local region
    back = bytearray(len(src))
    a.register(back)
    a.read(seg, address(back), da + 4096, len(src))
    assert back == src
    a.close_segment(seg)


def test_batch_transfer_per_request_results(pair):
    a, b = pair
    src = bytearray(pattern(16 * 4096, seed=3))
    dst = bytearray(32 * 4096)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)
    n = 16
    results = a.batch_transfer(
        seg, "write", [sa + i * 4096 for i in range(n)], [da + 2 * i * 4096 for i in range(n)], [4096] * n
    )
    assert results == [None] * n
    for i in range(n):
        assert dst[2 * i * 4096 : 2 * i * 4096 + 4096] == src[i * 4096 : (i + 1) * 4096]
    # one bad request: its own error, the others land
    dst[:] = bytearray(len(dst))
    results = a.batch_transfer(seg, "write", [sa, sa, sa], [da, da + len(dst), da + 8192], [100, 100, 100])
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], ferry.AddressNotRegistered)
    assert results[1].side == "remote"
    assert bytes(dst[:100]) == bytes(src[:100]) and bytes(dst[8192:8292]) == bytes(src[:100])


def test_submit_status_wait_release(pair):
    a, b = pair
    src = bytearray(pattern(1 << 20, seed=5))
    dst = bytearray(1 << 20)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)
    bid = a.submit(seg, "write", [sa, sa + (1 << 19)], [da, da + (1 << 19)], [1 << 19, 1 << 19])
    states = a.status(bid)
    assert len(states) == 2 and all(s in ("pending", "completed") for s, _ in states)
    assert a.wait(bid) == [None, None]
    assert dst == src
    with pytest.raises(ferry.UnknownBatch) as ei:
        a.wait(bid)
    assert ei.value.batch == bid
    bid = a.submit(seg, "read", [sa], [da], [4096])
    while any(s == "pending" for s, _ in a.status(bid)):
        pass
    assert a.status(bid) == [("completed", None)]
    a.release_batch(bid)
    with pytest.raises(ferry.UnknownBatch):
        a.status(bid)


def test_notifications(pair, backend):
    a, b = pair
    src = bytearray(pattern(8192))
    dst = bytearray(8192)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)
    if not backend.notify:
        with pytest.raises(ferry.Unsupported) as ei:
            a.batch_transfer(seg, "write", [sa], [da], [8192], notify=("prefill", "req-1"))
        assert ei.value.operation == "notify"
        return
    assert a.batch_transfer(seg, "write", [sa], [da], [8192], notify=("prefill", "req-1 done")) == [None]
    assert dst == src
    notes = []
    for _ in range(2000):
        notes += b.take_notifications()
        if notes:
            break
        import time

        time.sleep(0.001)
    assert notes == [("prefill", "req-1 done")]
    # Awaited: the one named comes, the other stays queued; a wait that
    # times out takes nothing and returns None.
    assert b.next_notification("nobody", timeout=0.05) is None
    a.batch_transfer(seg, "write", [sa], [da], [8192], notify=("other", "first"))
    a.batch_transfer(seg, "write", [sa], [da], [8192], notify=("prefill", "req-2 done"))
    assert b.next_notification("prefill", timeout=30) == ("prefill", "req-2 done")
    assert b.next_notification(timeout=30) == ("other", "first")
    with pytest.raises(ValueError):
        b.next_notification(timeout=-1)
    # A wait without a timeout still sees signals (Ctrl-C): a handler that
    # raises ends it.
    import signal

    class Woken(Exception):
        pass

    def on_alarm(signum, frame):
        raise Woken()

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Woken):
            b.next_notification("nobody")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("kind", ["bytearray", "memoryview", "array", "ctypes", "numpy", "array_interface", "data_ptr"])
def test_register_objects(kind):
    a = ferry.Engine.open("tcp://127.0.0.1:0")
    b = ferry.Engine.open("tcp://127.0.0.1:0")
    n = 4096
    if kind == "bytearray":
        obj = bytearray(n)
    elif kind == "memoryview":
        obj = memoryview(bytearray(n))
    elif kind == "array":
        obj = array.array("I", [0] * (n // 4))
    elif kind == "ctypes":
        obj = (ctypes.c_uint8 * n)()
    elif kind == "numpy":
        np = pytest.importorskip("numpy")
        obj = np.zeros(n // 8, dtype=np.float64)
    elif kind == "array_interface":
        backing = (ctypes.c_uint8 * n)()

        class AI:
            __array_interface__ = {
                "version": 3,
                "shape": (n // 2,),
                "typestr": "<u2",
                "data": (ctypes.addressof(backing), False),
                "strides": None,
            }

        obj = AI()
        obj.backing = backing
    else:
        backing = (ctypes.c_uint8 * n)()

        class TensorLike:  # torch.Tensor's shape of the protocol
            nbytes = n

            def data_ptr(self):
                return ctypes.addressof(backing)

            def is_contiguous(self):
                return True

        obj = TensorLike()
        obj.backing = backing
    addr, length = b.register(obj)
    assert length == n
    src = bytearray(pattern(n, seed=9))
    sa, _ = a.register(src)
    seg = a.open_segment(b.segment_name)
    a.write(seg, sa, addr, n)
    assert ctypes.string_at(addr, n) == bytes(src)
    assert b.registered() == [(addr, n)]
    b.unregister(obj)
    assert b.registered() == []


def test_registered_object_is_kept_alive_and_released():
    np = pytest.importorskip("numpy")
    a = ferry.Engine.open("tcp://127.0.0.1:0")
    b = ferry.Engine.open("tcp://127.0.0.1:0")
    arr = np.zeros(1 << 16, dtype=np.uint8)
    ref = weakref.ref(arr)
    addr, n = b.register(arr)
    del arr
    gc.collect()
    assert ref() is not None, "a registered array must stay alive"
    src = bytearray(pattern(n))
    sa, _ = a.register(src)
    seg = a.open_segment(b.segment_name)
    a.write(seg, sa, addr, n)  # its memory is still valid: the bytes land
    assert bytes(ref()) == bytes(src)
    b.unregister(addr)
    gc.collect()
    assert ref() is None, "unregister releases the array"
    # the peer's view is gone too: writes there now fail, nothing is written
    with pytest.raises(ferry.AddressNotRegistered):
        a.write(seg, sa, addr, n)


def test_buffer_cannot_be_resized_or_released_while_registered():
    e = ferry.Engine.open("tcp://127.0.0.1:0")
    buf = bytearray(4096)
    e.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x" * 4096)  # would move the memory peers write into
    base = bytearray(4096)
    mv = memoryview(base)
    addr, _ = e.register(mv)
    # Releasing the caller's view frees nothing: Ferry holds its own export
    # of the underlying bytearray, which therefore still cannot move.
    mv.release()
    with pytest.raises(BufferError):
        base.extend(b"x")
    e.unregister(buf)
    buf.extend(b"ok")
    e.unregister(addr)
    base.extend(b"ok")


def test_bad_input_raises_never_crashes(pair):
    a, b = pair
    src = bytearray(4096)
    dst = bytearray(4096)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)
    # wrong types
    with pytest.raises(TypeError):
        a.register("not memory")
    with pytest.raises(TypeError):
        a.register(1234)  # an address needs a length
    with pytest.raises(TypeError):
        a.register(True, 10)
    with pytest.raises(TypeError):
        a.transfer(seg, "write", "0x10", da, 10)
    with pytest.raises(TypeError):
        a.batch_transfer(seg, "write", "abc", [da], [1])
    with pytest.raises(ValueError):
        a.transfer(seg, "copy", sa, da, 10)
    # read-only and oversized objects
    with pytest.raises(ValueError):
        a.register(b"immutable bytes")
    with pytest.raises(ValueError):
        a.register(bytearray(10), 11)
    with pytest.raises((ValueError, OverflowError)):
        a.register(-1, 10)
    # wrong lengths
    with pytest.raises(ValueError):
        a.batch_transfer(seg, "write", [sa, sa], [da], [10, 10])
    with pytest.raises(ferry.InvalidArgument):
        a.register(address(bytearray(1)), 0)  # empty region
    # unregistered addresses, local and remote, beyond the end, wrapping
    with pytest.raises(ferry.AddressNotRegistered) as ei:
        a.write(seg, sa + 4000, da, 200)
    assert ei.value.side == "local" and ei.value.addr == sa + 4000
    with pytest.raises(ferry.AddressNotRegistered) as ei:
        a.write(seg, sa, da + 1, 4096)
    assert ei.value.side == "remote"
    with pytest.raises(ferry.AddressNotRegistered):
        a.write(seg, sa, 2**64 - 10, 100)
    assert dst == bytearray(4096), "a refused request writes nothing"
    # overlap, unknown region, unknown segment, unknown batch
    with pytest.raises(ferry.RegionOverlap) as ei:
        a.register(sa + 10, 100)
    assert ei.value.existing_addr == sa
    with pytest.raises(ferry.RegionNotRegistered):
        a.unregister(sa + 1)
    with pytest.raises(ferry.UnknownSegment):
        a.write(seg + 1000, sa, da, 10)
    with pytest.raises(ferry.UnknownBatch):
        a.wait(987654)
    # all-or-nothing batch register
    x, y = bytearray(64), bytearray(64)
    with pytest.raises(ferry.BatchRegisterFailed) as ei:
        a.batch_register([x, y, sa], [None, None, 64])  # the third overlaps src
    assert ei.value.index == 2 and isinstance(ei.value.source, ferry.RegionOverlap)
    a.register(x)  # nothing stayed registered
    a.register(y)


def test_error_classes_and_fields():
    with pytest.raises(ferry.InvalidArgument):
        ferry.Engine.open("udp://127.0.0.1:0")
    with pytest.raises(ferry.Unavailable) as ei:
        ferry.Engine.open("mooncake://?lib=/nonexistent/libtransfer_engine.so")
    assert ei.value.backend == "mooncake" and "/nonexistent" in ei.value.reason
    with pytest.raises(ferry.MissingCapabilities) as ei:
        ferry.Engine.open("inproc://?caps=none&strict=1&require=batch_transfer,notify")
    missing = {m["operation"] for m in ei.value.missing}
    assert missing == {"batch_transfer", "notify"}
    assert all(m["reason"] for m in ei.value.missing)
    e = ferry.Engine.open("tcp://127.0.0.1:0")
    with pytest.raises(ferry.SegmentUnavailable) as ei:
        e.open_segment("127.0.0.1:1")
    assert ei.value.name == "127.0.0.1:1" and ei.value.retryable
    assert isinstance(ei.value, ConnectionError)
    strict = ferry.Engine.open("inproc://?caps=none&strict=1")
    with pytest.raises(ferry.Unsupported) as ei:
        strict.batch_register([bytearray(8)])
    assert ei.value.operation == "batch_register"
    # every ferry::Error variant has its class
    for name in ferry.errors.__all__:
        assert issubclass(getattr(ferry, name), ferry.FerryError)


def test_missing_capabilities_names_version(tmp_path_factory):
    from conftest import make_backend

    old = make_backend("mooncake-v0.2.0", tmp_path_factory)
    with pytest.raises(ferry.MissingCapabilities) as ei:
        ferry.Engine.open(old.url() + "&require=notify")
    (m,) = ei.value.missing
    assert m["operation"] == "notify"
    assert m["min_version"], m  # the Mooncake release that adds it


def test_asyncio_flavour(pair):
    a, b = pair
    src = bytearray(pattern(1 << 20, seed=11))
    dst = bytearray(1 << 20)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        assert await a.transfer_async(seg, "write", sa, da, 4096) is None
        results = await a.batch_transfer_async(
            seg, "write", [sa + i * 65536 for i in range(16)], [da + i * 65536 for i in range(16)], [65536] * 16
        )
        assert results == [None] * 16
        bid = a.submit(seg, "read", [sa], [da], [4096])
        assert await a.wait_async(bid) == [None]
        with pytest.raises(ferry.AddressNotRegistered):
            await a.transfer_async(seg, "write", sa, da + (1 << 20), 4096)
        with pytest.raises(ferry.UnknownBatch):
            await a.wait_async(424242)
        t.cancel()
        return ticks

    ticks = asyncio.run(main())
    assert dst == src
    assert ticks > 0, "the event loop kept running while transfers were in flight"


def test_dropping_an_engine_unregisters_then_releases(backend):
    """An engine dropped with regions registered unregisters them (waiting
    for transfers) before it lets go of the objects."""
    np = pytest.importorskip("numpy")
    a = ferry.Engine.open(backend.url())
    b = ferry.Engine.open(backend.url())
    arr = np.zeros(1 << 20, dtype=np.uint8)
    ref = weakref.ref(arr)
    addr, n = b.register(arr)
    del arr
    src = bytearray(pattern(n))
    sa, _ = a.register(src)
    seg = a.open_segment(b.segment_name)
    bid = a.submit(seg, "write", [sa], [addr], [n])
    del b
    gc.collect()
    assert ref() is None, "the engine's objects are released once it is dropped"
    # the transfer in flight finished before the memory was released, or
    # failed; either way the peer is gone for new requests
    a.wait(bid)
    with pytest.raises(ferry.FerryError):
        a.write(seg, sa, addr, 16)


def test_metrics_count_the_bytes_moved(pair):
    a, b = pair
    src = bytearray(pattern(8 * 4096, seed=5))
    dst = bytearray(8 * 4096)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    before = a.metrics()
    seg = a.open_segment(b.segment_name)
    results = a.batch_transfer(seg, "write", [sa, sa + 4096], [da, da + 4096], [4096, 1000])
    assert results == [None, None]
    a.read(seg, sa, da, 100)
    # One request outside the peer's region fails, counted by its kind.
    results = a.batch_transfer(seg, "write", [sa], [da + len(dst)], [10])
    assert isinstance(results[0], ferry.AddressNotRegistered)
    m = a.metrics()
    assert m["engine"] == a.segment_name
    peer = m["peers"][b.segment_name]
    old = before["peers"].get(b.segment_name, {"bytes_written": 0, "bytes_read": 0})
    assert peer["bytes_written"] - old["bytes_written"] == 5096
    assert peer["bytes_read"] - old["bytes_read"] == 100
    assert peer["requests_failed"].get("not_registered", 0) >= 1
    assert peer["path"] is None or isinstance(peer["path"], str)
    assert m["registered_bytes"] >= len(src)
    assert m["batches_in_flight"] == 0
    assert m["bytes_total"] >= 5196
    a.close_segment(seg)


def test_single_transfers_land_count_once_and_stop_at_close(pair):
    """One request at a time (on TCP, the segment's fast path: a granted
    same-host copy done by the calling thread): every write lands, each is
    counted once, and a closed segment refuses the next one, typed."""
    a, b = pair
    src = bytearray(8 * 4096)
    dst = bytearray(8 * 4096)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)
    before = a.metrics()
    old = before["peers"].get(b.segment_name, {"bytes_written": 0, "requests_ok": 0})
    n = 200
    for i in range(n):
        slot = (i % 8) * 4096
        src[slot : slot + 4096] = pattern(4096, seed=i)
        a.transfer(seg, "write", sa + slot, da + slot, 4096)
        assert dst[slot : slot + 4096] == src[slot : slot + 4096], i
    peer = a.metrics()["peers"][b.segment_name]
    assert peer["requests_ok"] - old["requests_ok"] == n
    assert peer["bytes_written"] - old["bytes_written"] == n * 4096
    assert a.metrics()["batches_in_flight"] == 0
    # A batch of one request, no notification: the same path, counted too.
    for i in range(20):
        src[:4096] = pattern(4096, seed=300 + i)
        assert a.batch_transfer(seg, "write", [sa], [da], [4096]) == [None]
        assert dst[:4096] == src[:4096], i
    peer = a.metrics()["peers"][b.segment_name]
    assert peer["requests_ok"] - old["requests_ok"] == n + 20
    # The op in any case, its short form too.
    for op in ("WRITE", "W", "Write"):
        src[:16] = pattern(16, seed=len(op))
        a.transfer(seg, op, sa, da, 16)
        assert dst[:16] == src[:16], op
    a.close_segment(seg)
    snapshot = bytes(dst)
    src[:4096] = pattern(4096, seed=99)
    with pytest.raises(ferry.UnknownSegment):
        a.transfer(seg, "write", sa, da, 4096)
    assert bytes(dst) == snapshot, "a write after close_segment changed bytes"


def test_mooncake_compatible_engine_exposes_ferry_metrics():
    from ferry.mooncake import TransferEngine

    te = TransferEngine("tcp://")
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    m = te.ferry_metrics()
    assert m["engine"] == te.ferry_engine().segment_name
    assert m["bytes_total"] == 0 and m["peers"] == {}
