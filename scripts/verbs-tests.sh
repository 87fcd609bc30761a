#!/usr/bin/env bash
# verbs-tests.sh — the verbs backend's tests on a real verbs stack, one
# command: builds backend-verbs' test binaries (feature `rdma`) on this
# host, then runs them on soft-RoCE inside a QEMU guest (scripts/rxe-vm.sh).
#
# Usage (as root, from anywhere):
#   scripts/verbs-tests.sh           # conformance suite (raw + adapted) and fault tests
#   scripts/verbs-tests.sh --bench   # also the verbs_bench example (release build)
#
# Installs cmake and libclang-dev with apt if missing (the `rdma` feature's
# build needs them). CARGO_TARGET_DIR is honoured. Exit status 0 only if
# every binary passed in the guest.
set -euo pipefail
cd "$(dirname "$0")/.."

bench=0
for a in "$@"; do
  case "$a" in
    --bench) bench=1 ;;
    *) echo "usage: $0 [--bench]" >&2; exit 2 ;;
  esac
done

need=()
command -v cmake >/dev/null || need+=(cmake)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 \
  || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "verbs-tests: installing ${need[*]}"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

echo "verbs-tests: building the test binaries (cargo test -p backend-verbs --features rdma --no-run)"
mapfile -t bins < <(cargo test -p backend-verbs --features rdma --no-run --message-format=json \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | grep -v '/examples/')
[ ${#bins[@]} -gt 0 ] || { echo "verbs-tests: no test binaries were built" >&2; exit 1; }

if [ "$bench" -eq 1 ]; then
  echo "verbs-tests: building the verbs_bench example (release)"
  mapfile -t -O ${#bins[@]} bins < <(cargo build -p backend-verbs --features rdma --release \
    --example verbs_bench --message-format=json | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
fi

printf 'verbs-tests: %s\n' "${bins[@]}"
# One test at a time: the guest has few vCPUs and TCG is slow.
RXE_VM_ARGS="${RXE_VM_ARGS:---test-threads=1}" exec scripts/rxe-vm.sh "${bins[@]}"
