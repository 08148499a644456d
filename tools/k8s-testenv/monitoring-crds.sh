#!/usr/bin/env bash
# Fetches the Prometheus Operator's PodMonitor, ServiceMonitor and PrometheusRule CRDs from
# the Go module proxy, once per machine, so the chart's monitors and alerts are checked against the
# real schemas on the test API server. The module is pinned by version and checksum.
#
# Usage: tools/k8s-testenv/monitoring-crds.sh   last stdout line = the directory of the CRDs
# Environment: LOPA_TESTENV_CACHE (cache root, as build.sh).
set -euo pipefail

VERSION=v0.85.0
SUM="h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s="  # go.sum's hash of the module zip
MODULE=github.com/prometheus-operator/prometheus-operator
CRDS=(monitoring.coreos.com_podmonitors.yaml monitoring.coreos.com_servicemonitors.yaml
      monitoring.coreos.com_prometheusrules.yaml)
OUT="${LOPA_TESTENV_CACHE:-$HOME/.cache/lopa-testenv}/prometheus-operator-crds-$VERSION"

present() {
  local f
  for f in "${CRDS[@]}"; do [[ -s "$OUT/$f" ]] || return 1; done
}

if ! present; then
  command -v go >/dev/null || { echo "monitoring-crds.sh: 'go' is not on PATH" >&2; exit 2; }
  echo "[monitoring-crds] fetching $MODULE@$VERSION from the Go module proxy" >&2
  tmp="$(mktemp -d)"
  trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
  info="$(cd "$tmp" && GOPATH="$tmp/gopath" GOTOOLCHAIN=local GOFLAGS=-modcacherw \
    go mod download -json "$MODULE@$VERSION")"
  got="$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",*$/\1/p' <<<"$info")"
  dir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p' <<<"$info")"
  if [[ "$got" != "$SUM" ]]; then
    echo "monitoring-crds.sh: $MODULE@$VERSION has checksum '$got', expected $SUM" >&2
    exit 1
  fi
  rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"
  for f in "${CRDS[@]}"; do cp "$dir/example/prometheus-operator-crd/$f" "$OUT.tmp/$f"; done
  rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
fi
echo "$OUT"
