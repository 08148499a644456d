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

exec "$(dirname "$0")/module-files.sh" inference-extension-crds \
  sigs.k8s.io/gateway-api-inference-extension v1.3.1 \
  "h1:Tpjo2frgcdUUeqPWcIWter2a7GCHBrNyYBkK1Em1u+8=" \
  "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml=inference.networking.k8s.io_inferencepools.yaml" \
  "pkg/epp/server/options.go=epp-options.go"
