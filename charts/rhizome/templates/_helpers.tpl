{{- define "rhizome.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Every platform pod carries app.kubernetes.io/name=rhizome: the learners' NetworkPolicy
admits exactly the pods with that label (RHIZOME_K8S_PLATFORM_LABELS). */}}
{{- define "rhizome.selector" -}}
app.kubernetes.io/name: rhizome
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rhizome.labels" -}}
{{ include "rhizome.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rhizome.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "rhizome.etcdUrl" -}}
{{- if .Values.etcd.bundled -}}
http://{{ include "rhizome.fullname" . }}-etcd:2379
{{- else -}}
{{ required "etcd.external is required when etcd.bundled is false" .Values.etcd.external }}
{{- end -}}
{{- end -}}

{{- define "rhizome.elasticsearchUrl" -}}
{{- if .Values.elasticsearch.bundled -}}
http://{{ include "rhizome.fullname" . }}-elasticsearch:9200
{{- else -}}
{{ required "elasticsearch.url is required when elasticsearch.bundled is false" .Values.elasticsearch.url }}
{{- end -}}
{{- end -}}

{{- define "rhizome.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "rhizome.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
