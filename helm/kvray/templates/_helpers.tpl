{{/* Names */}}
{{- define "kvray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RayService names get suffixes from KubeRay (-<hash>, -head-svc, -serve-svc): keep room. */}}
{{- define "kvray.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvray.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvray.labels" -}}
helm.sh/chart: {{ include "kvray.chart" . }}
{{ include "kvray.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Image: the tag defaults to "<appVersion>-ray<rayVersion>"; an explicit tag must name Ray. */}}
{{- define "kvray.image" -}}
{{- $ray := printf "ray%s" .Values.rayVersion }}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $ray) }}
{{- if and (not (contains $ray $tag)) (not .Values.image.allowRayVersionMismatch) }}
{{- fail (printf "image.tag %q does not name rayVersion %s (expected it to contain %q); set image.allowRayVersionMismatch=true if the image really holds Ray %s" $tag .Values.rayVersion $ray .Values.rayVersion) }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* GPUs one model replica needs: TP x PP. */}}
{{- define "kvray.worldSize" -}}
{{- mul (int .Values.model.tensorParallelSize) (int .Values.model.pipelineParallelSize) }}
{{- end }}

{{/* Engine replicas at most / at start: autoscaling's bounds, else numReplicas. */}}
{{- define "kvray.maxReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ int .Values.autoscaling.maxReplicas }}{{ else }}{{ int .Values.model.numReplicas }}{{ end }}
{{- end }}
{{- define "kvray.minReplicas" -}}
{{- if .Values.autoscaling.enabled }}{{ int .Values.autoscaling.minReplicas }}{{ else }}{{ int .Values.model.numReplicas }}{{ end }}
{{- end }}

{{/* GPU worker pods for `replicas` engine replicas: ceil(TP x PP x replicas / gpusPerWorker). */}}
{{- define "kvray.gpuWorkersFor" -}}
{{- $gpus := mul (int (include "kvray.worldSize" .root)) (int .replicas) }}
{{- $per := int .root.Values.gpuWorkers.gpusPerWorker }}
{{- div (add $gpus (sub $per 1)) $per }}
{{- end }}

{{/* GPU worker pods at most (the group's maxReplicas; without autoscaling, its size). */}}
{{- define "kvray.gpuWorkerCount" -}}
{{- include "kvray.gpuWorkersFor" (dict "root" . "replicas" (include "kvray.maxReplicas" .)) }}
{{- end }}

{{/* Logical CPUs of a GPU worker: one per GPU bundle, one per engine replica it may host, +1. */}}
{{- define "kvray.gpuWorkerCpus" -}}
{{- if not (kindIs "invalid" .Values.gpuWorkers.numCpus) }}
{{- int .Values.gpuWorkers.numCpus }}
{{- else }}
{{- $workers := int (include "kvray.gpuWorkerCount" .) }}
{{- $replicas := int (include "kvray.maxReplicas" .) }}
{{- add (int .Values.gpuWorkers.gpusPerWorker) (div (add $replicas (sub $workers 1)) $workers) 1 }}
{{- end }}
{{- end }}

{{/* Logical CPUs of the head. */}}
{{- define "kvray.headCpus" -}}
{{- if not (kindIs "invalid" .Values.head.numCpus) }}
{{- int .Values.head.numCpus }}
{{- else if or .Values.gpuWorkers.enabled .Values.cpuWorkers.enabled }}
{{- 2 }}
{{- else }}
{{- $perReplica := add 1 (int (include "kvray.worldSize" .)) }}
{{- add 2 (mul (int (include "kvray.maxReplicas" .)) $perReplica) }}
{{- end }}
{{- end }}

{{- define "kvray.configMapName" -}}
{{- printf "%s-model-config" (include "kvray.fullname" .) }}
{{- end }}

{{- define "kvray.apiKeySecretName" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "kvray.fullname" .)) }}
{{- end }}

{{/* The Serve config (serveConfigV2) as YAML. */}}
{{- define "kvray.serveConfig" -}}
{{- $args := deepCopy .Values.model.args }}
{{- $_ := set $args "config" (printf "%s/model.yaml" (trimSuffix "/" .Values.model.configMountPath)) }}
{{- with .Values.autoscaling }}
{{- if .enabled }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "autoscaling: minReplicas (%d) must be <= maxReplicas (%d)" (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- $_ := set $args "min_replicas" (int .minReplicas) }}
{{- $_ := set $args "max_replicas" (int .maxReplicas) }}
{{- $_ := set $args "target_ongoing_requests" .targetOngoingRequests }}
{{- $_ := set $args "target_kv_usage" .targetKvUsage }}
{{- $_ := set $args "upscale_delay_s" .upscaleDelaySeconds }}
{{- $_ := set $args "downscale_delay_s" .downscaleDelaySeconds }}
{{- end }}
{{- end }}
{{- if not .Values.autoscaling.enabled }}
{{- $_ := set $args "num_replicas" (int .Values.model.numReplicas) }}
{{- end }}
{{- $_ := set $args "name" .Values.model.appName }}
{{- $_ := set $args "tensor_parallel_size" (int .Values.model.tensorParallelSize) }}
{{- $_ := set $args "pipeline_parallel_size" (int .Values.model.pipelineParallelSize) }}
{{- /* Said, not guessed: the app may be built before the GPU workers have joined. */}}
{{- $_ := set $args "use_gpu" (.Values.gpuWorkers.enabled | default false) }}
{{- $app := dict "name" .Values.model.appName "route_prefix" .Values.model.routePrefix "import_path" "kvray.serve:build_app" "args" $args }}
{{- toYaml (dict "applications" (list $app)) }}
{{- end }}

{{/* Container env, volume mounts and pod volumes shared by every Ray pod. */}}
{{- define "kvray.env" -}}
{{- if .Values.apiKey.enabled }}
- name: KVRAY_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "kvray.apiKeySecretName" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- if .Values.serveGrpcTransport }}
- name: RAY_SERVE_USE_GRPC_BY_DEFAULT
  value: "1"
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvray.volumeMounts" -}}
- name: model-config
  mountPath: {{ .Values.model.configMountPath }}
  readOnly: true
{{- if .Values.shmSize }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "kvray.volumes" -}}
- name: model-config
  configMap:
    name: {{ include "kvray.configMapName" . }}
{{- if .Values.shmSize }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSize }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod-level fields shared by every Ray pod; pass (dict "root" $ "group" .Values.<group>). */}}
{{- define "kvray.podSpecCommon" -}}
{{- $root := .root }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  {{- include "kvray.volumes" $root | trim | nindent 2 }}
{{- end }}

{{/* Pod template metadata; pass (dict "root" $ "component" "head"). */}}
{{- define "kvray.podMetadata" -}}
labels:
  {{- include "kvray.selectorLabels" .root | trim | nindent 2 }}
  app.kubernetes.io/component: {{ .component }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/model-config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
  {{- with .root.Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
