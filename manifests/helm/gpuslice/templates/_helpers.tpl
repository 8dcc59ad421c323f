{{/*
One object of the kustomize base, changed where values say so, as a YAML document.
Arguments: obj (the parsed object), labels (what the kustomization's `labels` add), Values.
*/}}
{{- define "gpuslice.object" -}}
{{- $obj := .obj -}}
{{- $v := .Values -}}
{{- $meta := $obj.metadata -}}
{{- $_ := set $meta "labels" (merge (default dict $meta.labels) .labels) -}}
{{- if and (eq $obj.kind "Namespace") $v.podSecurity.enforce -}}
{{- $_ := set $meta.labels "pod-security.kubernetes.io/enforce" $v.podSecurity.enforce -}}
{{- end -}}
{{- if and (eq $obj.kind "Deployment") (not (kindIs "invalid" $v.operator.replicas)) -}}
{{- $_ := set $obj.spec "replicas" $v.operator.replicas -}}
{{- end -}}
{{- if eq $obj.kind "DaemonSet" -}}
{{- $pod := $obj.spec.template.spec -}}
{{- if not (kindIs "invalid" $v.agent.nodeSelector) -}}
{{- $_ := set $pod "nodeSelector" $v.agent.nodeSelector -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.agent.tolerations) -}}
{{- $_ := set $pod "tolerations" $v.agent.tolerations -}}
{{- end -}}
{{- if not (kindIs "invalid" $v.agent.updateStrategy) -}}
{{- $surge := toString (dig "rollingUpdate" "maxSurge" 0 $v.agent.updateStrategy) -}}
{{- if not (has $surge (list "0" "0%")) -}}
{{- fail (printf "agent.updateStrategy.rollingUpdate.maxSurge is %s: it must be 0, kubelet takes one DRA plugin per driver on a node, so a second agent pod on the node cannot serve while the old one runs" $surge) -}}
{{- end -}}
{{- $_ := set $obj.spec "updateStrategy" $v.agent.updateStrategy -}}
{{- end -}}
{{- end -}}
{{- if has $obj.kind (list "Deployment" "DaemonSet") -}}
{{- $pod := $obj.spec.template.spec -}}
{{- range $c := concat (default list $pod.initContainers) (default list $pod.containers) -}}
{{- $repo := regexReplaceAll ":[^:/]*$" $c.image "" -}}
{{- $tag := regexFind "[^:/]*$" $c.image -}}
{{- $_ := set $c "image" (printf "%s:%s" (default $repo $v.image.repository) (default $tag $v.image.tag)) -}}
{{- if $v.image.pullPolicy -}}
{{- $_ := set $c "imagePullPolicy" $v.image.pullPolicy -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* `helm upgrade --reuse-values` from a release without these values gives none of them */ -}}
{{- $tls := default dict (default dict $v.metrics).tls -}}
{{- if $tls.enabled -}}
{{- include "gpuslice.metricsTls" (dict "obj" $obj "tls" $tls) -}}
{{- end }}
---
{{ toYaml $obj }}
{{- end -}}

{{/* The objects of one YAML file (several documents). Arguments: root, path, labels. */}}
{{- define "gpuslice.file" -}}
{{- $root := .root -}}
{{- $labels := .labels -}}
{{- range $doc := regexSplit "(?m)^---[ \t]*$" ($root.Files.Get .path) -1 -}}
{{- $obj := fromYaml $doc -}}
{{- if and $obj.kind (not $obj.Error) -}}
{{- include "gpuslice.object" (dict "obj" $obj "labels" $labels "Values" $root.Values) -}}
{{- end -}}
{{- end -}}
{{- end -}}


{{/*
What manifests/components/metrics-tls patches, for values metrics.tls: the first container of the
operator Deployment and the agent DaemonSet serves the Secret's certificate; the ServiceMonitor
scrapes over HTTPS. Arguments: obj, tls (the values).
*/}}
{{- define "gpuslice.metricsTls" -}}
{{- $obj := .obj -}}
{{- if has $obj.kind (list "Deployment" "DaemonSet") -}}
{{- $pod := $obj.spec.template.spec -}}
{{- $c := first $pod.containers -}}
{{- $dir := "/etc/gpuslice/metrics-tls" -}}
{{- $args := list (printf "--metrics-tls-cert-file=%s/tls.crt" $dir) (printf "--metrics-tls-private-key-file=%s/tls.key" $dir) -}}
{{- $_ := set $c "args" (concat (default list $c.args) $args) -}}
{{- $_ := set $c "volumeMounts" (append (default list $c.volumeMounts) (dict "name" "metrics-tls" "mountPath" $dir "readOnly" true)) -}}
{{- $_ := set $pod "volumes" (append (default list $pod.volumes) (dict "name" "metrics-tls" "secret" (dict "secretName" .tls.secretName "defaultMode" 288))) -}}
{{- if eq $obj.kind "Deployment" -}}
{{- $_ := set $pod.securityContext "fsGroup" 65532 -}}
{{- end -}}
{{- end -}}
{{- if eq $obj.kind "ServiceMonitor" -}}
{{- $ep := first $obj.spec.endpoints -}}
{{- $_ := set $ep "scheme" "https" -}}
{{- $_ := set $ep "tlsConfig" (dict "ca" (dict "secret" (dict "name" .tls.secretName "key" "ca.crt")) "serverName" "gpuslice-metrics.gpuslice-system.svc") -}}
{{- end -}}
{{- end -}}
