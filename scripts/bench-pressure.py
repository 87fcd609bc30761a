#!/usr/bin/env python3
"""bench-pressure.py ROUNDS BUSY FERRY_BIN... -- BENCH_ARGS

Runs `FERRY_BIN bench --same-host --json --no-baselines BENCH_ARGS` for
each binary in turn, ROUNDS times (interleaved, so that a noisy moment hits
every binary), while BUSY `while True: pass` processes compete for the
CPUs; prints per path, op, block and batch the median GB/s [min-max] and
the median p50 of every binary. A binary may be a wrapper script that
adds `--backend 'tcp://127.0.0.1:0?same_host_stage=off'` and so on.
A column is named after the binary's target directory (…/NAME/release/ferry).

  scripts/bench-pressure.py 3 2 old/release/ferry new/release/ferry -- \
      --ops write --blocks 64KiB,1MiB,4MiB --batches 1,16 --duration 300ms
"""
import json, subprocess, sys, statistics, os, signal
rounds = int(sys.argv[1]); busy = int(sys.argv[2])
rest = sys.argv[3:]
i = rest.index('--')
bins, args = rest[:i], rest[i+1:]
loops = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(busy)]
res = {}
try:
    for r in range(rounds):
        for b in bins:
            out = subprocess.run([b, 'bench', '--same-host', '--json', '--no-baselines'] + args,
                                 capture_output=True, text=True, timeout=600)
            try:
                rows = json.loads(out.stdout)
            except Exception:
                print('failed', b, out.stderr[-500:]); continue
            for row in rows:
                k = (b, row['path'].split(' ')[0], row['op'], row['block'], row['batch'])
                res.setdefault(k, []).append((row['gbps'], row['p50_us']))
finally:
    for l in loops: l.kill()
keys = sorted(set(k[1:] for k in res))
print("%-6s %-5s %8s %5s  " % ('path', 'op', 'block', 'batch') + "  ".join("%-28s" % os.path.basename(os.path.dirname(os.path.dirname(b))) for b in bins))
for k in keys:
    cells = []
    for b in bins:
        v = res.get((b,) + k, [])
        if not v: cells.append('%-28s' % '-'); continue
        g = [x[0] for x in v]; p = [x[1] for x in v]
        cells.append('%-28s' % ('%.2f [%.2f-%.2f] p50 %.0f' % (statistics.median(g), min(g), max(g), statistics.median(p))))
    print("%-6s %-5s %8d %5d  " % k + "  ".join(cells))
