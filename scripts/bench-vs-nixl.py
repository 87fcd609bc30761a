#!/usr/bin/env python3
"""bench-vs-nixl.py --ferry BIN [--ferry BIN2 ...] --python PY [options]

Ferry's same-host path (`BIN bench --same-host`: two processes of this
host) against NVIDIA NIXL's Python API (UCX with its default transports on
one host: cma / shared memory) at the points of issue 21, interleaved in
rounds so that every side sees the same machine conditions, optionally
with BUSY `while True: pass` processes competing for the CPUs.

Points (writes): 4 KiB x 1 (p50 of one call), 64 KiB x 16, 1 MiB x 1,
1 MiB x 16, 16 MiB x 1 (GB/s over --duration, and p50 of one batch).

NIXL's side: a target process (this script, `--serve`) registers 64 MiB
and publishes its agent metadata; the initiator (this process) registers
64 MiB, prepares one descriptor list per point (blocks with gaps between
them, as `ferry bench` writes them) and loops `transfer` + polling
`check_xfer_state` until DONE, as NIXL's own Python examples do.

PY is a Python with NIXL's API installed (`python3 -m venv V &&
V/bin/pip install --no-deps nixl-cu12 numpy`); the NIXL side runs in it.
Each BIN is a `ferry` release binary (a column per binary, named after its
target directory, …/NAME/release/ferry).

  scripts/bench-vs-nixl.py --ferry target/release/ferry \\
      --python /tmp/nixlpy/bin/python --rounds 5 --busy 2
"""
import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

SPAN = 64 << 20
POINTS = [(4096, 1), (64 << 10, 16), (1 << 20, 1), (1 << 20, 16), (16 << 20, 1)]


def ucx_env():
    env = dict(os.environ)
    # The wheel's EFA module brings a second libibverbs that crashes the
    # process at exit on hosts without EFA (see the ferry-nixl README).
    env.setdefault("UCX_MODULES", "^efa")
    env.pop("UCX_TLS", None)
    return env


def nixl_api():
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    sys.exit("NIXL's Python API is not installed in this Python")


def serve():
    api = nixl_api()
    agent = api.nixl_agent("ferry-vs-nixl-target", api.nixl_agent_config(backends=["UCX"]))
    buf = ctypes.create_string_buffer(SPAN)
    addr = ctypes.addressof(buf)
    descs = agent.register_memory([(addr, SPAN, 0, "")], "DRAM")
    print(json.dumps({"meta": agent.get_agent_metadata().hex(), "addr": addr}), flush=True)
    sys.stdin.read()
    agent.deregister_memory(descs)


def nixl_round(duration):
    """One round of every point: {(block, batch): (gbps, p50_us)}."""
    api = nixl_api()
    target = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ucx_env(),
    )
    try:
        while True:
            line = target.stdout.readline()
            if not line:
                raise RuntimeError(f"NIXL target exited: {target.wait()}")
            if line.startswith("{"):
                info = json.loads(line)
                break
        agent = api.nixl_agent(f"ferry-vs-nixl-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
        buf = ctypes.create_string_buffer(SPAN)
        base = ctypes.addressof(buf)
        reg = agent.register_memory([(base, SPAN, 0, "")], "DRAM")
        peer = agent.add_remote_agent(bytes.fromhex(info["meta"]))
        out = {}
        for block, batch in POINTS:
            stride = block * 2 if block * 2 * batch <= SPAN else block
            offs = [k * stride for k in range(batch)]
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + o, block, 0) for o in offs], "DRAM")
            far = agent.prep_xfer_dlist(peer, [(info["addr"] + o, block, 0) for o in offs], "DRAM")
            idx = list(range(batch))
            h = agent.make_prepped_xfer("WRITE", local, idx, far, idx)

            def once():
                state = agent.transfer(h)
                while state == "PROC":
                    state = agent.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL transfer: {state}")

            for _ in range(3):  # connection set-up, warm caches
                once()
            lat = []
            start = time.perf_counter()
            while time.perf_counter() - start < duration:
                t0 = time.perf_counter_ns()
                once()
                lat.append(time.perf_counter_ns() - t0)
            spent = time.perf_counter() - start
            gbps = len(lat) * block * batch / spent / 1e9
            out[(block, batch)] = (gbps, statistics.median(lat) / 1e3)
            agent.release_xfer_handle(h)
            agent.release_dlist_handle(local)
            agent.release_dlist_handle(far)
        agent.deregister_memory(reg)
        agent.remove_remote_agent(peer)
        return out
    finally:
        target.stdin.close()
        target.wait(timeout=30)


def ferry_round(binary, duration):
    out = {}
    for block, batch in POINTS:
        args = [binary, "bench", "--same-host", "--json", "--no-baselines", "--ops", "write",
                "--blocks", str(block), "--batches", str(batch), "--duration", f"{int(duration * 1000)}ms"]
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        try:
            rows = json.loads(r.stdout)
        except ValueError:
            raise RuntimeError(f"{binary} bench failed: {r.stderr[-800:]}")
        for row in rows:
            # The same-host path reports itself as "cma"; the socket row
            # (`tcp (same_host=off)`) is left out.
            if "same_host=off" not in row["path"]:
                out[(block, batch)] = (row["gbps"], row["p50_us"])
    return out


def name_of(binary):
    return os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(binary))))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nixl-round", type=float, help=argparse.SUPPRESS)
    p.add_argument("--ferry", action="append", default=[], help="a ferry release binary (repeatable)")
    p.add_argument("--python", help="a Python with nixl-cu12 (and numpy) installed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", type=int, default=0, help="busy-loop processes during the run")
    p.add_argument("--duration", type=float, default=0.5, help="seconds per point")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.serve:
        return serve()
    if a.nixl_round is not None:
        r = nixl_round(a.nixl_round)
        print(json.dumps([[b, n, g, l] for (b, n), (g, l) in r.items()]))
        return 0
    if not a.ferry or not a.python:
        p.error("--ferry and --python are required")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    res = {}
    try:
        for _ in range(a.rounds):
            for b in a.ferry:
                for k, v in ferry_round(b, a.duration).items():
                    res.setdefault((name_of(b), k), []).append(v)
            r = subprocess.run([a.python, os.path.abspath(__file__), "--nixl-round", str(a.duration)],
                               capture_output=True, text=True, timeout=600, env=ucx_env())
            line = [x for x in r.stdout.splitlines() if x.startswith("[")]
            if not line:
                raise RuntimeError(f"NIXL round failed: {r.stderr[-800:]}")
            for b, n, g, l in json.loads(line[-1]):
                res.setdefault(("nixl", (b, n)), []).append((g, l))
    finally:
        for l in loops:
            l.kill()
    cols = [name_of(b) for b in a.ferry] + ["nixl"]
    table = {}
    for (col, k), v in res.items():
        g = [x[0] for x in v]
        l = [x[1] for x in v]
        table[(col, k)] = {"gbps": statistics.median(g), "gbps_min": min(g), "gbps_max": max(g),
                           "p50_us": statistics.median(l), "runs": len(v)}
    if a.json:
        print(json.dumps([{"side": c, "block": k[0], "batch": k[1], **t} for (c, k), t in table.items()]))
        return 0
    print(f"same-host writes, {a.rounds} interleaved rounds, {a.busy} busy loops; "
          "median GB/s [min-max], median p50 us; ratio = first ferry / nixl")
    print("%-14s " % "point" + "".join("%-30s" % c for c in cols) + "ratio")
    for k in POINTS:
        cells = []
        for c in cols:
            t = table.get((c, k))
            cells.append("%-30s" % ("-" if t is None else "%.2f [%.2f-%.2f] p50 %.1f" % (
                t["gbps"], t["gbps_min"], t["gbps_max"], t["p50_us"])))
        f, n = table.get((cols[0], k)), table.get(("nixl", k))
        if f and n:
            ratio = (n["p50_us"] / f["p50_us"]) if k == (4096, 1) else (f["gbps"] / n["gbps"])
            cells.append("%.2fx%s" % (ratio, " (p50)" if k == (4096, 1) else ""))
        label = ("%dKiB" % (k[0] >> 10)) if k[0] < (1 << 20) else ("%dMiB" % (k[0] >> 20))
        print("%-14s " % f"{label} x {k[1]}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
