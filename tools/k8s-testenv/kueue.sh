#!/usr/bin/env bash
# Builds the Kueue controller (sigs.k8s.io/kueue/cmd/kueue) from the Go module proxy, pinned by
# kueue/go.mod and kueue/go.sum, and copies from the same pinned module its CRDs and its webhook
# configurations, once per machine, for the gang scheduling tests (spec.scheduling.gang: Kueue).
#
# The files are cached under ${LOPA_TESTENV_CACHE:-$HOME/.cache/lopa-testenv}/<key>/, where <key>
# names the Kueue version and a hash of kueue/go.mod, kueue/go.sum and RECIPE:
#   kueue                    the controller (manager, webhooks)
#   crds/*.yaml              config/components/crd/bases: the kueue.x-k8s.io CRDs
#   webhooks.yaml            config/components/webhook/manifests.yaml: the admission webhooks
#
# Usage:
#   tools/k8s-testenv/kueue.sh                 build what is missing; last stdout line = the directory
#   tools/k8s-testenv/kueue.sh --print-dir     print the directory (built or not) and exit
#   tools/k8s-testenv/kueue.sh --check         exit 0 if everything is there, 1 if not
# Environment: LOPA_TESTENV_CACHE (cache root), LOPA_TESTENV_JOBS (go build -p, default 2).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODULE=sigs.k8s.io/kueue
VERSION="$(awk -v m="$MODULE" '$1 == "require" && $2 == m { print $3 } $1 == m && $2 ~ /^v/ { print $2 }' \
  "$HERE/kueue/go.mod" | head -n 1)"
[[ -n "$VERSION" ]] || { echo "kueue.sh: could not read the $MODULE version from $HERE/kueue/go.mod" >&2; exit 2; }
RECIPE=1
HASH="$( (echo "recipe $RECIPE"; cat "$HERE/kueue/go.mod" "$HERE/kueue/go.sum") | sha256sum | cut -c1-10)"
CACHE_ROOT="${LOPA_TESTENV_CACHE:-$HOME/.cache/lopa-testenv}"
OUT="$CACHE_ROOT/kueue-${VERSION}_$HASH"
CRDS=(admissionchecks clusterqueues cohorts localqueues multikueueclusters multikueueconfigs
      provisioningrequestconfigs resourceflavors topologies workloadpriorityclasses workloads)

all_present() {
  [[ -x "$OUT/kueue" && -s "$OUT/webhooks.yaml" ]] || return 1
  local c
  for c in "${CRDS[@]}"; do [[ -s "$OUT/crds/kueue.x-k8s.io_$c.yaml" ]] || return 1; done
}

case "${1:-}" in
  --print-dir) echo "$OUT"; exit 0 ;;
  --check) all_present; exit $? ;;
  "") ;;
  *) echo "usage: $0 [--print-dir|--check]" >&2; exit 2 ;;
esac

log() { printf '[kueue %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if all_present; then
  log "present in $OUT"
  echo "$OUT"
  exit 0
fi
command -v go >/dev/null || { echo "kueue.sh: 'go' is not on PATH" >&2; exit 2; }
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
if ! flock -n 9; then
  log "another build holds $OUT/.lock; waiting for it"
  flock 9
fi
if all_present; then
  echo "$OUT"
  exit 0
fi

export GOFLAGS="-trimpath" CGO_ENABLED=0 GOTOOLCHAIN=local
JOBS="${LOPA_TESTENV_JOBS:-2}"
start=$SECONDS
if [[ ! -x "$OUT/kueue" ]]; then
  log "go build kueue $VERSION with $(go version | awk '{print $3}'), -p $JOBS ..."
  tmp="$(mktemp -d "$OUT/.build.XXXXXX")"
  (cd "$HERE/kueue" && go build -p "$JOBS" \
    -ldflags "-s -w -X $MODULE/pkg/version.GitVersion=$VERSION -X $MODULE/pkg/version.GitCommit=" \
    -o "$tmp/kueue" "$MODULE/cmd/kueue")
  mv -f "$tmp/kueue" "$OUT/kueue"
  rm -rf "$tmp"
  log "built kueue in $((SECONDS - start))s"
fi
# The module's own files (CRDs, webhooks): `go list -m` names its directory only once it is in the
# module cache, which a fresh machine's is not until it is downloaded.
source_dir="$(cd "$HERE/kueue" && go mod download "$MODULE" && go list -m -f '{{.Dir}}' "$MODULE")"
[[ -d "$source_dir/config/components" ]] || {
  echo "kueue.sh: $MODULE $VERSION has no config/components in the module cache ($source_dir)" >&2; exit 1; }
rm -rf "$OUT/crds.tmp" && mkdir -p "$OUT/crds.tmp"
for c in "${CRDS[@]}"; do
  cp "$source_dir/config/components/crd/bases/kueue.x-k8s.io_$c.yaml" "$OUT/crds.tmp/"
done
chmod -R u+w "$OUT/crds.tmp"
rm -rf "$OUT/crds" && mv "$OUT/crds.tmp" "$OUT/crds"
cp "$source_dir/config/components/webhook/manifests.yaml" "$OUT/webhooks.yaml.tmp"
chmod u+w "$OUT/webhooks.yaml.tmp" && mv -f "$OUT/webhooks.yaml.tmp" "$OUT/webhooks.yaml"
all_present || { echo "kueue.sh: files missing from $OUT" >&2; exit 1; }
log "done in $((SECONDS - start))s: $OUT"
echo "$OUT"
