{{/* "<release>-pagoda" (or fullnameOverride), the prefix of every object name. */}}
{{- define "pagoda.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagoda.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router"). */}}
{{- define "pagoda.selectorLabels" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pagoda.componentLabels" -}}
{{ include "pagoda.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pagoda.image" -}}
{{ printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) | quote }}
{{- end -}}

{{/* The worker's image: the GPU build (Dockerfile.cuda, tag suffix -cuda) when worker.device is cuda. */}}
{{- define "pagoda.workerImage" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if eq (.Values.worker.device | default "cpu") "cuda" -}}
{{ printf "%s:%s-cuda" .Values.image.repository $tag | quote }}
{{- else -}}
{{ printf "%s:%s" .Values.image.repository $tag | quote }}
{{- end -}}
{{- end -}}

{{- define "pagoda.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Stable names of the headless Services and their in-cluster DNS suffix. */}}
{{- define "pagoda.workerService" -}}{{ include "pagoda.fullname" . }}-worker{{- end -}}
{{- define "pagoda.kvstoreService" -}}{{ include "pagoda.fullname" . }}-kvstore{{- end -}}
{{- define "pagoda.etcdService" -}}{{ include "pagoda.fullname" . }}-etcd{{- end -}}
{{- define "pagoda.svcSuffix" -}}{{ .Release.Namespace }}.svc{{- end -}}

{{/* The model file's path inside the containers. */}}
{{- define "pagoda.modelPath" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.file -}}
{{- end -}}

{{/* The models volume: an emptyDir filled by the init container, or an existing claim. */}}
{{- define "pagoda.modelVolume" -}}
- name: models
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.fetch.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "pagoda.modelMount" -}}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end -}}

{{/* The init container that fetches the model into the emptyDir (source: fetch); nothing for source: pvc. */}}
{{- define "pagoda.modelInit" -}}
{{- if eq .Values.model.source "fetch" }}
- name: fetch-model
  image: {{ include "pagoda.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    {{- range .Values.model.fetch.command }}
    - {{ . | quote }}
    {{- end }}
    - {{ .Values.model.mountPath | quote }}
  env:
    - name: HOME
      value: /tmp
    - name: PIP_NO_CACHE_DIR
      value: "1"
    - name: PIP_DISABLE_PIP_VERSION_CHECK
      value: "1"
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    {{- toYaml .Values.model.fetch.resources | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: {{ .Values.model.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}

{{/* Etcd client endpoints: the bundled members or the external ones, comma-separated: every component's
     --etcd (they register there with 10 s leases; routers follow the registered workers). */}}
{{- define "pagoda.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "bundled" -}}
{{- $svc := include "pagoda.etcdService" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "http://%s-%d.%s.%s:%d" $svc $i $svc (include "pagoda.svcSuffix" $) (int $.Values.etcd.clientPort)) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/* A PodDisruptionBudget: (dict "ctx" $ "component" "router" "spec" (dict "minAvailable" 1)). */}}
{{- define "pagoda.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "pagoda.fullname" .ctx }}-{{ .component }}
  labels:
    {{- include "pagoda.componentLabels" . | nindent 4 }}
spec:
  {{- toYaml .spec | nindent 2 }}
  selector:
    matchLabels:
      {{- include "pagoda.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/* Scheduling keys shared by every pod spec: (the component's values). */}}
{{- define "pagoda.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A storage quantity of the form the schema allows (N with Mi, Gi or Ti) in MiB. */}}
{{- define "pagoda.quantityMiB" -}}
{{- $q := toString . -}}
{{- if hasSuffix "Ti" $q -}}{{ mul (trimSuffix "Ti" $q | int64) 1048576 }}
{{- else if hasSuffix "Gi" $q -}}{{ mul (trimSuffix "Gi" $q | int64) 1024 }}
{{- else if hasSuffix "Mi" $q -}}{{ trimSuffix "Mi" $q | int64 }}
{{- else -}}{{ fail (printf "storage size %q: use Mi, Gi or Ti" $q) }}
{{- end -}}
{{- end -}}

{{/* The kvstore voters' gRPC addresses, comma-separated: the workers' and routers' --kvstore. */}}
{{- define "pagoda.kvstoreEndpoints" -}}
{{- $svc := include "pagoda.kvstoreService" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.kvstore.replicas) -}}
{{- $eps = append $eps (printf "%s-%d.%s.%s:%d" $svc $i $svc (include "pagoda.svcSuffix" $) (int $.Values.kvstore.port)) -}}
{{- end -}}
{{- join "," $eps -}}
{{- end -}}

{{/* Mutual TLS between components (tls.enabled): the flags, the mount and the volume of the certificate Secret
     (cert-manager's layout: tls.crt, tls.key, ca.crt). Nothing when TLS is off. */}}
{{- define "pagoda.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert={{ .Values.tls.mountPath }}/tls.crt
- --tls-key={{ .Values.tls.mountPath }}/tls.key
- --tls-ca={{ .Values.tls.mountPath }}/ca.crt
{{- end }}
{{- end -}}

{{- define "pagoda.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pagoda.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- end -}}
