#!/usr/bin/env bash
# Fetches the Prometheus Operator's PodMonitor, ServiceMonitor and PrometheusRule CRDs from
# the Go module proxy, once per machine, so the chart's monitors and alerts are checked against the
# real schemas on the test API server. The module is pinned by version and checksum.
#
# Usage: tools/k8s-testenv/monitoring-crds.sh   last stdout line = the directory of the CRDs
# Environment: LOPA_TESTENV_CACHE (cache root, as build.sh).
set -euo pipefail

CRDS=example/prometheus-operator-crd
exec "$(dirname "$0")/module-files.sh" prometheus-operator-crds \
  github.com/prometheus-operator/prometheus-operator v0.85.0 \
  "h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s=" \
  "$CRDS/monitoring.coreos.com_podmonitors.yaml=monitoring.coreos.com_podmonitors.yaml" \
  "$CRDS/monitoring.coreos.com_servicemonitors.yaml=monitoring.coreos.com_servicemonitors.yaml" \
  "$CRDS/monitoring.coreos.com_prometheusrules.yaml=monitoring.coreos.com_prometheusrules.yaml"
