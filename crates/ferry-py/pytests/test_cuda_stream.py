"""Mooncake's CUDA-stream methods and the module-level names of
``mooncake.engine`` on ``ferry.mooncake`` (issue 46, items 1 and 2), without
a real wheel.

A CUDA build of the Mooncake wheel cannot be installed here (no GPU): it is
played by a **test double** (``CudaWheelTestDouble``, put in ``sys.modules``
as ``mooncake.engine`` as ``test_release.py`` does with its double) that
records the calls. The real non-CUDA 0.3.13.post1 and 0.3.3 wheels are
compared in ``test_wheel.py``.
"""

import ctypes
import importlib.machinery
import sys
import types

import pytest

from ferry import mooncake as fm
from ferry.mooncake import TransferEngine

CUDA_METHODS = (
    "transfer_write_on_cuda",
    "transfer_read_on_cuda",
    "batch_transfer_write_on_cuda",
    "batch_transfer_read_on_cuda",
)


class CudaWheelTestDouble:
    """Test double of a CUDA build of ``mooncake.engine.TransferEngine``
    (not Mooncake): the calls Ferry's ``mooncake-py://`` backend makes, and
    the four CUDA-stream methods, which record their arguments."""

    calls = []

    def __init__(self):
        self.registered = {}

    def initialize(self, host, metadata, protocol, device):
        return 0

    def get_rpc_port(self):
        return 1

    def register_memory(self, addr, length):
        self.registered[addr] = length
        return 0

    def unregister_memory(self, addr):
        if self.registered.pop(addr, None) is None:
            return -3
        return 0

    def _record(self, name, *args):
        CudaWheelTestDouble.calls.append((name,) + args)

    def transfer_write_on_cuda(self, target, buffer, peer, length, stream_ptr=0, hint=""):
        self._record("transfer_write_on_cuda", target, buffer, peer, length, stream_ptr, hint)

    def transfer_read_on_cuda(self, target, buffer, peer, length, stream_ptr=0, hint=""):
        self._record("transfer_read_on_cuda", target, buffer, peer, length, stream_ptr, hint)

    def batch_transfer_write_on_cuda(self, target, bufs, peers, lens, stream_ptr=0, hint=""):
        self._record("batch_transfer_write_on_cuda", target, bufs, peers, lens, stream_ptr, hint)

    def batch_transfer_read_on_cuda(self, target, bufs, peers, lens, stream_ptr=0, hint=""):
        self._record("batch_transfer_read_on_cuda", target, bufs, peers, lens, stream_ptr, hint)


#: The same double as a build without CUDA: no CUDA-stream methods.
NonCudaWheelTestDouble = type(
    "NonCudaWheelTestDouble",
    (),
    {
        k: v
        for k, v in vars(CudaWheelTestDouble).items()
        if k not in CUDA_METHODS and k not in ("__dict__", "__weakref__")
    },
)


def rpc_client_test_double():
    """Stands for the wheel's ``create_rpc_client`` (identity is compared)."""


def install_double(monkeypatch, cls, cuda):
    package = types.ModuleType("mooncake")
    engine = types.ModuleType("mooncake.engine")
    # A spec, so that importlib.util.find_spec sees a wheel installed.
    engine.__spec__ = importlib.machinery.ModuleSpec("mooncake.engine", None)
    engine.TransferEngine = cls
    engine.SUPPORT_CUDA = cuda
    engine.SUPPORT_EFA = False
    engine.create_rpc_client = rpc_client_test_double
    package.engine = engine
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)
    monkeypatch.setattr(CudaWheelTestDouble, "calls", [])
    return engine


@pytest.fixture
def cuda_wheel(monkeypatch):
    """``mooncake.engine`` is the CUDA test double for this test only; the
    CUDA runtime's ``cudaStreamSynchronize`` is recorded, not called."""
    synced = []
    monkeypatch.setattr(fm, "_synchronize_cuda_stream", synced.append)
    install_double(monkeypatch, CudaWheelTestDouble, True)
    return synced


@pytest.fixture
def non_cuda_wheel(monkeypatch):
    install_double(monkeypatch, NonCudaWheelTestDouble, False)


def started(url="mooncake-py://"):
    te = TransferEngine(url)
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, te.last_error()
    return te


def test_cuda_stream_methods_are_forwarded_to_a_cuda_wheel(cuda_wheel):
    te = started()
    for name in CUDA_METHODS:
        assert hasattr(te, name) and hasattr(TransferEngine("mooncake-py://"), name)
    a, b = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(4096)
    pa, pb = ctypes.addressof(a), ctypes.addressof(b)
    assert te.register_memory(pa, 4096) == 0 and te.register_memory(pb, 4096) == 0
    assert te.transfer_write_on_cuda("peer:1", pa, 0x1000, 64, 0xABC) is None
    te.transfer_read_on_cuda("peer:1", pa, 0x2000, 32, stream_ptr=0xDEF, transport_hint="rdma")
    te.transfer_write_on_cuda("peer:1", pa, 0x3000, 16)
    te.batch_transfer_write_on_cuda("peer:1", [pa, pb], [0x10, 0x20], [8, 8], 0x77)
    te.batch_transfer_read_on_cuda("peer:1", [pb], [0x30], [4], stream_ptr=0x78)
    assert CudaWheelTestDouble.calls == [
        ("transfer_write_on_cuda", "peer:1", pa, 0x1000, 64, 0xABC, ""),
        ("transfer_read_on_cuda", "peer:1", pa, 0x2000, 32, 0xDEF, "rdma"),
        ("transfer_write_on_cuda", "peer:1", pa, 0x3000, 16, 0, ""),
        ("batch_transfer_write_on_cuda", "peer:1", [pa, pb], [0x10, 0x20], [8, 8], 0x77, ""),
        ("batch_transfer_read_on_cuda", "peer:1", [pb], [0x30], [4], 0x78, ""),
    ]
    # Unregister waits for every stream a transfer was queued on first, so
    # no byte of the region changes once it returns.
    assert cuda_wheel == []
    assert te.unregister_memory(pa) == 0
    assert sorted(cuda_wheel) == [0, 0x77, 0x78, 0xABC, 0xDEF]
    assert te.unregister_memory(pb) == 0
    assert len(cuda_wheel) == 5, "nothing queued since: no second wait"


def test_a_cuda_stream_transfer_from_unregistered_memory_is_refused(cuda_wheel):
    te = started()
    with pytest.raises(fm.AddressNotRegistered):
        te.transfer_write_on_cuda("peer:1", 0x1000, 0x2000, 64, 0xABC)
    assert isinstance(te.last_error(), fm.AddressNotRegistered)
    assert CudaWheelTestDouble.calls == []
    assert cuda_wheel == [] and te.unregister_memory(0x1000) == -1
    assert cuda_wheel == [], "a refused transfer queued nothing to wait for"


def test_an_unregister_whose_stream_cannot_be_waited_for_is_refused(cuda_wheel, monkeypatch):
    te = started()
    a = ctypes.create_string_buffer(4096)
    pa = ctypes.addressof(a)
    assert te.register_memory(pa, 4096) == 0
    te.transfer_write_on_cuda("peer:1", pa, 0x1000, 64, 0xABC)

    def no_runtime(stream):
        raise OSError("no CUDA runtime (test)")

    monkeypatch.setattr(fm, "_synchronize_cuda_stream", no_runtime)
    assert te.unregister_memory(pa) == -1
    assert "no CUDA runtime" in str(te.last_error())
    assert te.ferry_engine().registered() == [(pa, 4096)], "the region stays registered"
    monkeypatch.setattr(fm, "_synchronize_cuda_stream", lambda s: None)
    assert te.unregister_memory(pa) == 0


def test_cuda_stream_methods_are_absent_without_cuda(non_cuda_wheel, monkeypatch):
    """``hasattr`` tells the truth: a non-CUDA wheel, Ferry's own backends,
    and no wheel at all (as on a non-CUDA Mooncake build)."""
    for name in CUDA_METHODS:
        assert not hasattr(TransferEngine, name)
        assert not hasattr(TransferEngine("mooncake-py://"), name)
        assert not hasattr(started(), name)
    monkeypatch.setattr(fm, "_wheel_present", lambda: False)
    for name in CUDA_METHODS:
        assert not hasattr(TransferEngine, name)
        assert not hasattr(TransferEngine("tcp://"), name)


def test_tcp_backend_has_no_cuda_stream_methods_beside_a_cuda_wheel(cuda_wheel):
    te = started("tcp://")
    for name in CUDA_METHODS:
        assert not hasattr(te, name)
        assert not hasattr(TransferEngine("tcp://"), name)


def test_module_names_mirror_the_installed_wheel(cuda_wheel):
    wheel = sys.modules["mooncake.engine"]
    from ferry.mooncake import SUPPORT_CUDA, SUPPORT_EFA, create_rpc_client

    assert SUPPORT_CUDA is True and SUPPORT_EFA is False
    assert create_rpc_client is wheel.create_rpc_client
    assert {"SUPPORT_CUDA", "create_rpc_client"} <= set(dir(fm))
    # A name this wheel does not have stays absent, as on the wheel.
    with pytest.raises(ImportError):
        from ferry.mooncake import SUPPORT_MUSA  # noqa: F401


def test_module_names_without_a_wheel(monkeypatch):
    monkeypatch.setattr(fm, "_wheel_present", lambda: False)
    for flag in ("SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK",
                 "SUPPORT_MNNVL", "SUPPORT_MUSA"):
        assert getattr(fm, flag) is False, flag
        assert flag in dir(fm)
    for name in ("InnerTransferEngine", "SharedSegment", "RpcInterface", "CoroRPCInterface",
                 "ReceivedData", "ReceivedTensor", "create_rpc_client", "create_rpc_server"):
        assert not hasattr(fm, name), name


def test_the_shim_keeps_the_cuda_stream_methods_and_every_name(cuda_wheel):
    """With the shim active, ``mooncake.engine.TransferEngine`` is Ferry's
    and answers ``hasattr`` as the wheel's class did; the module's other
    names are the wheel's, untouched."""
    wheel = sys.modules["mooncake.engine"]
    before = {n: getattr(wheel, n) for n in dir(wheel) if not n.startswith("_")}
    fm.install()
    try:
        shimmed = wheel.TransferEngine
        assert shimmed._ferry_wheel_class is CudaWheelTestDouble
        for name in CUDA_METHODS:
            assert hasattr(shimmed, name) and hasattr(shimmed(), name)
        for name, value in before.items():
            if name != "TransferEngine":
                assert getattr(wheel, name) is value, name
    finally:
        fm.uninstall()
    assert wheel.TransferEngine is CudaWheelTestDouble
