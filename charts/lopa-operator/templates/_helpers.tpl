{{/* Full name of the release's objects (truncated to a DNS label). */}}
{{- define "lopa-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lopa-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "lopa-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "lopa-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "lopa-operator.labels" -}}
{{ include "lopa-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lopa
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The namespaces the operator watches (a JSON list; unused with watchAllNamespaces): the listed
ones, else the release's own. */}}
{{- define "lopa-operator.namespaces" -}}
{{- toJson (.Values.watchNamespaces | default (list .Release.Namespace)) -}}
{{- end -}}

{{/* Cluster-scoped resources the operator reads, bound cluster-wide whatever the watch scope. The
operator reads none (kopf's CRD and namespace scanning is off; every call it makes is namespaced):
empty, so a namespaced install has no ClusterRole of the operator's at all. */}}
{{- define "lopa-operator.clusterScopedRules" -}}
{{- end -}}

{{/* The namespaced rules the operator needs, and nothing more (see operator/lopa_operator/kube.py). */}}
{{- define "lopa-operator.rules" -}}
# LoPADeployments: watched by kopf, annotated/finalized by kopf, status written by the operator.
- apiGroups: [lopa.dev]
  resources: [lopadeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [lopa.dev]
  resources: [lopadeployments/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion.
- apiGroups: [lopa.dev]
  resources: [lopadeployments/finalizers]
  verbs: [update]
# Children are server-side applied (patch; create when missing), each read first (get) when its
# rendering is new, so that an object of the same name that the CR does not control is never taken
# over. A group's ConfigMap, StatefulSet and Deployment are listed to see what each group runs, and
# deleted on scale-down.
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch, list, delete]
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, create, patch, list, delete]
# Each group's Secret (its shared secret and link certificates) is read back by name every resync and
# deleted with its group; never listed or watched. The NetworkPolicy and, with spec.inferencePool,
# the InferencePool are deleted when the spec turns them off.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
# spec.scheduling.gang: Workload: the deployment's Workload and each group's PodGroup, applied like the
# children above; PodGroups are listed to delete those no group and no pod names any more.
- apiGroups: [scheduling.k8s.io]
  resources: [workloads]
  verbs: [get, create, patch, delete]
- apiGroups: [scheduling.k8s.io]
  resources: [podgroups]
  verbs: [get, create, patch, list, delete]
# spec.scheduling.gang: Kueue: the LocalQueue named must exist, and a waiting group's Kueue Workload
# says why it waits (read only).
- apiGroups: [kueue.x-k8s.io]
  resources: [localqueues, workloads]
  verbs: [get]
# Worker pods are observed for group health and deleted to recreate or roll the group.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, delete]
# Kubernetes events about LoPADeployments (kopf and the operator).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
