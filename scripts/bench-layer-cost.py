#!/usr/bin/env python3
"""Cost of the metrics and tracing layers `Engine::open` stacks by default,
interleaved: for each round and each point, `ferry bench` with the layers
and with `--no-layers`, one after the other (which goes first alternates
by round); prints a markdown table of the
median GB/s of each (with the values) and the ratio off/on.

usage: scripts/bench-layer-cost.py ROUNDS FERRY_BINARY
environment: POINTS (4KiB:256,1MiB:16: block:batch pairs), BACKEND
(tcp://127.0.0.1:0), DUR (1s)."""
import json, os, statistics, subprocess, sys

rounds = int(sys.argv[1]); binary = sys.argv[2]
points = [p.split(':') for p in os.environ.get('POINTS', '4KiB:256,1MiB:16').split(',')]
backend = os.environ.get('BACKEND', 'tcp://127.0.0.1:0')
dur = os.environ.get('DUR', '1s')

def run(block, batch, layers):
    args = [binary, 'bench', '--backend', backend, '--blocks', block, '--batches', batch,
            '--ops', 'write', '--duration', dur, '--json'] + ([] if layers else ['--no-layers'])
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    assert len(rows) == 1 and rows[0]['verified'], rows
    return rows[0]['gbps'], rows[0]['path']

res = {}
for r in range(rounds):
    for block, batch in points:
        # Alternate which goes first: a run right after another may find
        # the machine in another state (caches, frequency, the previous
        # run's peer process still exiting).
        for layers in ((True, False) if r % 2 == 0 else (False, True)):
            gbps, path = run(block, batch, layers)
            res.setdefault((block, batch, path, layers), []).append(gbps)
            print(f'round {r + 1} {block} x {batch} ({path}) layers={"on" if layers else "off"}: {gbps:.3f} GB/s',
                  file=sys.stderr)

print('| block x batch | path | layers on GB/s (median; runs) | layers off GB/s | on / off |')
print('|---|---|---|---|---|')
for block, batch in points:
    for (b, n, path, layers), on in res.items():
        if (b, n) != (block, batch) or not layers:
            continue
        off = res[(b, n, path, False)]
        mon, moff = statistics.median(on), statistics.median(off)
        fmt = lambda v: ', '.join(f'{x:.3f}' for x in v)
        print(f'| {block} x {batch} | {path} | {mon:.3f} ({fmt(on)}) | {moff:.3f} ({fmt(off)}) | {mon / moff:.3f} |')
