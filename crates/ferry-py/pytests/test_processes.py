"""Across processes: a prefill → decode hand-off in Python with a
notification, and interop with a Rust engine (`ferry serve`)."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import ferry
from ferry.mooncake import TransferEngine, TransferNotify, Write
from conftest import address, pattern

LAYERS, BLOCKS, BLOCK = 4, 32, 16 * 1024

DECODE = textwrap.dedent(
    """
    import hashlib, json, sys, time, ctypes
    from ferry.mooncake import TransferEngine
    url, metadata = sys.argv[1], sys.argv[2]
    layers, blocks, block = map(int, sys.argv[3:6])
    te = TransferEngine(url)
    assert te.initialize("127.0.0.1", metadata, "tcp", "") == 0, te.last_error()
    kv = [bytearray(blocks * block) for _ in range(layers)]
    addrs = [ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b)) for b in kv]
    assert te.batch_register_memory(addrs, [len(b) for b in kv]) == 0, te.last_error()
    print(json.dumps({"session": te.get_engine().segment_name, "addrs": addrs}), flush=True)
    deadline = time.time() + 60
    notes = []
    while not notes and time.time() < deadline:
        notes = te.get_notifies()
        time.sleep(0.001)
    if not notes:
        print(json.dumps({"error": "no notification"}), flush=True)
        sys.exit(2)
    # The notification comes after the bytes: hash what is there now.
    digest = hashlib.sha256(b"".join(bytes(b) for b in kv)).hexdigest()
    print(json.dumps({"note": [notes[0].name, notes[0].msg], "sha256": digest}), flush=True)
    assert te.batch_unregister_memory(addrs) == 0
    """
)


@pytest.mark.parametrize("name", ["tcp", "mooncake-current"])
def test_prefill_to_decode_handoff(name, tmp_path_factory):
    from conftest import make_backend

    backend = make_backend(name, tmp_path_factory)
    url = "tcp://" if name == "tcp" else backend.compat_url()
    metadata = backend.metadata or "P2PHANDSHAKE"
    decode = subprocess.Popen(
        [sys.executable, "-c", DECODE, url, metadata, str(LAYERS), str(BLOCKS), str(BLOCK)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = decode.stdout.readline()
        assert line, decode.stderr.read()
        info = json.loads(line)
        # Prefill: its own KV blocks, written layer by layer into the decode
        # side's blocks in a scattered order, one batch with a notification.
        prefill = TransferEngine(url)
        assert prefill.initialize("127.0.0.1", metadata, "tcp", "") == 0, prefill.last_error()
        src = [bytearray(pattern(BLOCKS * BLOCK, seed=l + 1)) for l in range(LAYERS)]
        src_addrs = [address(b) for b in src]
        assert prefill.batch_register_memory(src_addrs, [len(b) for b in src]) == 0
        order = [(i * 7) % BLOCKS for i in range(BLOCKS)]  # decode block for prefill block i
        bufs, peers, lens = [], [], []
        for l in range(LAYERS):
            for i, j in enumerate(order):
                bufs.append(src_addrs[l] + i * BLOCK)
                peers.append(info["addrs"][l] + j * BLOCK)
                lens.append(BLOCK)
        note = TransferNotify("prefill-0", "room 7 done")
        ret = prefill.batch_transfer_sync(info["session"], bufs, peers, lens, Write, note)
        assert ret == 0, prefill.last_error()
        out = json.loads(decode.stdout.readline())
        assert out.get("note") == ["prefill-0", "room 7 done"], out
        expected = bytearray()
        for l in range(LAYERS):
            dst = bytearray(BLOCKS * BLOCK)
            for i, j in enumerate(order):
                dst[j * BLOCK : (j + 1) * BLOCK] = src[l][i * BLOCK : (i + 1) * BLOCK]
            expected += dst
        assert out["sha256"] == hashlib.sha256(bytes(expected)).hexdigest()
        assert decode.wait(timeout=30) == 0, decode.stderr.read()
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()


def ferry_bin():
    path = os.environ.get("FERRY_TEST_FERRY_BIN")
    if not path or not os.path.exists(path):
        from conftest import unavailable

        unavailable("tcp", f"FERRY_TEST_FERRY_BIN={path!r} is not the ferry binary")
    return path


def test_interop_with_rust_ferry_serve():
    """A Python engine reads and writes the region of a Rust engine (`ferry
    serve`, another process) and notifies it; the Rust side reports exactly
    the bytes the Python side changed."""
    serve = subprocess.Popen(
        [ferry_bin(), "serve", "--size", "1MiB", "--raw-listen", "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        segment = addr = length = None
        lines = []
        while segment is None or addr is None:
            line = serve.stdout.readline()
            assert line, "ferry serve exited: " + serve.stderr.read()
            lines.append(line)
            m = re.search(r"segment (\S+)", line)
            if m:
                segment = m.group(1)
            m = re.search(r"region: addr (0x[0-9a-f]+) len (\d+)", line)
            if m:
                addr, length = int(m.group(1), 16), int(m.group(2))
        assert length == 1 << 20
        e = ferry.Engine.open("tcp://127.0.0.1:0")
        local = bytearray(length)
        la, _ = e.register(local)
        seg = e.open_segment(segment)
        # Read the Rust side's initial pattern, write its complement over
        # the first 256 KiB (every byte changes), read it back.
        e.read(seg, la, addr, length)
        initial = bytes(local)
        assert len(set(initial)) > 1, "serve fills its region with a pattern"
        changed = 256 * 1024
        comp = bytes(255 - b for b in initial[:changed])
        local[:changed] = comp
        results = e.batch_transfer(
            seg, "write", [la + i * 4096 for i in range(changed // 4096)],
            [addr + i * 4096 for i in range(changed // 4096)], [4096] * (changed // 4096),
            notify=("python", "write bytes=262144"),
        )
        assert results == [None] * (changed // 4096)
        check = bytearray(length)
        e.register(check)
        e.read(seg, address(check), addr, length)
        assert bytes(check) == comp + initial[changed:]
        # serve prints the notification, then on SIGTERM its summary
        deadline = time.time() + 10
        seen = False
        while not seen and time.time() < deadline:
            line = serve.stdout.readline()
            lines.append(line)
            seen = "notification from python: write bytes=262144" in line
        assert seen, "".join(lines)
        serve.send_signal(signal.SIGTERM)
        out, err = serve.communicate(timeout=30)
        assert serve.returncode == 0, err
        m = re.search(r"region: (\d+) of (\d+) bytes differ", out)
        assert m, out
        assert int(m.group(1)) == changed and int(m.group(2)) == length
        m = re.search(r"received: (\d+) notifications; peers reported (\S+ \S+) written", out)
        assert m and m.group(1) == "1", out
        assert m.group(2) != "0 B", out  # serve parsed bytes= from our notification
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
