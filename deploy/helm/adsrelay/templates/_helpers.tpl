{{/*
app.kubernetes.io/name: always the chart's name, "adsrelay" (no nameOverride): it is in the
selectors, and the ServiceMonitor makes it the `job` label the alerts select (up{job="adsrelay"}).
*/}}
{{- define "adsrelay.name" -}}
{{- .Chart.Name }}
{{- end }}

{{/*
Object names: the release name, or <release>-adsrelay when the release name does not contain the
chart's name; fullnameOverride wins. `helm install adsrelay ...` gives the names the kustomize base
uses (adsrelay, adsrelay-admin, adsrelay-config).
*/}}
{{- define "adsrelay.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := .Chart.Name }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "adsrelay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: the Deployment's selector (immutable), the Services', the PodDisruptionBudget's,
the NetworkPolicy's and the topology spread constraints'. The same as the kustomize base's, so a
region can move between the two without recreating its Deployment.
*/}}
{{- define "adsrelay.selectorLabels" -}}
app.kubernetes.io/component: xds-relay
app.kubernetes.io/name: {{ include "adsrelay.name" . }}
app.kubernetes.io/part-of: adsrelay
{{- end }}

{{/*
Labels of every object: the kustomize base's, Helm's own, and the region (the ServiceMonitor copies
the pods' region label onto every series).
*/}}
{{- define "adsrelay.labels" -}}
app.kubernetes.io/name: {{ include "adsrelay.name" . }}
app.kubernetes.io/part-of: adsrelay
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "adsrelay.chart" . }}
{{- with .Values.region }}
region: {{ . | quote }}
{{- end }}
{{- end }}

{{/*
relay.toml from .Values.config (keys: docs/configure.md): one `key = value` line per key, in key
order; strings, numbers, booleans and arrays of them (JSON's spelling of those is TOML's). Tables
([[groups]], [[tls_authorization]]) go in .Values.extraConfig, appended verbatim.
*/}}
{{- define "adsrelay.relayToml" -}}
# adsrelay config (keys: docs/configure.md; flags override them), rendered by the adsrelay Helm
# chart from its values `config` and `extraConfig`.
{{- range $key, $value := .Values.config }}
{{- if not (kindIs "invalid" $value) }}
{{- if kindIs "map" $value }}
{{- fail (printf "config.%s is a table: write tables in extraConfig (TOML)" $key) }}
{{- end }}
{{- if kindIs "slice" $value }}
{{- range $value }}
{{- if or (kindIs "map" .) (kindIs "slice" .) }}
{{- fail (printf "config.%s holds tables or nested arrays: write them in extraConfig (TOML)" $key) }}
{{- end }}
{{- end }}
{{- end }}
{{ $key }} = {{ toJson $value }}
{{- end }}
{{- end }}
{{- with .Values.extraConfig }}
{{ . }}
{{- end }}
{{- end }}
