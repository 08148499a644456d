#!/usr/bin/env bash
# Builds the Kubernetes test control plane (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, kwok, helm) from the Go module proxy, once per machine.
#
# The binaries are cached under ${LOPA_TESTENV_CACHE:-$HOME/.cache/lopa-testenv}/<key>/bin,
# where <key> names every pinned version (and a hash of the go.mod/go.sum files), so a
# version bump builds into a fresh directory while a second run finds everything and
# returns at once.
#
# Usage:
#   tools/k8s-testenv/build.sh                 build what is missing; last stdout line = bin dir
#   tools/k8s-testenv/build.sh --print-bin-dir print the bin dir (built or not) and exit
#   tools/k8s-testenv/build.sh --check         exit 0 if every binary is present, 1 if not
#
# Progress goes to stderr; stdout carries only the bin dir, so callers can capture it.
# Environment: LOPA_TESTENV_CACHE (cache root), LOPA_TESTENV_JOBS (go build -p, default 2).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Reads the required version of a module from one of the tools modules' go.mod.
module_version() {
  local dir="$1" module="$2"
  awk -v m="$module" '$1 == "require" && $2 == m { print $3 } $1 == m && NF >= 2 && $2 ~ /^v/ { print $2 }' \
    "$HERE/$dir/go.mod" | head -n 1
}

K8S_VERSION="$(module_version kubernetes k8s.io/kubernetes)"
ETCD_VERSION="$(module_version etcd go.etcd.io/etcd/server/v3)"
KWOK_VERSION="$(module_version kwok sigs.k8s.io/kwok)"
HELM_VERSION="$(module_version helm helm.sh/helm/v3)"
for v in K8S_VERSION ETCD_VERSION KWOK_VERSION HELM_VERSION; do
  if [[ -z "${!v}" ]]; then
    echo "build.sh: could not read $v from $HERE/*/go.mod" >&2
    exit 2
  fi
done

# Any edit to the pinned module graph changes the key; bump RECIPE when the build flags
# below change in a way that must rebuild the cached binaries. Only this script's modules count
# (kueue/ is kueue.sh's, cached on its own).
RECIPE=1
MODULES=(etcd helm kubernetes kwok)
CONTENT_HASH="$( (echo "recipe $RECIPE"; for m in "${MODULES[@]}"; do cat "$HERE/$m/go.mod"; done
  for m in "${MODULES[@]}"; do cat "$HERE/$m/go.sum"; done) | sha256sum | cut -c1-10)"
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}_${CONTENT_HASH}"
CACHE_ROOT="${LOPA_TESTENV_CACHE:-$HOME/.cache/lopa-testenv}"
BIN_DIR="$CACHE_ROOT/$KEY/bin"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm)
# kwok has no built-in stages when run on its own (kwokctl passes them in), so its
# default "fast" stages are taken from the pinned kwok module into this config file.
KWOK_STAGES="kwok-stages.yaml"
KWOK_STAGE_FILES=(
  kustomize/stage/node/fast/node-initialize.yaml
  kustomize/stage/node/heartbeat/node-heartbeat.yaml
  kustomize/stage/pod/fast/pod-ready.yaml
  kustomize/stage/pod/fast/pod-complete.yaml
  kustomize/stage/pod/fast/pod-delete.yaml
)

all_present() {
  local b
  for b in "${BINARIES[@]}"; do
    [[ -x "$BIN_DIR/$b" ]] || return 1
  done
  [[ -s "$BIN_DIR/$KWOK_STAGES" ]]
}

case "${1:-}" in
  --print-bin-dir) echo "$BIN_DIR"; exit 0 ;;
  --check) all_present; exit $? ;;
  "") ;;
  *) echo "usage: $0 [--print-bin-dir|--check]" >&2; exit 2 ;;
esac

log() { printf '[k8s-testenv %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if all_present; then
  log "all binaries present in $BIN_DIR"
  echo "$BIN_DIR"
  exit 0
fi

command -v go >/dev/null || { echo "build.sh: 'go' is not on PATH" >&2; exit 2; }
mkdir -p "$BIN_DIR"

# One build at a time per cache key: concurrent pytest or make runs wait here
# instead of compiling the same thing twice on a 2-core machine.
exec 9>"$CACHE_ROOT/$KEY/.lock"
if ! flock -n 9; then
  log "another build holds $CACHE_ROOT/$KEY/.lock; waiting for it"
  flock 9
fi
if all_present; then
  log "all binaries present in $BIN_DIR (built by the other process)"
  echo "$BIN_DIR"
  exit 0
fi

export GOFLAGS="-trimpath"
export CGO_ENABLED=0      # static binaries, like the upstream release builds of the servers
export GOTOOLCHAIN=local  # never try to download another toolchain (no network for that)
JOBS="${LOPA_TESTENV_JOBS:-2}"
BUILD_START=$SECONDS
log "building into $BIN_DIR with $(go version | awk '{print $3}'), -p $JOBS"

# build <module dir> <ldflags> <binary=package>...: builds the missing binaries of one
# tools module with a single `go build` (shared compilation), into a temp dir first so
# an interrupted build never leaves a half-written binary in the cache.
build() {
  local dir="$1" ldflags="$2"
  shift 2
  local -a names=() packages=()
  local spec
  for spec in "$@"; do
    local name="${spec%%=*}" package="${spec#*=}"
    if [[ -x "$BIN_DIR/$name" ]]; then
      log "  $name: cached"
    else
      names+=("$name")
      packages+=("$package")
    fi
  done
  [[ ${#names[@]} -gt 0 ]] || return 0
  local tmp start=$SECONDS
  tmp="$(mktemp -d "$CACHE_ROOT/$KEY/.build.XXXXXX")"
  log "  go build ${names[*]} ..."
  if [[ ${#names[@]} -eq 1 ]]; then
    (cd "$HERE/$dir" && go build -p "$JOBS" -ldflags "$ldflags" -o "$tmp/${names[0]}" "${packages[0]}")
  else
    (cd "$HERE/$dir" && go build -p "$JOBS" -ldflags "$ldflags" -o "$tmp/" "${packages[@]}")
  fi
  local i
  for i in "${!names[@]}"; do
    # `go build -o dir/` names a binary after the last element of its package path.
    local built="$tmp/${names[$i]}"
    [[ -f "$built" ]] || built="$tmp/$(basename "${packages[$i]}")"
    mv -f "$built" "$BIN_DIR/${names[$i]}"
  done
  rm -rf "$tmp"
  log "  built ${names[*]} in $((SECONDS - start))s"
}

# Version stamps, as hack/lib/version.sh sets them for release builds, so /version and
# `kubectl version` report the real release. The module proxy carries no git commit,
# so gitCommit stays empty; the build date is the release's proxy timestamp, which keeps
# the binaries reproducible.
K8S_MAJOR="${K8S_VERSION#v}"; K8S_MAJOR="${K8S_MAJOR%%.*}"
K8S_MINOR="${K8S_VERSION#v*.}"; K8S_MINOR="${K8S_MINOR%%.*}"
K8S_BUILD_DATE="$(cd "$HERE/kubernetes" && go list -m -f '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' k8s.io/kubernetes)"
K8S_LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  K8S_LDFLAGS+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$K8S_MAJOR -X $pkg.gitMinor=$K8S_MINOR"
  K8S_LDFLAGS+=" -X $pkg.gitTreeState=clean -X $pkg.gitCommit= -X $pkg.buildDate=$K8S_BUILD_DATE"
done

log "[1/4] Kubernetes $K8S_VERSION"
build kubernetes "$K8S_LDFLAGS" \
  kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler \
  kubectl=k8s.io/kubernetes/cmd/kubectl

log "[2/4] etcd $ETCD_VERSION"
build etcd "-s -w" etcd=go.etcd.io/etcd/server/v3

log "[3/4] kwok $KWOK_VERSION"
build kwok "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=$K8S_VERSION" \
  kwok=sigs.k8s.io/kwok/cmd/kwok

if [[ ! -s "$BIN_DIR/$KWOK_STAGES" ]]; then
  kwok_dir="$(cd "$HERE/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  {
    echo "# kwok $KWOK_VERSION default stages, from ${KWOK_STAGE_FILES[*]}"
    for f in "${KWOK_STAGE_FILES[@]}"; do
      echo "---"
      cat "$kwok_dir/$f"
    done
  } > "$BIN_DIR/$KWOK_STAGES.tmp"
  mv -f "$BIN_DIR/$KWOK_STAGES.tmp" "$BIN_DIR/$KWOK_STAGES"
  log "  wrote $KWOK_STAGES"
fi

log "[4/4] helm $HELM_VERSION"
build helm "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
  helm=helm.sh/helm/v3/cmd/helm

all_present || { echo "build.sh: some binaries are missing from $BIN_DIR" >&2; exit 1; }
log "done in $((SECONDS - BUILD_START))s; binaries:"
ls -l "$BIN_DIR" >&2
echo "$BIN_DIR"
