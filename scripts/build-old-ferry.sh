#!/usr/bin/env bash
# build-old-ferry.sh COMMIT [CARGO FEATURE ARGS...] — builds `ferry` (the
# ferry-cli binary) of an older commit of this repository, for the
# cross-version tests, and prints its path. The source (git archive) and
# the build live in ${CARGO_TARGET_DIR:-target}/compat/COMMIT-TAG/, where TAG
# names the feature arguments, and are reused while the binary exists.
#
#   scripts/build-old-ferry.sh 7c3e5e6 --features verbs
#
# Fails (exit 1) when the commit is not in this clone's history.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: $0 COMMIT [FEATURE ARGS...]}; shift
tag=$(printf '%s' "$*" | tr -c 'A-Za-z0-9' '_')
target=$(realpath -m "${CARGO_TARGET_DIR:-target}")
dir="$target/compat/$commit-${tag:-default}"
bin="$dir/target/debug/ferry"
if [ ! -x "$bin" ]; then
  git cat-file -e "$commit^{commit}" 2>/dev/null ||
    { echo "build-old-ferry: $commit is not in this clone's history (shallow clone?)" >&2; exit 1; }
  if [ ! -f "$dir/src/Cargo.toml" ]; then
    mkdir -p "$dir/src"
    git archive --format=tar "$commit" | tar -x -C "$dir/src"
  fi
  echo "build-old-ferry: building ferry at $commit ($*) into $dir (once)" >&2
  (cd "$dir/src" && env -u CARGO_TARGET_DIR -u RUSTFLAGS \
     cargo build --locked -p ferry-cli --bin ferry "$@" --target-dir "$dir/target" >&2)
fi
[ -x "$bin" ] || { echo "build-old-ferry: $bin was not built" >&2; exit 1; }
echo "$bin"
