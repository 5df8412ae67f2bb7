{{/* Names and labels */}}
{{- define "pdcluster.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdcluster.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdcluster.labels" -}}
{{ include "pdcluster.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdcluster.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{/* The Ray head's Service (made by KubeRay) */}}
{{- define "pdcluster.headAddress" -}}
{{ printf "%s-head-svc.%s.svc:6379" (include "pdcluster.fullname" .) .Release.Namespace }}
{{- end -}}

{{/* --model for pdcluster: the baked-in default, or the mounted folder */}}
{{- define "pdcluster.modelArg" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "default" -}}default
{{- else if eq $m.source "pvc" -}}
{{- if not $m.pvc.claimName -}}{{- fail "model.pvc.claimName is required when model.source is pvc" -}}{{- end -}}
/models
{{- else if eq $m.source "hostPath" -}}
{{- if not $m.hostPath.path -}}{{- fail "model.hostPath.path is required when model.source is hostPath" -}}{{- end -}}
/models
{{- else -}}{{- fail (printf "model.source must be default, pvc or hostPath, got %q" $m.source) -}}
{{- end -}}
{{- end -}}

{{/* Environment every pdcluster container shares */}}
{{- define "pdcluster.env" -}}
- name: HOME
  value: /tmp
- name: PDCLUSTER_CACHE_DIR
  value: /opt/pdcluster
{{- if .Values.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdcluster.rayTokenSecretName" . }}
      key: auth_token
{{- else }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- /* the address every KV endpoint and token stream in this pod binds and advertises (cluster/wire/node.py) */}}
- name: PDCLUSTER_NODE_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- end -}}

{{- define "pdcluster.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if gt (float64 .Values.kvTiers.diskGib) 0.0 }}
- name: kv-tier
  mountPath: /kv-tier
{{- end }}
{{- if ne .Values.model.source "default" }}
- name: model
  mountPath: /models
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "pdcluster.volumes" -}}
- name: tmp
  emptyDir: {}
{{- if gt (float64 .Values.kvTiers.diskGib) 0.0 }}
- name: kv-tier
  emptyDir:
    sizeLimit: {{ printf "%.0fMi" (mulf (addf .Values.kvTiers.diskGib 1.0) 1024.0) }}
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- end }}
{{- end -}}

{{/* One worker group: the same pod shape for both roles */}}
{{- define "pdcluster.workerGroup" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $v := index $root.Values $role -}}
{{- /* a tensor-parallel actor holds one GPU per rank: the pod's GPUs are gpus x tensorParallelSize */}}
{{- $gpus := mul (int $v.gpus) (int ($v.tensorParallelSize | default 1)) -}}
- groupName: {{ $role }}
  replicas: {{ $v.replicas }}
  minReplicas: {{ $v.minReplicas }}
  maxReplicas: {{ $v.maxReplicas }}
  rayStartParams:
    num-cpus: "1"
    num-gpus: {{ $gpus | quote }}
    resources: {{ printf "\"{\\\"pdcluster_%s\\\": 1}\"" $role | quote }}
  template:
    metadata:
      labels:
        {{- include "pdcluster.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ $role }}
    spec:
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      # time for preStop to hand the pod's requests over (the actors evacuate) before Kubernetes kills it
      terminationGracePeriodSeconds: {{ $root.Values.evacuation.gracePeriodSeconds }}
      containers:
        - name: ray-worker
          image: {{ include "pdcluster.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          lifecycle:
            preStop:
              exec:
                # SIGTERM to this pod's worker actors: they take no new work, the proxies resume their requests
                # on other actors, and each exits once it holds none (cluster/actor/evacuate.py)
                command: ["python", "-m", "cluster.actor.evacuate", "--timeout",
                          "{{ sub (int $root.Values.evacuation.gracePeriodSeconds) 5 }}"]
          env:
            {{- include "pdcluster.env" $root | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            {{- $res := deepCopy $v.resources -}}
            {{- if gt $gpus 0 }}
            {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" $gpus) ($res.limits | default dict)) }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          volumeMounts:
            {{- include "pdcluster.volumeMounts" $root | nindent 12 }}
            - name: dshm
              mountPath: /dev/shm
      volumes:
        {{- include "pdcluster.volumes" $root | nindent 8 }}
        # memory-backed /dev/shm (the container default is 64 MiB): NCCL's shared-memory transport and torch's
        # shared tensors. The shm KV backend's cache is an anonymous memfd, counted in the pod's memory, not here.
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.kvTransfer.shmSize | default (printf "%dGi" (add1 (int (ceil (float64 ($root.Values.engine.kvCacheGib | default 1)))))) }}
{{- end -}}

{{- /* the cluster secret (cluster/wire/auth.py) for the containers that hold it: serve (it hands it to the actors
through Ray) and the proxies */}}
{{- define "pdcluster.clusterAuthEnv" -}}
{{- if .Values.clusterAuth.enabled }}
- name: PDCLUSTER_CLUSTER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "pdcluster.clusterSecretName" . }}
      key: {{ .Values.clusterAuth.secretKey }}
{{- end }}
{{- end -}}

{{- define "pdcluster.clusterSecretName" -}}
{{- .Values.clusterAuth.existingSecret | default (printf "%s-cluster-secret" (include "pdcluster.fullname" .)) -}}
{{- end -}}

{{- define "pdcluster.rayTokenSecretName" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-token" (include "pdcluster.fullname" .)) -}}
{{- end -}}
