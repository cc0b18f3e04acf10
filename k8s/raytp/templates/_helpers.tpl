{{/*
Names. KubeRay refuses RayService and RayJob names over 47 characters (its RayCluster names add a
6-character suffix, 53 at most); the full name is cut at 40 so "<fullname>-batch" fits too.
*/}}
{{- define "raytp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "raytp.fullname" -}}
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

{{- define "raytp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "raytp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "raytp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "raytp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The image: one for head and workers; its default tag follows the workers' accelerator. */}}
{{- define "raytp.image" -}}
{{- $variant := ternary "gpu" "cpu" .Values.worker.gpu.enabled }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $variant)) }}
{{- end }}

{{/*
Model replicas one worker pod holds: with GPUs, gpu.perPod / tensor_parallel_size (each TP rank takes
one GPU and PACK keeps a replica's ranks on one pod); on CPU, one.
*/}}
{{- define "raytp.gpusPerPod" -}}
{{- .Values.worker.gpu.perPod | default .Values.engine.tensor_parallel_size | int }}
{{- end }}

{{- define "raytp.replicasPerPod" -}}
{{- $root := .root | default . }}
{{- if $root.Values.worker.gpu.enabled }}
{{- $gpus := include "raytp.gpusPerPod" $root | int }}
{{- $tp := .tp | default $root.Values.engine.tensor_parallel_size | int }}
{{- if or (lt $gpus $tp) (ne (mod $gpus $tp) 0) }}
{{- fail (printf "worker.gpu.perPod (%d) must be a multiple of engine.tensor_parallel_size (%d): a model replica's TP ranks share one pod" $gpus $tp) }}
{{- end }}
{{- div $gpus $tp }}
{{- else }}1{{ end }}
{{- end }}

{{/* Worker pods for N model replicas: ceil(N / replicasPerPod). Call with (dict "root" $ "n" N [ "tp" TP ]);
TP defaults to engine.tensor_parallel_size. */}}
{{- define "raytp.podsFor" -}}
{{- $per := include "raytp.replicasPerPod" (dict "root" .root "tp" .tp) | int }}
{{- div (add (int .n) (sub $per 1)) $per }}
{{- end }}

{{/* "true" when the model or any of `models` comes from source .source. Call with (dict "root" $ "source" S). */}}
{{- define "raytp.usesSource" -}}
{{- $v := .root.Values }}
{{- $used := and (not $v.models) (eq $v.model.source .source) }}
{{- range $v.models }}{{ if eq (.source | default "embedded") $.source }}{{ $used = true }}{{ end }}{{ end }}
{{- if $used }}true{{ end }}
{{- end }}

{{/*
One entry of `models` as build_app's args take it (ModelArgs): model, served_model_name, replicas or
autoscaling, its engine overrides, its LoRA modules. Call with (dict "root" $ "m" ENTRY).
*/}}
{{- define "raytp.modelEntry" -}}
{{- $v := .root.Values }}
{{- $m := .m }}
{{- $args := dict "served_model_name" $m.servedModelName }}
{{- $source := $m.source | default "embedded" }}
{{- if eq $source "pvc" }}
{{- if not $v.model.pvc.claimName }}{{ fail (printf "models: %s comes from the PVC: set model.pvc.claimName" $m.servedModelName) }}{{ end }}
{{- $_ := set $args "model" (printf "%s/%s" (trimSuffix "/" $v.model.pvc.mountPath) $m.path) }}
{{- else if eq $source "huggingface" }}
{{- $_ := set $args "model" $m.id }}
{{- end }}
{{- $scaling := $m.autoscaling | default $v.serving.autoscaling }}
{{- if $scaling.enabled }}
{{- $_ := set $args "autoscaling_config" $scaling.config }}
{{- else }}
{{- $_ := set $args "num_replicas" ($m.numReplicas | default $v.serving.numReplicas) }}
{{- end }}
{{- range $key, $value := $m.engine }}
{{- if not (kindIs "invalid" $value) }}{{ $_ := set $args $key $value }}{{ end }}
{{- end }}
{{- with $m.loraModules }}{{ $_ := set $args "lora_modules" . }}{{ end }}
{{- toYaml $args }}
{{- end }}

{{/*
Worker pods the model replicas need: (dict "min" N "max" M) as YAML, summed over `models` (each its own
replicas and TP size) or for the one model.
*/}}
{{- define "raytp.servicePods" -}}
{{- $v := .Values }}
{{- $min := 0 }}
{{- $max := 0 }}
{{- $entries := $v.models }}
{{- if not $entries }}{{ $entries = list (dict) }}{{ end }}
{{- range $entries }}
{{- $scaling := .autoscaling | default $v.serving.autoscaling }}
{{- $n := .numReplicas | default $v.serving.numReplicas }}
{{- $cfg := $scaling.config }}
{{- if and $scaling.enabled (gt (int $cfg.min_replicas) (int $cfg.max_replicas)) }}
{{- fail (printf "serving.autoscaling.config: min_replicas (%d) exceeds max_replicas (%d)" (int $cfg.min_replicas) (int $cfg.max_replicas)) }}
{{- end }}
{{- $tp := (.engine | default dict).tensor_parallel_size | default $v.engine.tensor_parallel_size }}
{{- $min = add $min (include "raytp.podsFor" (dict "root" $ "n" (ternary $cfg.min_replicas $n $scaling.enabled) "tp" $tp) | int) }}
{{- $max = add $max (include "raytp.podsFor" (dict "root" $ "n" (ternary $cfg.max_replicas $n $scaling.enabled) "tp" $tp) | int) }}
{{- end }}
{{- toYaml (dict "min" $min "max" $max) }}
{{- end }}

{{/* The `model` arg: null (omitted) for the embedded model, a mounted path, or a hub id. */}}
{{- define "raytp.modelArg" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "pvc" }}
{{- printf "%s/%s" (trimSuffix "/" $m.pvc.mountPath) $m.pvc.path }}
{{- else if eq $m.source "huggingface" }}
{{- $m.huggingface.id }}
{{- end }}
{{- end }}

{{/*
serveConfigV2: one Serve application, serve_app:build_app with its args (ServeArgs in
raytp/serve/args.py). The API key is never an arg: the ingress reads RAYTP_API_KEY.
*/}}
{{- define "raytp.serveConfig" -}}
{{- $v := .Values }}
{{- $args := dict }}
{{- range $key, $value := $v.engine }}
{{- if not (kindIs "invalid" $value) }}{{ $_ := set $args $key $value }}{{ end }}
{{- end }}
{{- if $v.models }}
{{- /* several models: the engine values above are every model's defaults; each entry sets its own */}}
{{- $models := list }}
{{- range $v.models }}{{ $models = append $models (include "raytp.modelEntry" (dict "root" $ "m" .) | fromYaml) }}{{ end }}
{{- $_ := set $args "models" $models }}
{{- $_ := set $args "ingress_replicas" $v.serving.ingressReplicas }}
{{- else }}
{{- with include "raytp.modelArg" . }}{{ $_ := set $args "model" . }}{{ end }}
{{- with $v.model.servedModelName }}{{ $_ := set $args "served_model_name" . }}{{ end }}
{{- with $v.model.loraModules }}{{ $_ := set $args "lora_modules" . }}{{ end }}
{{- if $v.serving.autoscaling.enabled }}
{{- $_ := set $args "autoscaling_config" $v.serving.autoscaling.config }}
{{- else }}
{{- $_ := set $args "num_replicas" $v.serving.numReplicas }}
{{- end }}
{{- end }}
{{- if $v.serving.enableRuntimeLoraUpdating }}{{ $_ := set $args "enable_runtime_lora_updating" true }}{{ end }}
{{- if not (kindIs "invalid" $v.serving.splitIngress) }}{{ $_ := set $args "split_ingress" $v.serving.splitIngress }}{{ end }}
{{- if $v.serving.splitIngress }}{{ $_ := set $args "ingress_replicas" $v.serving.ingressReplicas }}{{ end }}
{{- with $v.serving.requestRouter }}{{ $_ := set $args "request_router" . }}{{ end }}
{{- $_ := set $args "max_ongoing_requests" $v.serving.maxOngoingRequests }}
{{- if not (kindIs "invalid" $v.serving.maxWaitingRequests) }}{{ $_ := set $args "max_waiting_requests" $v.serving.maxWaitingRequests }}{{ end }}
{{- if not (kindIs "invalid" $v.serving.healthCheckPeriodS) }}{{ $_ := set $args "health_check_period_s" $v.serving.healthCheckPeriodS }}{{ end }}
{{- $app := dict "name" $v.serving.appName "route_prefix" $v.serving.routePrefix "import_path" "serve_app:build_app" "args" $args }}
{{- $http := dict "host" "0.0.0.0" "port" $v.serving.port }}
{{- toYaml (dict "proxy_location" "EveryNode" "http_options" $http "applications" (list $app)) }}
{{- end }}

{{/* One shell word: bare when it holds only safe characters, else single-quoted (the schema forbids '). */}}
{{- define "raytp.shellWord" -}}
{{- if regexMatch "^[A-Za-z0-9_./:=@+,-]+$" . }}{{ . }}{{ else }}{{ squote . }}{{ end }}
{{- end }}

{{/*
`raytp batch` command line: -i/-o/--error-file on the data claim, MODEL, then --num-replicas and the
engine flags (cluster/engine_args.py spelling: --snake-case, --no-X for false booleans). Numbers go
through toJson so large integers never print in exponent form.
*/}}
{{- define "raytp.batchEntrypoint" -}}
{{- $b := .Values.batch }}
{{- $data := trimSuffix "/" $b.data.mountPath }}
{{- $words := list "raytp" "batch" "-i" (printf "%s/%s" $data $b.input) "-o" (printf "%s/%s" $data $b.output) }}
{{- with $b.errorFile }}{{ $words = concat $words (list "--error-file" (printf "%s/%s" $data .)) }}{{ end }}
{{- with include "raytp.modelArg" . }}{{ $words = append $words . }}{{ end }}
{{- $words = concat $words (list "--num-replicas" (toString (int $b.numReplicas))) }}
{{- range $key, $value := .Values.engine }}
{{- $flag := printf "--%s" (replace "_" "-" $key) }}
{{- if kindIs "bool" $value }}
{{- if $value }}{{ $words = append $words $flag }}
{{- else if ne $key "trust_remote_code" }}{{ $words = append $words (printf "--no-%s" (replace "_" "-" $key)) }}{{ end }}
{{- else if kindIs "string" $value }}{{ $words = concat $words (list $flag $value) }}
{{- else if not (kindIs "invalid" $value) }}{{ $words = concat $words (list $flag (toJson $value)) }}
{{- end }}
{{- end }}
{{- $words = concat $words $b.extraArgs }}
{{- $quoted := list }}
{{- range $words }}{{ $quoted = append $quoted (include "raytp.shellWord" .) }}{{ end }}
{{- join " " $quoted }}
{{- end }}

{{/* Environment of every Ray container. Call with (dict "root" $ "role" "head"|"worker" "kind" "serve"|"batch"). */}}
{{- define "raytp.env" -}}
{{- $v := .root.Values -}}
- name: RAYTP_CPUS_PER_WORKER
  value: {{ $v.worker.cpusPerRank | toJson | quote }}
{{- if eq .kind "serve" }}
# Serve's HTTP proxies (on every node) validate X-Request-Id before echoing it (raytp/openai/request_id.py).
- name: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH
  value: "raytp.openai.request_id:proxy_middlewares"
# Serve's high-throughput mode, as `raytp serve` runs it (raytp/serve/args.py SERVE_ENV_DEFAULTS): direct ingress and
# HAProxy (bundled with ray[serve]) on each node's HTTP port; Serve's HTTP request metrics from the ingress
# replica, not from HAProxy's log (in Ray 2.60 that books answered requests as 499; see raytp/serve/args.py).
- name: RAY_SERVE_THROUGHPUT_OPTIMIZED
  value: "1"
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
- name: RAY_SERVE_HAPROXY_METRICS_ENABLED
  value: "0"
# Serve's cached replica metrics flushed every second, not every 100 ms (the flush runs on the engine's event loop).
- name: RAY_SERVE_METRICS_EXPORT_INTERVAL_MS
  value: "1000"
# Serve's control loop every 0.5 s, not 0.1 s: its controller's and the GCS's CPU halved (raytp/serve/args.py).
- name: RAY_SERVE_CONTROL_LOOP_INTERVAL_S
  value: "0.5"
{{- end }}
{{- if and (eq .kind "serve") $v.serving.apiKey.secretName }}
- name: RAYTP_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.serving.apiKey.secretName }}
      key: {{ $v.serving.apiKey.secretKey }}
{{- end }}
{{- if include "raytp.usesSource" (dict "root" .root "source" "huggingface") }}
- name: HF_HOME
  value: {{ $v.model.huggingface.cache.mountPath | quote }}
{{- with $v.model.huggingface.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $v.model.huggingface.tokenSecret.key }}
{{- end }}
{{- end }}
{{- if eq .role "head" }}
{{- with $v.monitoring.grafanaHost }}
- name: RAY_GRAFANA_HOST
  value: {{ . | quote }}
{{- end }}
{{- with $v.monitoring.grafanaIframeHost }}
- name: RAY_GRAFANA_IFRAME_HOST
  value: {{ . | quote }}
{{- end }}
{{- with $v.monitoring.prometheusHost }}
- name: RAY_PROMETHEUS_HOST
  value: {{ . | quote }}
{{- end }}
{{- with $v.head.env }}
{{ toYaml . }}
{{- end }}
{{- else }}
{{- with $v.worker.env }}
{{ toYaml . }}
{{- end }}
{{- end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes and their mounts; same arguments as raytp.env. The model is mounted read-only. */}}
{{- define "raytp.volumes" -}}
{{- $v := .root.Values }}
{{- if include "raytp.usesSource" (dict "root" .root "source" "pvc") }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $v.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- if include "raytp.usesSource" (dict "root" .root "source" "huggingface") }}
- name: hf-cache
{{- $cache := $v.model.huggingface.cache }}
{{- if $cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $cache.existingClaim }}
{{- else if $cache.create.enabled }}
  persistentVolumeClaim:
    claimName: {{ include "raytp.fullname" .root }}-hf-cache
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- if eq .kind "batch" }}
- name: batch-data
  persistentVolumeClaim:
    claimName: {{ $v.batch.data.claimName }}
{{- end }}
{{- if $v.sharedMemory.enabled }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.sharedMemory.sizeLimit }}
{{- end }}
{{- end }}

{{- define "raytp.volumeMounts" -}}
{{- $v := .root.Values }}
{{- if include "raytp.usesSource" (dict "root" .root "source" "pvc") }}
- name: model
  mountPath: {{ $v.model.pvc.mountPath }}
  readOnly: true
{{- end }}
{{- if include "raytp.usesSource" (dict "root" .root "source" "huggingface") }}
- name: hf-cache
  mountPath: {{ $v.model.huggingface.cache.mountPath }}
{{- end }}
{{- if eq .kind "batch" }}
- name: batch-data
  mountPath: {{ $v.batch.data.mountPath }}
{{- end }}
{{- if $v.sharedMemory.enabled }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/* Pod-level fields shared by head and workers; same arguments as raytp.env. */}}
{{- define "raytp.podMeta" -}}
labels:
  {{- include "raytp.selectorLabels" .root | nindent 2 }}
  app.kubernetes.io/component: {{ .kind }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .root.Values.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The head group. Ports carry KubeRay's names (gcs-server, dashboard, client, serve, metrics): its probes
and Services find them by name. Liveness/readiness probes are left to KubeRay, which injects the ones
that match the Ray version (and, on RayService workers, the Serve proxy's /-/healthz).
*/}}
{{- define "raytp.headGroupSpec" -}}
{{- $v := .root.Values -}}
rayStartParams:
  dashboard-host: "0.0.0.0"
  metrics-export-port: {{ $v.monitoring.metricsPort | toJson | quote }}
  {{- if not $v.head.schedulable }}
  num-cpus: "0"
  num-gpus: "0"
  {{- end }}
template:
  metadata:
    {{- include "raytp.podMeta" . | nindent 4 }}
  spec:
    {{- with include "raytp.podSpecCommon" (dict "root" .root "role" "head") }}
    {{- . | trim | nindent 4 }}
    {{- end }}
    containers:
      - name: ray-head
        image: {{ include "raytp.image" .root }}
        imagePullPolicy: {{ $v.image.pullPolicy }}
        ports:
          - {name: gcs-server, containerPort: 6379}
          - {name: dashboard, containerPort: 8265}
          - {name: client, containerPort: 10001}
          {{- if eq .kind "serve" }}
          - {name: serve, containerPort: {{ $v.serving.port }}}
          {{- end }}
          - {name: metrics, containerPort: {{ $v.monitoring.metricsPort }}}
          - {name: as-metrics, containerPort: 44217}
          - {name: dash-metrics, containerPort: 44227}
        env:
          {{- include "raytp.env" (dict "root" .root "role" "head" "kind" .kind) | trim | nindent 10 }}
        {{- with $v.head.resources }}
        resources:
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- with include "raytp.volumeMounts" . }}
        volumeMounts:
          {{- . | trim | nindent 10 }}
        {{- end }}
    {{- with include "raytp.volumes" . }}
    volumes:
      {{- . | trim | nindent 6 }}
    {{- end }}
{{- end }}

{{/* One worker group. Call with (dict "root" $ "kind" K "replicas" R "minReplicas" MIN "maxReplicas" MAX). */}}
{{- define "raytp.workerGroupSpec" -}}
{{- $v := .root.Values -}}
- groupName: {{ $v.worker.groupName }}
  replicas: {{ .replicas }}
  minReplicas: {{ .minReplicas }}
  maxReplicas: {{ .maxReplicas }}
  rayStartParams:
    metrics-export-port: {{ $v.monitoring.metricsPort | toJson | quote }}
  template:
    metadata:
      {{- include "raytp.podMeta" . | nindent 6 }}
    spec:
      {{- with include "raytp.podSpecCommon" (dict "root" .root "role" "worker") }}
      {{- . | trim | nindent 6 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "raytp.image" .root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            {{- if eq .kind "serve" }}
            - {name: serve, containerPort: {{ $v.serving.port }}}
            {{- end }}
            - {name: metrics, containerPort: {{ $v.monitoring.metricsPort }}}
          env:
            {{- include "raytp.env" (dict "root" .root "role" "worker" "kind" .kind) | trim | nindent 12 }}
          resources:
            {{- include "raytp.workerResources" .root | nindent 12 }}
          {{- with include "raytp.volumeMounts" . }}
          volumeMounts:
            {{- . | trim | nindent 12 }}
          {{- end }}
      {{- with include "raytp.volumes" . }}
      volumes:
        {{- . | trim | nindent 8 }}
      {{- end }}
{{- end }}

{{/* Worker resources: the values' cpu/memory plus, with GPUs, gpu.perPod GPUs as request and limit. */}}
{{- define "raytp.workerResources" -}}
{{- $res := deepCopy (.Values.worker.resources | default dict) }}
{{- if .Values.worker.gpu.enabled }}
{{- $gpus := include "raytp.gpusPerPod" . | int }}
{{- $_ := set $res "limits" (merge (dict .Values.worker.gpu.resourceName $gpus) ($res.limits | default dict)) }}
{{- $_ := set $res "requests" (merge (dict .Values.worker.gpu.resourceName $gpus) ($res.requests | default dict)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- define "raytp.podSpecCommon" -}}
{{- $v := .root.Values }}
{{- $group := ternary $v.head $v.worker (eq .role "head") }}
{{- with $v.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
