#!/usr/bin/env bash
# Builds the community benchmark clients (inference-perf, guidellm) into their own venvs, from PyPI,
# once per machine. They need Python >= 3.12 and heavy dependencies, so they never enter lopa's own
# .venv (Python 3.11).
#
# Each venv is cached under ${LOPA_BENCH_CLIENTS_CACHE:-$HOME/.cache/lopa-bench-clients}/<key>, where
# <key> names the client, its pinned version, the Python minor version and a hash of its lock file
# (tools/bench-clients/<client>.txt: every package at an exact version), so a bump builds a fresh
# venv and a second run finds the finished one (a `.complete` stamp) and returns at once.
#
# Usage:
#   tools/bench-clients/setup.sh [CLIENT...]              build what is missing (default: both)
#   tools/bench-clients/setup.sh --print-dir [CLIENT...]  print the venv dirs (built or not), exit
#   tools/bench-clients/setup.sh --check [CLIENT...]      exit 0 if every venv is complete, 1 if not
# CLIENT: inference-perf | guidellm.
#
# stdout carries only "<client> <venv dir>" lines (one per client); progress goes to stderr.
# Exit status: 0 done, 1 an install failed, 2 usage, 3 no Python >= 3.12 found or installable.
# Environment: LOPA_BENCH_CLIENTS_CACHE (cache root), LOPA_BENCH_PYTHON (the interpreter to use).
#
# Cost on a 2-core VM with a fast PyPI mirror: inference-perf 0.7.0 ~35 s, 0.8 GB;
# guidellm 0.8.1 ~95 s, 5.9 GB (it requires torch, whose Linux wheels pull the CUDA libraries).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLIENTS_KNOWN=(inference-perf guidellm)
RECIPE=1  # bump when the build steps below change in a way that must rebuild cached venvs

log() { printf '[bench-clients %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

mode=build
clients=()
for arg in "$@"; do
  case "$arg" in
    --print-dir) mode=print ;;
    --check) mode=check ;;
    inference-perf|guidellm) clients+=("$arg") ;;
    *) echo "usage: $0 [--print-dir|--check] [inference-perf|guidellm ...]" >&2; exit 2 ;;
  esac
done
[[ ${#clients[@]} -gt 0 ]] || clients=("${CLIENTS_KNOWN[@]}")

# A Python >= 3.12: LOPA_BENCH_PYTHON, else python3.12 / python3.13 / python3 on PATH, else pyenv's
# installed versions (3.12 first: the version the lock files were made with).
is_new_enough() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local candidates=()
  [[ -n "${LOPA_BENCH_PYTHON:-}" ]] && candidates+=("$LOPA_BENCH_PYTHON")
  local name path
  for name in python3.12 python3.13 python3.14 python3; do
    path="$(command -v "$name" 2>/dev/null || true)"
    [[ -n "$path" ]] && candidates+=("$path")
  done
  if command -v pyenv >/dev/null 2>&1; then
    local root
    root="$(pyenv root)"
    for path in "$root"/versions/3.12*/bin/python3 "$root"/versions/3.1[3-9]*/bin/python3; do
      [[ -x "$path" ]] && candidates+=("$path")
    done
  fi
  for path in "${candidates[@]}"; do
    if is_new_enough "$path"; then
      echo "$path"
      return 0
    fi
  done
  return 1
}

PYTHON="$(find_python || true)"
if [[ -z "$PYTHON" && "$mode" == build ]] && command -v pyenv >/dev/null 2>&1; then
  log "no Python >= 3.12 found: trying 'pyenv install -s 3.12' (compiles CPython, several minutes)"
  if pyenv install -s 3.12 >&2; then
    PYTHON="$(find_python || true)"
  fi
fi
if [[ -z "$PYTHON" ]]; then
  log "no Python >= 3.12 found (tried LOPA_BENCH_PYTHON, python3.12/3.13/3.14/python3 on PATH, pyenv versions)"
  exit 3
fi
PY_MINOR="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
CACHE_ROOT="${LOPA_BENCH_CLIENTS_CACHE:-$HOME/.cache/lopa-bench-clients}"

venv_dir() {
  local client="$1" lock="$HERE/$1.txt" version hash
  version="$(awk -F'==' -v c="$client" 'tolower($1) == c { print $2 }' "$lock")"
  hash="$( (echo "recipe $RECIPE"; cat "$lock") | sha256sum | cut -c1-10)"
  echo "$CACHE_ROOT/${client}-${version}_py${PY_MINOR}_${hash}"
}

build() {
  local client="$1" dir="$2" start size
  if [[ -f "$dir/.complete" ]]; then
    log "$client: present in $dir"
    return 0
  fi
  start=$(date +%s)
  log "$client: building $dir with $PYTHON (Python $PY_MINOR) from $HERE/$client.txt"
  rm -rf "$dir"
  mkdir -p "$CACHE_ROOT"
  "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --upgrade pip >&2
  # The lock file pins every package, so the resolver has nothing to choose.
  "$dir/bin/python" -m pip install --progress-bar off --requirement "$HERE/$client.txt" >&2
  "$dir/bin/python" -m pip check >&2
  size="$(du -sm "$dir" | cut -f1)"
  touch "$dir/.complete"
  log "$client: built in $(( $(date +%s) - start )) s, ${size} MB"
}

status=0
for client in "${clients[@]}"; do
  dir="$(venv_dir "$client")"
  case "$mode" in
    print) ;;
    check) [[ -f "$dir/.complete" ]] || status=1 ;;
    build) build "$client" "$dir" || { log "$client: install failed"; exit 1; } ;;
  esac
  echo "$client $dir"
done
exit "$status"
