"""``python -m ferry.bench``: ferry.mooncake.TransferEngine against
mooncake.engine.TransferEngine, both over TCP on loopback, in one run.

Each API gets the same treatment: a target process (``--serve``) registers a
64 MiB region; this process registers its own 64 MiB and writes into the
target through the API's Python methods, cycling through the span:

- single 4 KiB writes (``transfer_sync_write``), transfers/s;
- 4 KiB x 256 batches (``batch_transfer_sync_write``), transfers/s;
- 64 KiB x 128 batches, GB/s;
- single 1 MiB writes, GB/s.

For Ferry the same points are also run by the Rust engine itself, looping in
Rust on the same engines (``Engine._bench_loop``): the ratio is the cost of
the Python call. Mooncake comes from the ``mooncake-transfer-engine-non-cuda``
wheel (``pip install mooncake-transfer-engine-non-cuda``); without it only
Ferry is measured. ``--json`` prints the figures as JSON.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

SPAN = 64 << 20
POINTS = [
    # name, block, batch, unit
    ("4KiB x1", 4096, 1, "ops"),
    ("4KiB x256", 4096, 256, "ops"),
    ("64KiB x128", 64 << 10, 128, "gbps"),
    ("1MiB x1", 1 << 20, 1, "gbps"),
]


def _engine_class(api):
    if api == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from ferry.mooncake import TransferEngine
    return TransferEngine


def _start(api):
    te = _engine_class(api)()
    ret = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if ret != 0:
        raise RuntimeError(f"{api}: initialize returned {ret}")
    buf = ctypes.create_string_buffer(SPAN)
    addr = ctypes.addressof(buf)
    ret = te.register_memory(addr, SPAN)
    if ret != 0:
        raise RuntimeError(f"{api}: register_memory returned {ret}")
    return te, buf, addr


def serve(api):
    """Target process: register a region, print where it is, wait for stdin
    to close."""
    te, buf, addr = _start(api)
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr}), flush=True)
    sys.stdin.read()
    te.unregister_memory(addr)


def _offsets(block, batch, i):
    """Local and remote offsets of iteration i: cycle through the span."""
    size = block * batch
    slots = SPAN // size
    base = (i % slots) * size
    return [base + k * block for k in range(batch)]


def _run_python(te, session, local, remote, block, batch, duration):
    n = 0
    moved = 0
    deadline = time.perf_counter() + duration
    t0 = time.perf_counter()
    while True:
        offs = _offsets(block, batch, n)
        if batch == 1:
            ret = te.transfer_sync_write(session, local + offs[0], remote + offs[0], block)
        else:
            ret = te.batch_transfer_sync_write(
                session, [local + o for o in offs], [remote + o for o in offs], [block] * batch
            )
        if ret != 0:
            raise RuntimeError(f"transfer failed: {ret}")
        n += 1
        moved += block * batch
        if n % 4 == 0 and time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - t0
    return n * batch / elapsed, moved / elapsed / 1e9


def _run_rust(te, session, local, remote, block, batch, duration):
    engine = te.get_engine()
    seg = te._segment(session)
    offs = list(range(0, block * batch, block))
    # calibrate, then run for about `duration`
    iters = 8
    while True:
        secs = engine._bench_loop(
            seg, "write", [local + o for o in offs], [remote + o for o in offs],
            [block] * batch, iters, SPAN,
        )
        if secs >= duration / 4 or iters >= 1 << 22:
            break
        iters *= 4
    iters = max(1, int(iters * duration / max(secs, 1e-9)))
    secs = engine._bench_loop(
        seg, "write", [local + o for o in offs], [remote + o for o in offs],
        [block] * batch, iters, SPAN,
    )
    moved = iters * block * batch
    return iters * batch / secs, moved / secs / 1e9


def measure(api, duration, rust=False):
    """Figures for one API: {point: {"ops": transfers/s, "gbps": GB/s}}."""
    server = subprocess.Popen(
        [sys.executable, "-m", "ferry.bench", "--serve", api],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"{api} target exited: {server.wait()}")
        info = json.loads(line)
        te, buf, local = _start(api)
        session, remote = info["session"], info["addr"]
        out = {}
        for name, block, batch, _ in POINTS:
            _run_python(te, session, local, remote, block, batch, 0.2)  # warm-up
            ops, gbps = _run_python(te, session, local, remote, block, batch, duration)
            out[name] = {"ops": ops, "gbps": gbps}
            if rust:
                ops, gbps = _run_rust(te, session, local, remote, block, batch, duration)
                out[name + " (Rust)"] = {"ops": ops, "gbps": gbps}
        te.unregister_memory(local)
        return out
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def _fmt(v, unit):
    return f"{v['ops'] / 1e3:8.1f}k/s" if unit == "ops" else f"{v['gbps']:7.2f} GB/s"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ferry.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=2.0, help="seconds per point and API")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--serve", choices=["ferry", "mooncake"], help=argparse.SUPPRESS)
    p.add_argument("--no-mooncake", action="store_true", help="measure Ferry only")
    args = p.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    results = {"ferry": measure("ferry", args.duration, rust=True)}
    mooncake_error = None
    if not args.no_mooncake:
        try:
            import mooncake.engine  # noqa: F401

            results["mooncake"] = measure("mooncake", args.duration)
        except ImportError as e:
            mooncake_error = f"mooncake.engine is not installed ({e})"
    if args.json:
        print(json.dumps({"results": results, "mooncake_error": mooncake_error}, indent=2))
        return 0
    print(f"python -m ferry.bench: TCP on loopback, {args.duration:g} s per point, pid {os.getpid()}")
    head = f"{'point':<12} {'ferry.mooncake':>16} {'Rust engine':>14} {'Python/Rust':>12}"
    if "mooncake" in results:
        head += f" {'mooncake.engine':>16} {'ferry/mooncake':>15}"
    print(head)
    for name, _, _, unit in POINTS:
        f = results["ferry"][name]
        r = results["ferry"][name + " (Rust)"]
        key = "ops" if unit == "ops" else "gbps"
        row = f"{name:<12} {_fmt(f, unit):>16} {_fmt(r, unit):>14} {f[key] / r[key]:>11.2f}x"
        if "mooncake" in results:
            m = results["mooncake"][name]
            row += f" {_fmt(m, unit):>16} {f[key] / m[key]:>14.2f}x"
        print(row)
    if mooncake_error:
        print(f"mooncake not measured: {mooncake_error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
