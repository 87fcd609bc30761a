"""Fixtures for ferry's pytest suite.

The Rust test driver (crates/ferry-py/tests/pytest.rs) sets:

- ``FERRY_TEST_MOONCAKE_OLD``: the v0.2.0 Mooncake test library (oldest
  supported C API: needs a metadata server, has no notification calls);
- ``FERRY_TEST_MOONCAKE_CURRENT``: the current (v0.3.12) test library;
- ``FERRY_TEST_FERRY_BIN``: the ``ferry`` binary (``ferry serve`` is the Rust
  peer of the interop tests).

A backend whose library is not given is skipped with the reason, unless
``FERRY_REQUIRE_BACKENDS`` lists it (then the test fails).
"""

import ctypes
import os
import random
import socket
import tempfile

import pytest

import ferry

REQUIRED = {
    b.strip() for b in os.environ.get("FERRY_REQUIRE_BACKENDS", "").split(",") if b.strip()
}


def unavailable(backend, reason):
    """Skip, or fail when the backend is required."""
    if backend in REQUIRED:
        pytest.fail(f"{backend} is required (FERRY_REQUIRE_BACKENDS) but {reason}")
    pytest.skip(f"{backend} unavailable: {reason}")


def lib(var, backend):
    path = os.environ.get(var)
    if not path:
        unavailable(backend, f"{var} is not set")
    if not os.path.exists(path):
        unavailable(backend, f"{var}={path} does not exist")
    return path


class Backend:
    """How to open engines of one backend (and their Mooncake-API flavour)."""

    def __init__(self, name, base, p2p, notify, emulated, metadata=None):
        self.name = name
        self.base = base  # URL the native API opens
        self.p2p = p2p  # the native API's segment name is host:port
        self.notify = notify  # notifications available
        self.emulated = emulated  # batch methods emulated by the adapter
        self.metadata = metadata  # metadata server string for initialize()

    def url(self):
        if self.name == "mooncake-v0.2.0":
            return self.base + f"&port={free_port()}"
        return self.base

    def hostname(self):
        """``local_hostname`` for the Mooncake API's initialize()."""
        if self.name == "mooncake-v0.2.0":
            return f"127.0.0.1:{free_port()}"
        return "127.0.0.1"

    def compat_url(self):
        """Base URL for ferry.mooncake.TransferEngine(url)."""
        if self.name == "tcp":
            return "tcp://"
        return self.base.split("&metadata=")[0] if self.name.startswith("mooncake") else self.base

    def __repr__(self):
        return self.name


BACKEND_NAMES = ["tcp", "inproc-emulated", "mooncake-v0.2.0", "mooncake-current"]


def make_backend(name, tmp_path_factory):
    if name == "tcp":
        return Backend("tcp", "tcp://127.0.0.1:0", p2p=True, notify=True, emulated=False)
    if name == "inproc-emulated":
        # No native batch calls at all: every batch method is the adapter's
        # emulation (what a Mooncake build without them gets).
        return Backend(
            "inproc-emulated", "inproc://?caps=none", p2p=False, notify=False, emulated=True
        )
    if name == "mooncake-v0.2.0":
        path = lib("FERRY_TEST_MOONCAKE_OLD", "mooncake")
        meta = "file://" + str(tmp_path_factory.mktemp("mooncake-meta"))
        return Backend(
            "mooncake-v0.2.0",
            f"mooncake://?lib={path}&metadata={meta}&protocol=tcp&host=127.0.0.1",
            p2p=False,
            notify=False,
            emulated=False,
            metadata=meta,
        )
    if name == "mooncake-current":
        path = lib("FERRY_TEST_MOONCAKE_CURRENT", "mooncake")
        return Backend(
            "mooncake-current",
            f"mooncake://?lib={path}&metadata=P2PHANDSHAKE&protocol=tcp&host=127.0.0.1",
            p2p=True,
            notify=True,
            emulated=False,
            metadata="P2PHANDSHAKE",
        )
    raise ValueError(name)


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, tmp_path_factory):
    return make_backend(request.param, tmp_path_factory)


@pytest.fixture
def pair(backend):
    """Two engines of one backend: (initiator, target)."""
    a = ferry.Engine.open(backend.url())
    b = ferry.Engine.open(backend.url())
    yield a, b


def free_port():
    """A port for v0.2.0-era engines, which bind the IPv4 wildcard address
    and abort the process when it is taken (as real builds do): one below the
    kernel's ephemeral range (where no client socket of this process can be
    given it meanwhile) that the wildcard address can bind now."""
    for _ in range(1000):
        port = random.randint(20000, 29999)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-29999")


def address(buf):
    """Address of a writable buffer (bytearray) via ctypes."""
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def pattern(n, seed=1):
    return bytes((i * 31 + seed * 7) & 0xFF for i in range(n))


@pytest.fixture
def tmpdir_path():
    with tempfile.TemporaryDirectory() as d:
        yield d
