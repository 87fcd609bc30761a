"""Blocking calls release the GIL: another Python thread makes progress
while a long transfer is in flight."""

import threading
import time

import pytest

import ferry


def count_during(call):
    """Runs `call` while a Python thread counts; returns (count during the
    call, seconds the call took)."""
    counter = [0]
    stop = threading.Event()
    started = threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            counter[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    started.wait()
    time.sleep(0.01)
    before = counter[0]
    t0 = time.perf_counter()
    call()
    elapsed = time.perf_counter() - t0
    during = counter[0] - before
    stop.set()
    t.join()
    return during, elapsed


@pytest.mark.parametrize(
    "url,size",
    [
        # 2 ms after every 64 KiB chunk: 1 MiB takes >= 32 ms, deterministically
        ("inproc://?pace_us=2000", 1 << 20),
        # a real transport: 256 MiB over loopback TCP
        ("tcp://127.0.0.1:0", 256 << 20),
    ],
)
def test_python_thread_runs_during_a_long_transfer(url, size):
    a = ferry.Engine.open(url)
    b = ferry.Engine.open(url)
    src = bytearray(size)
    dst = bytearray(size)
    sa, _ = a.register(src)
    da, _ = b.register(dst)
    seg = a.open_segment(b.segment_name)
    src[:8] = b"gil-free"
    src[-8:] = b"end-mark"
    # Python's switch interval is 5 ms: a thread blocked behind a held GIL
    # would not count at all during the call; with it released it counts
    # freely.
    during, elapsed = count_during(lambda: a.write(seg, sa, da, size))
    assert dst[:8] == b"gil-free" and dst[-8:] == b"end-mark"
    assert elapsed > 0.02, f"the transfer took only {elapsed * 1e3:.1f} ms: not long enough to tell"
    assert during > 1000, f"the other thread counted only {during} in {elapsed * 1e3:.1f} ms"
    # batch and wait too
    during, elapsed = count_during(
        lambda: a.wait(a.submit(seg, "write", [sa], [da], [size]))
    )
    assert during > 1000, f"wait: {during} in {elapsed * 1e3:.1f} ms"
