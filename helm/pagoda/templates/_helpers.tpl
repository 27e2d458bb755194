{{- define "pagoda.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagoda.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Fetches the model into the shared volume unless it is already there. */}}
{{- define "pagoda.modelInit" -}}
- name: fetch-model
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["/app/scripts/fetch-model.sh", "{{ dir .Values.model.path }}"]
  volumeMounts:
    - name: models
      mountPath: {{ dir .Values.model.path }}
{{- end -}}
