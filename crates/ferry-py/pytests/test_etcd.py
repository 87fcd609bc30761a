"""``ferry.mooncake`` in Mooncake's etcd mode on ``tcp://``, against a real
etcd (Debian's ``etcd-server``) started here on free loopback ports with
its own data directory.

- Two Ferry engines that know each other only by the ``local_hostname``
  they passed to ``initialize`` make SGLang's calls.
- With the real Mooncake wheel (the runs of tests/pytest.rs in the wheels'
  venvs, ``FERRY_TEST_WHEEL``): a Mooncake node registers in the same etcd
  under the same name as a Ferry node; neither touches the other's keys
  and both keep moving bytes.

Skipped with the reason where etcd is not installed or the wheel was built
without the ``etcd`` feature (no ``protoc`` at build time); a failure
instead when ``FERRY_REQUIRE_BACKENDS`` lists ``etcd``.
"""

import base64
import ctypes
import gc
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

import ferry
from conftest import unavailable
from ferry.mooncake import TransferEngine

N, S = 16, 16 << 10


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """One etcd member on loopback, killed and its directory removed at
    :meth:`stop`."""

    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="ferry-etcd-")
        self.port = _free_port()
        peer = f"http://127.0.0.1:{_free_port()}"
        client = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(self.dir, "etcd.log"), "wb")
        self.proc = subprocess.Popen(
            [binary, "--name", "t", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}"],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.load(r).get("health") == "true":
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"etcd did not come up: {self.read_log()}")
            time.sleep(0.1)

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.port}"

    def read_log(self):
        with open(os.path.join(self.dir, "etcd.log"), "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def keys(self):
        """Every key with its value (bytes) and lease, through etcd's v3
        HTTP gateway (``/v3/kv/range`` over the whole key space)."""
        body = json.dumps({"key": "AA==", "range_end": "AA=="}).encode()
        req = urllib.request.Request(f"http://{self.endpoint}/v3/kv/range", data=body)
        with urllib.request.urlopen(req, timeout=5) as r:
            kvs = json.load(r).get("kvs", [])
        return {
            base64.b64decode(kv["key"]).decode(): (
                base64.b64decode(kv.get("value", "")),
                int(kv.get("lease", 0)),
            )
            for kv in kvs
        }

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd():
    binary = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.isfile("/usr/bin/etcd") else None)
    if not getattr(ferry._native, "_ETCD", False):
        unavailable(
            "etcd",
            "this wheel was built without the `etcd` feature (tests/pytest.rs adds it "
            "only where protoc compiles protobuf's well-known types: apt-get install "
            "protobuf-compiler libprotobuf-dev)",
        )
    if binary is None:
        unavailable("etcd", "etcd is not installed (apt-get install etcd-server)")
    e = Etcd(binary)
    yield e
    e.stop()


def address(buf):
    return ctypes.addressof(buf)


def landed(dst, expected, deadline_s=10.0):
    """Whether ``dst`` holds ``expected``, polled: Mooncake 0.3.3 reports a
    TCP write done before it landed (test_wheel.py: ``landed_writes: no``).
    The bound only ends a wait for bytes that never come."""
    end = time.monotonic() + deadline_s
    while dst.raw != expected:
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def started(etcd, name, url="tcp://127.0.0.1:0"):
    te = TransferEngine(url)
    assert te.initialize(name, f"etcd://{etcd.endpoint}", "tcp", "") == 0, te.last_error()
    return te


def gone(etcd, *names):
    """After the caller dropped its engines (what a serving process does:
    Mooncake's API has no shutdown), waits until their keys left etcd:
    dropping an engine revokes its lease in the background. The bound only
    ends a wait for a key that never goes; it is not a timing assertion."""
    names = [f"/ferry/segments/{n}" for n in names]
    gc.collect()
    deadline = time.monotonic() + 10
    while any(n in etcd.keys() for n in names):
        assert time.monotonic() < deadline, f"still in etcd after the drop: {names}"
        time.sleep(0.05)


def ferry_key(etcd, name):
    value, lease = etcd.keys()[f"/ferry/segments/{name}"]
    return json.loads(value), lease


def test_etcd_mode_fails_loudly_where_it_cannot_run(caplog):
    """No etcd at the address, or a wheel built without the feature: -1,
    logged, and a typed error saying which (never a silent -1)."""
    te = TransferEngine("tcp://127.0.0.1:0")
    assert te.initialize("n-0", f"etcd://127.0.0.1:{_free_port()}", "tcp", "") == -1
    err = te.last_error()
    assert isinstance(err, ferry.Unavailable) and err.backend == "etcd", repr(err)
    if not ferry._native._ETCD:
        assert "wheel was built without etcd support" in str(err)
    assert any(r.levelname == "WARNING" and "initialize" in r.message for r in caplog.records)
    # Mooncake's other metadata servers stay refused on tcp://.
    assert te.initialize("n-0", "redis://127.0.0.1:6379", "tcp", "") == -1
    assert isinstance(te.last_error(), ValueError)
    assert "P2PHANDSHAKE or etcd only" in str(te.last_error())


def test_two_engines_by_name_sglang_sequence(etcd):
    """initialize in etcd mode, batch_register_memory / register_memory,
    transfer_sync_write / read and a batch_transfer_sync_write, each peer
    named by the local_hostname it passed, then unregister."""
    prefill = started(etcd, "prefill-0")
    decode = started(etcd, "decode-0")
    # The segment name is published under Ferry's key with this engine's
    # address (its rpc port).
    desc, lease = ferry_key(etcd, "decode-0")
    assert desc["name"] == "decode-0" and lease != 0
    assert desc["addresses"] == [f"127.0.0.1:{decode.get_rpc_port()}"]
    assert decode.get_rpc_port() > 0
    assert decode.ferry_engine().segment_name == desc["addresses"][0]

    src = [ctypes.create_string_buffer(bytes([i + 1]) * S, S) for i in range(N)]
    dst = [ctypes.create_string_buffer(S) for _ in range(N)]
    back = ctypes.create_string_buffer(S)
    assert prefill.batch_register_memory([address(b) for b in src], [S] * N) == 0
    assert prefill.register_memory(address(back), S) == 0
    assert decode.batch_register_memory([address(b) for b in dst], [S] * N) == 0

    assert prefill.transfer_sync_write("decode-0", address(src[0]), address(dst[1]), S) == 0
    assert dst[1].raw == src[0].raw
    assert prefill.transfer_sync_read("decode-0", address(back), address(dst[1]), S) == 0
    assert back.raw == src[0].raw
    ret = prefill.batch_transfer_sync_write(
        "decode-0", [address(b) for b in src], [address(b) for b in dst], [S] * N
    )
    assert ret == 0, prefill.last_error()
    assert [i for i in range(N) if dst[i].raw != src[i].raw] == []
    # The other way round, by the other name.
    assert decode.transfer_sync_write("prefill-0", address(dst[2]), address(back), S) == 0
    assert back.raw == src[2].raw
    # A name nobody published: a typed error, not a hang.
    assert prefill.transfer_sync_write("decode-9", address(src[0]), address(dst[0]), 16) == -1
    assert isinstance(prefill.last_error(), ferry.SegmentUnavailable), prefill.last_error()

    assert decode.batch_unregister_memory([address(b) for b in dst]) == 0
    assert prefill.batch_unregister_memory([address(b) for b in src]) == 0
    assert prefill.unregister_memory(address(back)) == 0
    assert prefill.transfer_sync_write("decode-0", address(src[0]), address(dst[0]), 16) == -1
    del prefill, decode
    gone(etcd, "prefill-0", "decode-0")


def test_host_port_name_is_the_address(etcd):
    """A ``host:port`` local_hostname: the engine listens there and is
    published under that name; peers open it directly."""
    port = _free_port()
    name = f"127.0.0.1:{port}"
    target = started(etcd, name, url="tcp://")
    assert target.get_rpc_port() == port
    desc, _ = ferry_key(etcd, name)
    assert desc["addresses"] == [name]
    peer = started(etcd, "peer-hp")
    src = ctypes.create_string_buffer(b"h" * 4096, 4096)
    dst = ctypes.create_string_buffer(4096)
    assert peer.register_memory(address(src), 4096) == 0
    assert target.register_memory(address(dst), 4096) == 0
    assert peer.transfer_sync_write(name, address(src), address(dst), 4096) == 0
    assert dst.raw == src.raw
    assert target.unregister_memory(address(dst)) == 0
    del target, peer
    gone(etcd, name, "peer-hp")


def test_ip_name_and_sglang_session_id(etcd):
    """SGLang's shape: ``initialize(<ip>, …)`` with no address in the URL
    listens on that ip (a free port) and publishes the ip as the name; the
    peer reaches it by the name (through etcd) and by SGLang's session id
    ``f"{hostname}:{get_rpc_port()}"`` (directly)."""
    target = started(etcd, "127.0.0.1", url="tcp://")
    port = target.get_rpc_port()
    assert ferry_key(etcd, "127.0.0.1")[0]["addresses"] == [f"127.0.0.1:{port}"]
    peer = started(etcd, "peer-ip")
    src = ctypes.create_string_buffer(b"s" * 4096, 4096)
    dst = ctypes.create_string_buffer(4096)
    assert peer.register_memory(address(src), 4096) == 0
    assert target.register_memory(address(dst), 4096) == 0
    for session in ("127.0.0.1", f"127.0.0.1:{port}"):
        ctypes.memset(dst, 0, 4096)
        assert peer.transfer_sync_write(session, address(src), address(dst), 4096) == 0
        assert dst.raw == src.raw, session
    assert target.unregister_memory(address(dst)) == 0
    del target, peer
    gone(etcd, "127.0.0.1", "peer-ip")


def test_one_name_two_engines(etcd):
    """Two engines initialized with one local_hostname: the second gets -1
    with InvalidArgument naming it (Mooncake would overwrite silently)."""
    first = started(etcd, "twin")
    second = TransferEngine("tcp://127.0.0.1:0")
    assert second.initialize("twin", f"etcd://{etcd.endpoint}", "tcp", "") == -1
    assert isinstance(second.last_error(), ferry.InvalidArgument), second.last_error()
    assert "twin" in str(second.last_error())
    del first
    gone(etcd, "twin")


def test_mooncake_wheel_node_beside_ferry(etcd):
    """The real Mooncake wheel in etcd mode and Ferry nodes on one etcd,
    one Ferry node under the Mooncake node's own name: Mooncake's keys
    (``mooncake/…``) and Ferry's (``/ferry/segments/…``) are disjoint, the
    Mooncake keys stay byte for byte what Mooncake wrote while Ferry
    publishes, transfers and leaves, and both keep moving bytes."""
    if not os.environ.get("FERRY_TEST_WHEEL"):
        pytest.skip(
            "needs the real Mooncake wheel: tests/pytest.rs runs this in the wheels' venvs "
            "(FERRY_TEST_WHEEL)"
        )
    from mooncake.engine import TransferEngine as MooncakeEngine

    name = "node-0"
    mc = MooncakeEngine()
    assert mc.initialize(name, f"etcd://{etcd.endpoint}", "tcp", "") == 0
    mc_src = ctypes.create_string_buffer(b"m" * 4096, 4096)
    mc_dst = ctypes.create_string_buffer(4096)
    assert mc.register_memory(address(mc_src), 4096) == 0
    assert mc.register_memory(address(mc_dst), 4096) == 0
    mooncake_keys = etcd.keys()
    # Mooncake's layout (no lease: they outlive a node that dies).
    assert sorted(mooncake_keys) == ["mooncake/ram/node-0", "mooncake/rpc_meta/node-0"]
    assert json.loads(mooncake_keys["mooncake/ram/node-0"][0])["name"] == name

    # Ferry nodes: one under the Mooncake node's own name.
    same = started(etcd, name)
    other = started(etcd, "node-1")
    keys = etcd.keys()
    ferry_keys = sorted(k for k in keys if k not in mooncake_keys)
    assert ferry_keys == ["/ferry/segments/node-0", "/ferry/segments/node-1"]
    assert json.loads(keys["/ferry/segments/node-0"][0])["name"] == name
    assert {k: keys[k] for k in mooncake_keys} == mooncake_keys

    src = ctypes.create_string_buffer(b"f" * 4096, 4096)
    dst = ctypes.create_string_buffer(4096)
    assert other.register_memory(address(src), 4096) == 0
    assert same.register_memory(address(dst), 4096) == 0
    # Ferry's node-0 is Ferry's (its key), not the Mooncake node.
    assert other.transfer_sync_write(name, address(src), address(dst), 4096) == 0
    assert dst.raw == src.raw
    # Mooncake's node-0 is Mooncake's (its keys), read back by the wheel.
    assert mc.transfer_sync_write(name, address(mc_src), address(mc_dst), 4096) == 0
    assert landed(mc_dst, mc_src.raw)
    assert same.unregister_memory(address(dst)) == 0
    assert other.unregister_memory(address(src)) == 0
    del same, other
    gone(etcd, name, "node-1")

    # Ferry left: its keys are gone, Mooncake's untouched, Mooncake works.
    keys = etcd.keys()
    assert not [k for k in keys if k.startswith("/ferry/")], sorted(keys)
    assert {k: keys.get(k) for k in mooncake_keys} == mooncake_keys
    ctypes.memset(mc_dst, 0, 4096)
    assert mc.transfer_sync_write(name, address(mc_src), address(mc_dst), 4096) == 0
    assert landed(mc_dst, mc_src.raw)
    assert mc.unregister_memory(address(mc_src)) == 0
    assert mc.unregister_memory(address(mc_dst)) == 0
