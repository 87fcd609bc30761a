"""When Ferry lets go of registered memory (issue 41, items 3, 4 and 8).

The rule: a holder (the buffer export or object reference that keeps
registered memory valid) is released only once the region is known to be
unregistered; on doubt it is kept (leaked), never released.

``mooncake-py://`` is tested here over a **test double** of the Mooncake
wheel (``FakeWheelTestDouble``, put in ``sys.modules`` as
``mooncake.engine``): a Python class whose ``unregister_memory`` can be told
to fail, which the real wheels cannot be made to do on demand
(``test_wheel.py`` makes them fail for real, on a region unregistered
behind Ferry's back).
"""

import gc
import logging
import sys
import types
import weakref

import pytest

import ferry


class FakeWheelTestDouble:
    """Test double of ``mooncake.engine.TransferEngine`` (not Mooncake):
    just enough for Ferry's ``mooncake-py://`` backend. ``fail_unregister``
    makes ``unregister_memory`` / ``batch_unregister_memory`` return -1
    (as a wheel that refuses does) and keep the region."""

    fail_unregister = False
    # ``batch_register_memory`` keeps the first ``batch_keeps`` regions,
    # then fails (-1), as a wheel that stops half-way would.
    batch_keeps = None

    def __init__(self):
        self.registered = {}

    def initialize(self, host, metadata, protocol, device):
        return 0

    def get_rpc_port(self):
        return 1

    def register_memory(self, addr, length):
        if addr in self.registered:
            return -1
        self.registered[addr] = length
        return 0

    def unregister_memory(self, addr):
        if addr not in self.registered:
            return -3  # ERR_ADDRESS_NOT_REGISTERED, as the real wheels answer
        if FakeWheelTestDouble.fail_unregister:
            return -1
        del self.registered[addr]
        return 0

    def batch_register_memory(self, addrs, lengths, location="*"):
        keeps = FakeWheelTestDouble.batch_keeps
        for i, (a, n) in enumerate(zip(addrs, lengths)):
            if keeps is not None and i >= keeps:
                return -1
            self.registered[a] = n
        return 0

    def batch_unregister_memory(self, addrs):
        if FakeWheelTestDouble.fail_unregister or any(a not in self.registered for a in addrs):
            return -1
        for a in addrs:
            del self.registered[a]
        return 0


@pytest.fixture
def fake_wheel(monkeypatch):
    """``mooncake.engine`` is the test double for this test only."""
    package = types.ModuleType("mooncake")
    engine = types.ModuleType("mooncake.engine")
    engine.TransferEngine = FakeWheelTestDouble
    engine.SUPPORT_CUDA = False
    package.engine = engine
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)
    monkeypatch.setattr(FakeWheelTestDouble, "fail_unregister", False)
    monkeypatch.setattr(FakeWheelTestDouble, "batch_keeps", None)
    return FakeWheelTestDouble


def resizable(buf):
    """Whether nothing holds an export of ``buf`` (it can be resized)."""
    try:
        buf.extend(b"x")
    except BufferError:
        return False
    del buf[-1:]
    return True


def test_a_refused_unregister_keeps_the_region_registered(fake_wheel):
    """Item 4: the wheel refuses ``unregister_memory``: the region stays in
    Ferry's table (a second ``unregister`` is refused by the wheel again,
    not answered ``RegionNotRegistered``), its holder stays, and the error
    is the wheel's (``Backend``)."""
    e = ferry.Engine("mooncake-py://")
    buf = bytearray(4096)
    addr, n = e.register(buf)
    fake_wheel.fail_unregister = True
    for _ in range(2):
        with pytest.raises(ferry.Backend) as err:
            e.unregister(addr)
        assert "unregister_memory" in str(err.value)
        assert e.registered() == [(addr, n)]
        assert not resizable(buf)
    fake_wheel.fail_unregister = False
    e.unregister(addr)
    assert e.registered() == [] and resizable(buf)


def test_a_failed_batch_register_whose_undo_is_refused_keeps_what_the_wheel_kept(fake_wheel):
    """Issue 41 audit: the wheel's ``batch_register_memory`` keeps two of
    three regions and fails, and refuses to let them go again. The regions
    it may still have stay in Ferry's table (``RegionHeld`` as the cause of
    ``BatchRegisterFailed``) and their objects stay alive; once the wheel
    lets go, ``unregister`` releases them. Before, Ferry forgot the regions
    and released the objects while the wheel still had their memory."""
    e = ferry.Engine("mooncake-py://")
    bufs = [bytearray(4096) for _ in range(3)]
    fake_wheel.batch_keeps = 2
    fake_wheel.fail_unregister = True
    with pytest.raises(ferry.BatchRegisterFailed) as err:
        e.batch_register(bufs)
    assert "stays registered" in str(err.value), str(err.value)
    kept = [ferry_addr(b) for b in bufs[:2]]
    # Which regions the wheel kept is not certain from here: every object
    # of the batch is kept alive.
    assert set(kept) <= {a for a, _ in e.registered()}
    assert not any(resizable(b) for b in bufs), "released while the wheel may still have it"
    fake_wheel.fail_unregister = False
    for b in bufs[:2]:
        e.unregister(b)
    # The third never stayed: the engine says so, and its object goes.
    with pytest.raises(ferry.RegionNotRegistered):
        e.unregister(bufs[2])
    assert e.registered() == []
    assert all(resizable(b) for b in bufs)


def ferry_addr(buf):
    """The address Ferry registers for ``buf`` (its first byte)."""
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def test_a_refused_batch_unregister_keeps_every_region(fake_wheel):
    """Item 4, the wheel's batch call: refused, every region of it stays
    registered in Ferry's table and keeps its holder."""
    e = ferry.Engine("mooncake-py://")
    bufs = [bytearray(4096) for _ in range(3)]
    regions = e.batch_register(bufs)
    addrs = [a for a, _ in regions]
    fake_wheel.fail_unregister = True
    for _ in range(2):
        with pytest.raises(ferry.Backend) as err:
            e.batch_unregister(addrs)
        assert "batch_unregister_memory" in str(err.value)
        assert e.registered() == sorted(regions)
        assert not any(resizable(b) for b in bufs)
    fake_wheel.fail_unregister = False
    e.batch_unregister(addrs)
    assert e.registered() == [] and all(resizable(b) for b in bufs)


def test_a_dropped_engine_leaks_what_it_could_not_unregister(fake_wheel, caplog):
    """Item 3: an engine dropped while the wheel refuses to unregister keeps
    (leaks) the holders of those regions, never releases them, and logs it
    once; the holders of regions that were unregistered are released."""
    e = ferry.Engine("mooncake-py://")
    held = [bytearray(4096) for _ in range(2)]
    for b in held:
        e.register(b)

    class Tensor:
        """An object that owns its memory (``data_ptr()`` / ``nbytes``)."""

        def __init__(self, addr):
            self.addr = addr

        def data_ptr(self):
            return self.addr

        nbytes = 4096

    backing = bytearray(8192)
    import ctypes

    base = ctypes.addressof((ctypes.c_char * len(backing)).from_buffer(backing))
    tensor = Tensor(base + 4096)
    ref = weakref.ref(tensor)
    e.register(tensor)
    del tensor
    fake_wheel.fail_unregister = True
    with caplog.at_level(logging.DEBUG, logger="ferry"):
        del e
        gc.collect()
    assert not any(resizable(b) for b in held), "released while maybe still registered"
    assert ref() is not None, "an object kept for a maybe-registered region was released"
    records = [r for r in caplog.records if "may still be registered" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].levelno == logging.WARNING
    assert "3 region(s)" in records[0].getMessage()

    # The wheel unregisters: everything is released at the drop.
    fake_wheel.fail_unregister = False
    e = ferry.Engine("mooncake-py://")
    freed = bytearray(4096)
    e.register(freed)
    del e
    gc.collect()
    assert resizable(freed)


def test_unregister_releases_only_its_own_registration():
    """Item 8: the same buffer registered again (from another thread, here
    deterministically from the hook that runs after the engine unregistered
    it and before the holder is released): the first ``unregister`` does
    not release the new registration's holder."""
    e = ferry.Engine("tcp://127.0.0.1:0")
    buf = bytearray(1 << 16)
    addr, n = e.register(buf)
    again = []
    e._set_test_hook("after_unregister", lambda: again.append(e.register(buf)))
    e.unregister(buf)
    e._set_test_hook("after_unregister", None)
    assert again == [(addr, n)]
    assert e.registered() == [(addr, n)], "the new registration lost its holder"
    assert not resizable(buf), "the re-registered buffer's export was released"
    e.unregister(buf)
    assert e.registered() == [] and resizable(buf)


def test_batch_unregister_releases_only_its_own_registrations():
    """Item 8 for ``batch_unregister``: a buffer of the batch registered
    again before the batch's holders are released keeps its new holder."""
    e = ferry.Engine("tcp://127.0.0.1:0")
    bufs = [bytearray(4096) for _ in range(2)]
    regions = e.batch_register(bufs)
    again = []
    e._set_test_hook("after_unregister", lambda: again.append(e.register(bufs[0])))
    e.batch_unregister(bufs)
    e._set_test_hook("after_unregister", None)
    assert again == [regions[0]]
    assert e.registered() == [regions[0]], "the new registration lost its holder"
    assert not resizable(bufs[0]) and resizable(bufs[1])
    e.unregister(bufs[0])
    assert e.registered() == [] and resizable(bufs[0])


def test_a_temporary_engine_passes_its_error_on():
    """An engine that is the temporary of a call that raises is dropped
    while the exception is on its way out: the caller still gets the typed
    error (not ``SystemError: error return without exception set`` from
    Python called in the drop)."""
    with pytest.raises(ferry.FerryError) as err:
        ferry.Engine("tcp://127.0.0.1:0").open_segment("127.0.0.1:1")
    assert not isinstance(err.value, SystemError)
