#!/usr/bin/env bash
# Fetches KEDA's ScaledObject CRD (keda.sh/v1alpha1) from the Go module proxy, once per machine, so
# the KEDA sample (manifests/samples/keda.yaml) is checked against the real schema on the test API
# server; beside it the Prometheus scaler's source, whose metadata keys the sample's trigger is
# checked against. The module is pinned by version and checksum.
#
# Usage: tools/k8s-testenv/keda-crds.sh   last stdout line = the directory of the CRD
# Environment: LOPA_TESTENV_CACHE (cache root, as build.sh).
set -euo pipefail

exec "$(dirname "$0")/module-files.sh" keda-crds \
  github.com/kedacore/keda/v2 v2.21.0 \
  "h1:R6z2HZvstK4RLUMxroNACzBj74xGxt3kG59b5Xc+Xps=" \
  "config/crd/bases/keda.sh_scaledobjects.yaml=keda.sh_scaledobjects.yaml" \
  "pkg/scalers/prometheus_scaler.go=prometheus_scaler.go"
