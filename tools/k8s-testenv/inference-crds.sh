#!/usr/bin/env bash
# Fetches the Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io/v1)
# from the Go module proxy, once per machine, so the InferencePool sample and the operator's pool
# are checked against the real schema on the test API server; beside it the endpoint picker's flag
# definitions (epp-options.go), which the sample's flags are checked against. The module is pinned
# by version and checksum: v1.3.1, the last release whose endpoint picker takes the metric flags.
#
# Usage: tools/k8s-testenv/inference-crds.sh   last stdout line = the directory of the files
# Environment: LOPA_TESTENV_CACHE (cache root, as build.sh).
set -euo pipefail

VERSION=v1.3.1
SUM="h1:Tpjo2frgcdUUeqPWcIWter2a7GCHBrNyYBkK1Em1u+8="  # go.sum's hash of the module zip
MODULE=sigs.k8s.io/gateway-api-inference-extension
CRDS=(inference.networking.k8s.io_inferencepools.yaml)
OUT="${LOPA_TESTENV_CACHE:-$HOME/.cache/lopa-testenv}/inference-extension-crds-$VERSION"

present() {
  local f
  for f in "${CRDS[@]}" epp-options.go; do [[ -s "$OUT/$f" ]] || return 1; done
}

if ! present; then
  command -v go >/dev/null || { echo "inference-crds.sh: 'go' is not on PATH" >&2; exit 2; }
  echo "[inference-crds] fetching $MODULE@$VERSION from the Go module proxy" >&2
  tmp="$(mktemp -d)"
  trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
  info="$(cd "$tmp" && GOPATH="$tmp/gopath" GOTOOLCHAIN=local GOFLAGS=-modcacherw \
    go mod download -json "$MODULE@$VERSION")"
  got="$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",*$/\1/p' <<<"$info")"
  dir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p' <<<"$info")"
  if [[ "$got" != "$SUM" ]]; then
    echo "inference-crds.sh: $MODULE@$VERSION has checksum '$got', expected $SUM" >&2
    exit 1
  fi
  rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"
  for f in "${CRDS[@]}"; do cp "$dir/config/crd/bases/$f" "$OUT.tmp/$f"; done
  cp "$dir/pkg/epp/server/options.go" "$OUT.tmp/epp-options.go"
  rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
fi
echo "$OUT"
