#!/usr/bin/env python3
"""Checks a Linux wheel against the manylinux policy with auditwheel.

    python scripts/wheel-policy.py [--max-glibc 2.28] WHEEL

Runs ``auditwheel show`` (printed) and ``auditwheel show --json`` with the
interpreter running this script (auditwheel installed there) and fails
unless: the wheel is not pure Python; its file name's platform tag and
auditwheel's verdict (``overall_tag``) are ``manylinux_2_N`` (or a legacy
alias) with N <= the given glibc minor; it needs no external shared library
(``external_libs`` empty: only the policy's system libraries, libc, libm,
libpthread, libdl…); and no unsupported ISA extension. ``.ci/run`` runs it
on the wheel of ``maturin build --zig --compatibility manylinux_2_28``.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

#: Legacy manylinux tags and the glibc they stand for (PEP 600).
LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


def glibc_of(tag):
    """(major, minor) of glibc a platform tag requires, or None if the tag
    is not a manylinux tag."""
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_[a-z0-9_]+", tag)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_[a-z0-9_]+", tag)
    return LEGACY[m.group(1)] if m else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("--max-glibc", default="2.28", help="highest glibc allowed (default 2.28)")
    args = p.parse_args(argv)
    limit = tuple(int(x) for x in args.max_glibc.split("."))
    show = [sys.executable, "-m", "auditwheel", "show"]
    subprocess.run(show + [str(args.wheel)], check=True)
    report = json.loads(
        subprocess.run(show + ["--json", str(args.wheel)], check=True, capture_output=True,
                       text=True).stdout
    )
    problems = []
    # name-version-python-abi-platform.whl; the platform part may hold
    # several tags separated by dots.
    platforms = args.wheel.name[: -len(".whl")].split("-")[-1].split(".")
    for tag in platforms:
        glibc = glibc_of(tag)
        if glibc is None or glibc > limit:
            problems.append(f"the file name's platform tag {tag} is not manylinux <= glibc "
                            f"{args.max_glibc}")
    if report.get("pure"):
        problems.append("auditwheel sees a pure-Python wheel (no extension module)")
    overall = report.get("overall_tag") or ""
    glibc = glibc_of(overall)
    if glibc is None or glibc > limit:
        problems.append(f"auditwheel's verdict {overall!r} is not manylinux <= glibc "
                        f"{args.max_glibc}")
    if report.get("external_libs"):
        problems.append(f"links libraries outside the policy: {sorted(report['external_libs'])}")
    if report.get("unsupported_isa"):
        problems.append("uses an ISA extension the policy does not allow")
    if problems:
        for line in problems:
            print(f"wheel-policy: {args.wheel.name}: {line}", file=sys.stderr)
        return 1
    print(f"wheel-policy: {args.wheel.name}: {overall}, no external libraries: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
