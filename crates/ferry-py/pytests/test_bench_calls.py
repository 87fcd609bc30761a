"""`python -m ferry.bench --calls` runs end to end on Ferry's two paths and
reports figures for every call and thread measurement it names."""

import json
import subprocess
import sys


def test_calls_bench_reports_every_point():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry.bench",
            "--calls",
            "--json",
            "--no-mooncake",
            "--no-nixl",
            "--rounds",
            "1",
            "--per-round",
            "50",
            "--threads",
            "2",
            "--duration",
            "0.4",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.index("{") :])
    lat = doc["latency"]
    assert set(lat) == {"ferry same-host", "ferry socket"}
    for ops in lat.values():
        assert set(ops) == {"transfer_sync_write", "batch_transfer_sync_write"}
        for v in ops.values():
            assert 0 < v["p50_us"] <= v["p99_us"]
    for v in doc["threads"].values():
        assert v["one_ops"] > 0 and v["many_ops"] > 0
        assert v["fair"]["big_calls"] > 0 and v["fair"]["small_max_us"] > 0
