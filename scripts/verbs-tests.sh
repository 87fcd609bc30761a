#!/usr/bin/env bash
# verbs-tests.sh — the verbs backend's tests on a real verbs stack, one
# command: builds ferry-verbs' test binaries (feature `rdma`) on this
# host, then runs them on soft-RoCE inside a QEMU guest (scripts/rxe-vm.sh).
#
# Usage (as root, from anywhere):
#   scripts/verbs-tests.sh           # conformance suite (raw + adapted) and fault tests,
#                                    # and ferry's multi engine over verbs + TCP (tests/multi_verbs.rs)
#   scripts/verbs-tests.sh --bench   # also the verbs_bench and multi_verbs_bench examples (release)
#   scripts/verbs-tests.sh --old-ferry PATH
#       # also the cross-build test (tests/versions.rs) against PATH, a `ferry`
#       # built from an older commit with `--features verbs` (e.g. 7c3e5e6):
#       # it is copied into the guest and named by FERRY_VERBS_OLD_FERRY
#
# Installs cmake and libclang-dev with apt if missing (the `rdma` feature's
# build needs them). CARGO_TARGET_DIR is honoured. Exit status 0 only if
# every binary passed in the guest.
set -euo pipefail
cd "$(dirname "$0")/.."

bench=0
old_ferry=
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1 ;;
    --old-ferry) old_ferry=$(realpath "${2:?--old-ferry needs a path}"); shift ;;
    *) echo "usage: $0 [--bench] [--old-ferry PATH]" >&2; exit 2 ;;
  esac
  shift
done

# bindgen dlopens libclang.so itself (libclang-dev); libclang-cpp*.so or
# libclang.so.1 from other packages do not count.
has_libclang() {
  local f
  for f in /usr/lib/llvm-*/lib/libclang.so /usr/lib/*-linux-gnu/libclang.so /usr/lib/libclang.so; do
    [ -e "$f" ] && return 0
  done
  return 1
}
need=()
command -v cmake >/dev/null || need+=(cmake)
has_libclang || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "verbs-tests: installing ${need[*]}"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

echo "verbs-tests: building the test binaries (cargo test -p ferry-verbs --features rdma --no-run)"
mapfile -t bins < <(cargo test -p ferry-verbs --features rdma --no-run --message-format=json \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | grep -v '/examples/')
[ ${#bins[@]} -gt 0 ] || { echo "verbs-tests: no test binaries were built" >&2; exit 1; }

# The multi engine over verbs and TCP (issue 45): ferry's tests/multi_verbs.rs,
# which takes the link under rxe0 down in the guest (FERRY_TEST_BREAK_LINK=1
# below; never set it on a machine whose links matter).
echo "verbs-tests: building the multi engine's verbs test (cargo test -p ferry --features verbs --test multi_verbs --no-run)"
mapfile -t -O ${#bins[@]} bins < <(cargo test -p ferry --features verbs --test multi_verbs --no-run \
  --message-format=json | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')

if [ "$bench" -eq 1 ]; then
  echo "verbs-tests: building the verbs_bench example (release)"
  mapfile -t -O ${#bins[@]} bins < <(cargo build -p ferry-verbs --features rdma --release \
    --example verbs_bench --message-format=json | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
  echo "verbs-tests: building the multi_verbs_bench example (release)"
  mapfile -t -O ${#bins[@]} bins < <(cargo build -p ferry --features verbs --release \
    --example multi_verbs_bench --message-format=json | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
fi

old_env=
if [ -n "$old_ferry" ]; then
  [ -x "$old_ferry" ] || { echo "verbs-tests: $old_ferry is not an executable" >&2; exit 2; }
  # In the guest it runs once as `--version` (the line names its build) and
  # is then driven by tests/versions.rs.
  bins+=("$old_ferry::--version")
  old_env="FERRY_VERBS_OLD_FERRY=/t/$(basename "$old_ferry")"
fi

printf 'verbs-tests: %s\n' "${bins[@]}"
# One test at a time: the guest has few vCPUs and TCG is slow. In the guest
# the verbs backend is required: a test that finds it unavailable fails.
W=$(realpath -m "${RXE_VM_DIR:-/var/tmp/ferry-rxe-vm}")
rm -f "$W/guest.log"
RXE_VM_ARGS="${RXE_VM_ARGS:---test-threads=1}" \
  RXE_VM_ENV="FERRY_REQUIRE_BACKENDS=verbs FERRY_TEST_BREAK_LINK=1 $old_env ${RXE_VM_ENV:-}" \
  scripts/rxe-vm.sh "${bins[@]}"

# A green run must have run verbs tests for real: some tests passed in the
# guest, and none reported the backend unavailable.
passed=$(awk '/^test result: ok\./ {n += $4} END {print n + 0}' "$W/guest.log")
unavailable=$(grep -c 'verbs backend is unavailable' "$W/guest.log" || true)
echo "verbs-tests: ${passed:-0} tests passed in the guest, $unavailable reported the backend unavailable"
if [ "${passed:-0}" -eq 0 ] || [ "$unavailable" -ne 0 ]; then
  echo "verbs-tests: the guest ran no verbs test for real" >&2
  exit 1
fi
