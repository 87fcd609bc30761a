"""Per-call figures of ``python -m ferry.bench --calls``: the latency of one
small write and what many Python threads calling at once get.

Three measurements, every API in the same run, interleaved in short rounds
so that all see the same machine conditions:

- **latency**: one 4 KiB write per call, p50 and p99 of the call as Python
  sees it (``time.perf_counter_ns`` around the call), for
  ``transfer_sync_write`` and a one-request ``batch_transfer_sync_write``;
  Ferry on both of its paths (``tcp://``: the same-host path between two
  processes of one host; ``tcp://?same_host=off``: the socket), Mooncake's
  Python API (TCP) and, when installed, NIXL's Python API (UCX as it
  chooses on one host, and ``UCX_TLS=tcp``): ``transfer`` of a prepared
  one-descriptor handle, polled with ``check_xfer_state`` until done;
- **threads**: N threads (default 10) calling ``batch_transfer_sync_write``
  with one 4 KiB request on one engine and one session, as vLLM's
  connector does; aggregate calls/s against one thread's;
- **fairness**: the same threads while one more thread writes 16 MiB
  batches (16 x 1 MiB): the small calls' p99 and max against the large
  call's median duration.

Every API writes from its own 64 MiB region into a target process's
64 MiB region, cycling through the span (no cache-hot single block).
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

SPAN = 64 << 20
SMALL = 4096
# Prepared 4 KiB slots per lane (`MooncakeLike.call`).
LANE_SLOTS = 256
BIG_BLOCK = 1 << 20
BIG_COUNT = 16


def _nixl_api():
    """NIXL's Python API module, or None."""
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    return None


def _ucx_env(tls):
    """The environment a NIXL side runs with: the operator's, plus
    ``UCX_MODULES=^efa`` where unset (the wheel's EFA module brings a second
    libibverbs that crashes the process at exit on hosts without EFA; see
    the ferry-nixl README) and ``UCX_TLS`` for the socket variant."""
    env = dict(os.environ)
    env.setdefault("UCX_MODULES", "^efa")
    if tls:
        env["UCX_TLS"] = tls
    else:
        env.pop("UCX_TLS", None)
    return env


class _Region:
    def __init__(self):
        self.buf = ctypes.create_string_buffer(SPAN)
        self.addr = ctypes.addressof(self.buf)


def _mooncake_like(api):
    if api == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from ferry.mooncake import TransferEngine
    te = TransferEngine()
    ret = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if ret != 0:
        raise RuntimeError(f"{api}: initialize returned {ret}")
    region = _Region()
    ret = te.register_memory(region.addr, SPAN)
    if ret != 0:
        raise RuntimeError(f"{api}: register_memory returned {ret}")
    return te, region


def serve(kind):
    """Target process for ``kind`` (``ferry``, ``mooncake`` or ``nixl``):
    register a region, print how to reach it as one JSON line, wait for
    stdin to close."""
    if kind == "nixl":
        api = _nixl_api()
        agent = api.nixl_agent("ferry-bench-target", api.nixl_agent_config(backends=["UCX"]))
        region = _Region()
        descs = agent.register_memory([(region.addr, SPAN, 0, "")], "DRAM")
        meta = agent.get_agent_metadata()
        print(json.dumps({"meta": meta.hex(), "addr": region.addr}), flush=True)
        sys.stdin.read()
        agent.deregister_memory(descs)
        return 0
    te, region = _mooncake_like(kind)
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": region.addr}), flush=True)
    sys.stdin.read()
    te.unregister_memory(region.addr)
    return 0


def _spawn(kind, env):
    # This file run as a script (not `-m ferry.bench`): it also drives an
    # installed Ferry that predates it, for before/after comparisons.
    p = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve-calls", kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    # Libraries may log to stdout first (NIXL does): the first JSON line.
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{kind} target exited: {p.wait()}")
        if line.startswith("{"):
            return p, json.loads(line)


def _stop(p):
    p.stdin.close()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()


class MooncakeLike:
    """Ferry's ``ferry.mooncake`` or Mooncake's ``mooncake.engine``: the
    same API, one target process each."""

    def __init__(self, label, api, ferry_url=None):
        self.label = label
        env = dict(os.environ)
        saved = os.environ.get("FERRY_URL")
        if ferry_url is not None:
            env["FERRY_URL"] = ferry_url
            os.environ["FERRY_URL"] = ferry_url
        try:
            self.server, info = _spawn(api, env)
            self.te, self.region = _mooncake_like(api)
        finally:
            if saved is None:
                os.environ.pop("FERRY_URL", None)
            else:
                os.environ["FERRY_URL"] = saved
        self.session, self.remote = info["session"], info["addr"]
        self.ops = ("transfer_sync_write", "batch_transfer_sync_write")

    def _lane(self, lane, lanes):
        """The calls of lane `lane` of `lanes`, prepared once (as NIXL's
        handles are): (src, dst, [src], [dst], [SMALL]) per slot, slots
        of disjoint slices of the span's first half for concurrent
        threads. The loop then does as little Python per call as NIXL's,
        so that the columns compare the APIs, not the harness."""
        lanes_of = self.__dict__.setdefault("_lanes", {})
        got = lanes_of.get((lane, lanes))
        if got is None:  # first call of this lane
            slots = LANE_SLOTS
            got = []
            for k in range(slots):
                off = (lane * slots + k) * 2 * SMALL
                src, dst = self.region.addr + off, self.remote + off
                got.append((src, dst, [src], [dst], [SMALL]))
            lanes_of[(lane, lanes)] = got
        return got

    def call(self, op, i, lane=0, lanes=1):
        """One 4 KiB write, slot i of lane `lane` of `lanes`."""
        try:
            slots = self._lanes[lane, lanes]
        except (AttributeError, KeyError):
            slots = self._lane(lane, lanes)
        src, dst, srcs, dsts, lens = slots[i & 255]  # LANE_SLOTS - 1
        if op == "transfer_sync_write":
            ret = self.te.transfer_sync_write(self.session, src, dst, SMALL)
        else:
            ret = self.te.batch_transfer_sync_write(self.session, srcs, dsts, lens)
        if ret != 0:
            raise RuntimeError(f"{self.label} {op}: {ret}")

    def big(self, i):
        """One 16 x 1 MiB batch (the second half of the span)."""
        half = SPAN // 2
        slots = half // (BIG_BLOCK * BIG_COUNT)
        base = half + (i % slots) * BIG_BLOCK * BIG_COUNT
        offs = [base + k * BIG_BLOCK for k in range(BIG_COUNT)]
        ret = self.te.batch_transfer_sync_write(
            self.session,
            [self.region.addr + o for o in offs],
            [self.remote + o for o in offs],
            [BIG_BLOCK] * BIG_COUNT,
        )
        if ret != 0:
            raise RuntimeError(f"{self.label} big batch: {ret}")

    def close(self):
        try:
            self.te.unregister_memory(self.region.addr)
        finally:
            _stop(self.server)


class Nixl:
    """NIXL's Python API: a prepared descriptor list of 4 KiB slots on both
    sides and one prepared WRITE handle per slot, posted with ``transfer``
    and polled with ``check_xfer_state`` (the calls a NIXL connector makes
    per request)."""

    SLOTS = 64
    # A NIXL agent's progress thread spins (a whole CPU each, target and
    # initiator): the agents live only for their own rounds, so that they
    # do not take the CPUs from the other APIs' measurements.
    transient = True

    def __init__(self, label, api, tls):
        self.label = label
        self.api, self.tls = api, tls
        self.ops = ("transfer",)
        self.server = None

    def start(self):
        api, tls, label = self.api, self.tls, self.label
        env = _ucx_env(tls)
        self.server, info = _spawn("nixl", env)
        saved = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_MODULES")}
        os.environ.update({k: v for k, v in env.items() if k in saved})
        if "UCX_TLS" not in env:
            os.environ.pop("UCX_TLS", None)
        try:
            name = f"ferry-bench-{label}-{os.getpid()}"
            self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.region = _Region()
        self.reg = self.agent.register_memory([(self.region.addr, SPAN, 0, "")], "DRAM")
        peer = self.agent.add_remote_agent(bytes.fromhex(info["meta"]))
        remote = info["addr"]
        offs = [k * 2 * SMALL for k in range(self.SLOTS)]
        local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(self.region.addr + o, SMALL, 0) for o in offs], "DRAM"
        )
        far = self.agent.prep_xfer_dlist(peer, [(remote + o, SMALL, 0) for o in offs], "DRAM")
        self.handles = [self.agent.make_prepped_xfer("WRITE", local, [k], far, [k]) for k in range(self.SLOTS)]
        # The first transfers set the connection up.
        for k in range(self.SLOTS):
            self.call("transfer", k)

    def call(self, op, i, lane=0, lanes=1):
        h = self.handles[i % self.SLOTS]
        state = self.agent.transfer(h)
        while state == "PROC":
            state = self.agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"{self.label} transfer: {state}")

    def stop(self):
        if self.server is None:
            return
        try:
            for h in self.handles:
                self.agent.release_xfer_handle(h)
            self.agent.deregister_memory(self.reg)
            self.agent = None
        finally:
            _stop(self.server)
            self.server = None

    def close(self):
        self.stop()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def latency(sides, calls, rounds):
    """{label: {op: {"p50_us", "p99_us", "rounds_p50_us"}}}: `rounds`
    interleaved rounds of `calls` calls per API and operation."""
    samples = {s.label: {op: [] for op in s.ops} for s in sides}
    per_round = {s.label: {op: [] for op in s.ops} for s in sides}
    clock = time.perf_counter_ns
    for r in range(rounds):
        for s in sides:
            transient = getattr(s, "transient", False)
            if transient:
                s.start()
            try:
                for op in s.ops:
                    for i in range(200):  # warm-up
                        s.call(op, i)
                    xs = []
                    for i in range(calls):
                        t = clock()
                        s.call(op, r * calls + i)
                        xs.append(clock() - t)
                    samples[s.label][op].extend(xs)
                    per_round[s.label][op].append(_pct(xs, 0.5) / 1e3)
            finally:
                if transient:
                    s.stop()
    out = {}
    for s in sides:
        out[s.label] = {}
        for op in s.ops:
            xs = samples[s.label][op]
            out[s.label][op] = {
                "p50_us": _median(per_round[s.label][op]),
                "p99_us": _pct(xs, 0.99) / 1e3,
                "rounds_p50_us": per_round[s.label][op],
            }
    return out


def _threaded(side, nthreads, duration, big):
    """`nthreads` threads of one-request 4 KiB batches (and, with `big`,
    one more thread of 16 MiB batches) for `duration` s on one engine and
    session: (small calls/s, small latencies ns, big durations ns)."""
    stop = threading.Event()
    start = threading.Barrier(nthreads + (1 if big else 0) + 1)
    counts = [0] * nthreads
    lats = [[] for _ in range(nthreads)]
    bigs = []
    errors = []

    def small(lane):
        try:
            start.wait()
            i = 0
            clock = time.perf_counter_ns
            while not stop.is_set():
                t = clock()
                side.call("batch_transfer_sync_write", i, lane, nthreads)
                lats[lane].append(clock() - t)
                i += 1
            counts[lane] = i
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            stop.set()

    def large():
        try:
            start.wait()
            i = 0
            while not stop.is_set():
                t = time.perf_counter_ns()
                side.big(i)
                bigs.append(time.perf_counter_ns() - t)
                i += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            stop.set()

    ts = [threading.Thread(target=small, args=(k,)) for k in range(nthreads)]
    if big:
        ts.append(threading.Thread(target=large))
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(duration)
    stop.set()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(counts) / elapsed, [x for xs in lats for x in xs], bigs


def threads(sides, nthreads, duration, rounds):
    """{label: {"one_ops", "many_ops", "scaling", "fair": {...}}}, rounds
    interleaved across APIs."""
    raw = {s.label: {"one": [], "many": [], "fair_small": [], "fair_big": [], "fair_ops": []} for s in sides}
    slice_ = duration / rounds
    for _ in range(rounds):
        for s in sides:
            one, _, _ = _threaded(s, 1, slice_, False)
            many, _, _ = _threaded(s, nthreads, slice_, False)
            ops, small, bigs = _threaded(s, nthreads, slice_, True)
            r = raw[s.label]
            r["one"].append(one)
            r["many"].append(many)
            r["fair_ops"].append(ops)
            r["fair_small"].extend(small)
            r["fair_big"].extend(bigs)
    out = {}
    for s in sides:
        r = raw[s.label]
        big_med = _median(r["fair_big"]) / 1e3 if r["fair_big"] else None
        out[s.label] = {
            "one_ops": _median(r["one"]),
            "many_ops": _median(r["many"]),
            "scaling": _median([m / o for m, o in zip(r["many"], r["one"])]),
            "fair": {
                "small_ops": _median(r["fair_ops"]),
                "small_p50_us": _pct(r["fair_small"], 0.5) / 1e3,
                "small_p99_us": _pct(r["fair_small"], 0.99) / 1e3,
                "small_max_us": max(r["fair_small"]) / 1e3,
                "big_median_us": big_med,
                "big_calls": len(r["fair_big"]),
            },
        }
    return out


def make_sides(with_mooncake, with_nixl):
    """The APIs measured, in order, and why any is missing."""
    sides, missing = [], []
    sides.append(MooncakeLike("ferry same-host", "ferry", "tcp://"))
    sides.append(MooncakeLike("ferry socket", "ferry", "tcp://?same_host=off"))
    if with_mooncake:
        try:
            import mooncake.engine  # noqa: F401

            sides.append(MooncakeLike("mooncake tcp", "mooncake"))
        except ImportError as e:
            missing.append(f"mooncake.engine is not installed ({e})")
    if with_nixl:
        api = _nixl_api()
        if api is None:
            missing.append("NIXL's Python API (nixl_cu12 / nixl) is not installed")
        else:
            sides.append(Nixl("nixl ucx", api, None))
            sides.append(Nixl("nixl ucx-tcp", api, "tcp"))
    return sides, missing


def run(args):
    sides, missing = make_sides(not args.no_mooncake, not args.no_nixl)
    try:
        lat = latency(sides, args.per_round, args.rounds)
        thr_sides = [s for s in sides if isinstance(s, MooncakeLike)]
        thr = threads(thr_sides, args.threads, args.duration, args.rounds) if args.threads else {}
    finally:
        for s in sides:
            s.close()
    result = {"latency": lat, "threads": thr, "nthreads": args.threads, "missing": missing}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"python -m ferry.bench --calls: loopback, 4 KiB writes, {args.rounds} interleaved "
        f"rounds of {args.per_round} calls; p50 = median of the rounds' p50, p99 over all calls"
    )
    base = lat.get("ferry socket", {}).get("transfer_sync_write", {}).get("p50_us")
    print(f"{'API':<18} {'call':<27} {'p50 µs':>8} {'p99 µs':>8} {'p50 / ferry socket':>19}")
    for label, ops in lat.items():
        for op, v in ops.items():
            ratio = f"{v['p50_us'] / base:>18.2f}x" if base else ""
            print(f"{label:<18} {op:<27} {v['p50_us']:>8.1f} {v['p99_us']:>8.1f} {ratio}")
    if thr:
        n = args.threads
        print(
            f"\n{n} threads, one-request 4 KiB batch_transfer_sync_write each, one engine and session; "
            f"fairness: the same plus one thread of {BIG_COUNT} x 1 MiB batches"
        )
        print(
            f"{'API':<18} {'1 thread':>10} {f'{n} threads':>11} {'scaling':>8} "
            f"{'| small p99':>12} {'small max':>10} {'16 MiB call':>12}"
        )
        for label, v in thr.items():
            f = v["fair"]
            bigm = f"{f['big_median_us'] / 1e3:>9.1f} ms" if f["big_median_us"] else "         -"
            print(
                f"{label:<18} {v['one_ops'] / 1e3:>8.1f}k/s {v['many_ops'] / 1e3:>9.1f}k/s "
                f"{v['scaling']:>7.2f}x | {f['small_p99_us'] / 1e3:>7.2f} ms {f['small_max_us'] / 1e3:>7.2f} ms {bigm}"
            )
    for m in missing:
        print(f"not measured: {m}")
    return 0


def add_arguments(p):
    """The options of ``--calls`` (shared with ``python -m ferry.bench``)."""
    p.add_argument("--duration", type=float, default=3.0, help="seconds per thread measurement")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-mooncake", action="store_true", help="leave Mooncake out")
    p.add_argument("--per-round", type=int, default=2000, help="calls per round")
    p.add_argument("--threads", type=int, default=10, help="threads (0: skip)")
    p.add_argument("--no-nixl", action="store_true", help="leave NIXL out")
    p.add_argument("--serve-calls", choices=["ferry", "mooncake", "nixl"], help=argparse.SUPPRESS)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    if args.serve_calls:
        return serve(args.serve_calls)
    return run(args)


if __name__ == "__main__":
    # Run as a file, this directory (ferry/, with its mooncake.py) comes
    # first on the path and would shadow Mooncake's own `mooncake`.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.exit(main())
