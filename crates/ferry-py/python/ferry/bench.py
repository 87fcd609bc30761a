"""``python -m ferry.bench``: ferry.mooncake.TransferEngine against
mooncake.engine.TransferEngine, both over TCP on loopback, in one run.

Each API gets the same treatment: a target process (``--serve``) registers a
64 MiB region; this process registers its own 64 MiB and writes into the
target through the API's Python methods, cycling through the span. The
blocks of a batch land with gaps between them (no layer can merge them):

- single 4 KiB writes (``transfer_sync_write``), transfers/s;
- 4 KiB x 256 batches (``batch_transfer_sync_write``), transfers/s;
- 64 KiB x 128 batches, GB/s;
- single 1 MiB writes, GB/s.

For Ferry the same points are also run by the Rust engine itself, looping in
Rust on the same engines (``Engine._bench_loop``): the ratio is the cost of
the Python call. The three series (Ferry from Python, Ferry from Rust,
Mooncake from Python) are interleaved in short rounds, so that they see the
same machine conditions; the figures are medians, the ratios medians of the
per-round ratios. Mooncake comes from the ``mooncake-transfer-engine-non-cuda``
wheel (``pip install mooncake-transfer-engine-non-cuda``); without it only
Ferry is measured. ``--json`` prints the figures as JSON.

``--calls`` measures per call instead (see ``ferry._bench_calls``): the p50
and p99 of one 4 KiB write on Ferry's same-host and socket paths, Mooncake's
and NIXL's Python APIs; ``--threads N`` threads on one engine and session;
and small calls beside a thread writing 16 MiB batches.
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
    """Local and remote offsets of iteration i, cycling through the span.
    Local blocks are contiguous; remote blocks leave a block-sized gap after
    each, as a decode side's free KV blocks do, so that no layer can merge
    the requests of a batch into fewer, larger ones (Ferry's adapter merges
    requests contiguous on both sides; SGLang merges them before calling)."""
    size = 2 * block * batch
    slots = SPAN // size
    base = (i % slots) * size
    return [base + k * block for k in range(batch)], [base + 2 * k * block for k in range(batch)]


def _run_python(te, session, local, remote, block, batch, duration):
    n = 0
    moved = 0
    deadline = time.perf_counter() + duration
    t0 = time.perf_counter()
    while True:
        loffs, roffs = _offsets(block, batch, n)
        if batch == 1:
            ret = te.transfer_sync_write(session, local + loffs[0], remote + roffs[0], block)
        else:
            ret = te.batch_transfer_sync_write(
                session, [local + o for o in loffs], [remote + o for o in roffs], [block] * batch
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
    loffs, roffs = _offsets(block, batch, 0)
    locals_ = [local + o for o in loffs]
    remotes = [remote + o for o in roffs]
    # _bench_loop shifts every address by 2 * block * batch per iteration
    # (modulo SPAN), as _offsets does. Calibrate, then run for `duration`.
    iters = 8
    while True:
        secs = engine._bench_loop(seg, "write", locals_, remotes, [block] * batch, iters, SPAN, 2 * block * batch)
        if secs >= duration / 4 or iters >= 1 << 22:
            break
        iters *= 4
    iters = max(1, int(iters * duration / max(secs, 1e-9)))
    secs = engine._bench_loop(seg, "write", locals_, remotes, [block] * batch, iters, SPAN, 2 * block * batch)
    moved = iters * block * batch
    return iters * batch / secs, moved / secs / 1e9


class _Side:
    """One API's target process and initiator engine."""

    def __init__(self, api):
        self.api = api
        self.server = subprocess.Popen(
            [sys.executable, "-m", "ferry.bench", "--serve", api],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.server.stdout.readline()
        if not line:
            raise RuntimeError(f"{api} target exited: {self.server.wait()}")
        info = json.loads(line)
        self.te, self.buf, self.local = _start(api)
        self.session, self.remote = info["session"], info["addr"]

    def python(self, block, batch, duration):
        return _run_python(self.te, self.session, self.local, self.remote, block, batch, duration)

    def rust(self, block, batch, duration):
        return _run_rust(self.te, self.session, self.local, self.remote, block, batch, duration)

    def close(self):
        try:
            self.te.unregister_memory(self.local)
        finally:
            self.server.stdin.close()
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()


def measure(duration, rounds, with_mooncake):
    """Interleaved measurement: for every point, `rounds` rounds of (Ferry
    from Python, Ferry from Rust, Mooncake from Python), each for
    duration / rounds seconds, so that all three see the same machine
    conditions. Returns {series: {point: [{"ops", "gbps"} per round]}}."""
    sides = {"ferry": _Side("ferry")}
    try:
        if with_mooncake:
            sides["mooncake"] = _Side("mooncake")
        out = {"ferry": {}, "rust": {}, "mooncake": {}}
        slice_ = duration / rounds
        for name, block, batch, _ in POINTS:
            for side in sides.values():
                side.python(block, batch, 0.2)  # warm-up
            for _ in range(rounds):
                ops, gbps = sides["ferry"].python(block, batch, slice_)
                out["ferry"].setdefault(name, []).append({"ops": ops, "gbps": gbps})
                ops, gbps = sides["ferry"].rust(block, batch, slice_)
                out["rust"].setdefault(name, []).append({"ops": ops, "gbps": gbps})
                if "mooncake" in sides:
                    ops, gbps = sides["mooncake"].python(block, batch, slice_)
                    out["mooncake"].setdefault(name, []).append({"ops": ops, "gbps": gbps})
        return out
    finally:
        for side in sides.values():
            side.close()


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def summarize(raw):
    """Medians per series and point, and the medians of the per-round
    ratios (ferry/rust, ferry/mooncake)."""
    summary = {}
    for name, _, _, unit in POINTS:
        key = "ops" if unit == "ops" else "gbps"
        f = [r[key] for r in raw["ferry"][name]]
        r = [x[key] for x in raw["rust"][name]]
        row = {
            "unit": key,
            "ferry": _median(f),
            "rust": _median(r),
            "python_over_rust": _median([a / b for a, b in zip(f, r)]),
        }
        if raw["mooncake"].get(name):
            m = [x[key] for x in raw["mooncake"][name]]
            row["mooncake"] = _median(m)
            row["ferry_over_mooncake"] = _median([a / b for a, b in zip(f, m)])
        summary[name] = row
    return summary


def _fmt(v, key):
    return f"{v / 1e3:8.1f}k/s" if key == "ops" else f"{v:7.2f} GB/s"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ferry.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per point and series")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds per point")
    p.add_argument("--json", action="store_true", help="print JSON (medians and every round)")
    p.add_argument("--serve", choices=["ferry", "mooncake"], help=argparse.SUPPRESS)
    p.add_argument("--no-mooncake", action="store_true", help="measure Ferry only")
    p.add_argument(
        "--calls",
        action="store_true",
        help="per-call figures instead: 4 KiB latency p50/p99 on Ferry's two paths, "
        "Mooncake and NIXL; N threads on one engine; fairness beside 16 MiB batches",
    )
    p.add_argument("--per-round", type=int, default=2000, help="--calls: calls per round")
    p.add_argument("--threads", type=int, default=10, help="--calls: threads (0: skip)")
    p.add_argument("--no-nixl", action="store_true", help="--calls: leave NIXL out")
    p.add_argument("--serve-calls", choices=["ferry", "mooncake", "nixl"], help=argparse.SUPPRESS)
    p.add_argument(
        "--ferry-url",
        default=os.environ.get("FERRY_URL", "tcp://?same_host=off"),
        help="Ferry's backend URL (default: TCP with the same-host path off, as "
        "Mooncake's TCP transport; `tcp://` lets two processes on one host use it)",
    )
    args = p.parse_args(argv)
    if args.serve_calls or args.calls:
        from ferry import _bench_calls

        if args.serve_calls:
            return _bench_calls.serve(args.serve_calls)
        return _bench_calls.run(args)
    # ferry.mooncake.TransferEngine() and the --serve child read FERRY_URL.
    os.environ["FERRY_URL"] = args.ferry_url
    if args.serve:
        return serve(args.serve)
    mooncake_error = None
    with_mooncake = not args.no_mooncake
    if with_mooncake:
        try:
            import mooncake.engine  # noqa: F401
        except ImportError as e:
            mooncake_error = f"mooncake.engine is not installed ({e})"
            with_mooncake = False
    raw = measure(args.duration, args.rounds, with_mooncake)
    summary = summarize(raw)
    if args.json:
        print(
            json.dumps(
                {
                    "ferry_url": args.ferry_url,
                    "summary": summary,
                    "rounds": raw,
                    "mooncake_error": mooncake_error,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"python -m ferry.bench: loopback, Ferry on {args.ferry_url}, {args.rounds} "
        f"interleaved rounds, {args.duration:g} s per point and series; medians"
    )
    head = f"{'point':<12} {'ferry.mooncake':>16} {'Rust engine':>14} {'Python/Rust':>12}"
    if with_mooncake:
        head += f" {'mooncake.engine':>16} {'ferry/mooncake':>15}"
    print(head)
    for name, _, _, _ in POINTS:
        row = summary[name]
        key = row["unit"]
        line = (
            f"{name:<12} {_fmt(row['ferry'], key):>16} {_fmt(row['rust'], key):>14} "
            f"{row['python_over_rust']:>11.2f}x"
        )
        if "mooncake" in row:
            line += f" {_fmt(row['mooncake'], key):>16} {row['ferry_over_mooncake']:>14.2f}x"
        print(line)
    if mooncake_error:
        print(f"mooncake not measured: {mooncake_error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
