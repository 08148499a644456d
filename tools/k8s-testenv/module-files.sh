#!/usr/bin/env bash
# Copies files out of one Go module, fetched from the Go module proxy pinned by version and
# checksum, into the test environment's cache, once per machine.
#
# Usage: module-files.sh NAME MODULE VERSION SUM SRC=DEST...
#   NAME     the cache folder's name (the version is appended) and the log prefix
#   SUM      go.sum's hash of the module zip (h1:...)
#   SRC=DEST a file of the module, and its name in the cache folder
# The last stdout line is the cache folder. Environment: LOPA_TESTENV_CACHE (cache root, as build.sh).
set -euo pipefail

NAME=$1 MODULE=$2 VERSION=$3 SUM=$4
shift 4
OUT="${LOPA_TESTENV_CACHE:-$HOME/.cache/lopa-testenv}/$NAME-$VERSION"

present() {
  local pair
  for pair in "$@"; do [[ -s "$OUT/${pair#*=}" ]] || return 1; done
}

if ! present "$@"; then
  command -v go >/dev/null || { echo "$NAME: 'go' is not on PATH" >&2; exit 2; }
  echo "[$NAME] fetching $MODULE@$VERSION from the Go module proxy" >&2
  tmp="$(mktemp -d)"
  trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
  info="$(cd "$tmp" && GOPATH="$tmp/gopath" GOTOOLCHAIN=local GOFLAGS=-modcacherw \
    go mod download -json "$MODULE@$VERSION")"
  got="$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",*$/\1/p' <<<"$info")"
  dir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p' <<<"$info")"
  if [[ "$got" != "$SUM" ]]; then
    echo "$NAME: $MODULE@$VERSION has checksum '$got', expected $SUM" >&2
    exit 1
  fi
  rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"
  for pair in "$@"; do cp "$dir/${pair%%=*}" "$OUT.tmp/${pair#*=}"; done
  rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
fi
echo "$OUT"
