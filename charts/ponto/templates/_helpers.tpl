{{/*
Names. Every object is "<fullname>-<part>"; names that would pass the 63-character
limit of a DNS label fail the render instead of being cut (a cut name can collide).
*/}}
{{- define "ponto.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ponto.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<part>", checked against the DNS label limit. Call with (list $ "part"). */}}
{{- define "ponto.part" -}}
{{- $root := index . 0 -}}
{{- $name := printf "%s-%s" (include "ponto.fullname" $root) (index . 1) -}}
{{- if gt (len $name) 63 -}}
{{- fail (printf "name %q is longer than 63 characters: shorten the release name, fullnameOverride or the region name" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/*
A StatefulSet's name: "ponto.part", and at most 52 characters. The StatefulSet
controller labels each pod controller-revision-hash=<name>-<hash of up to 10>, and a
label value is at most 63 characters: with a longer name the API server refuses every
pod, long after the render. Call with (list $ "part").
*/}}
{{- define "ponto.statefulSetName" -}}
{{- $name := include "ponto.part" . -}}
{{- if gt (len $name) 52 -}}
{{- fail (printf "StatefulSet name %q is %d characters, above 52: Kubernetes labels its pods controller-revision-hash=<name>-<hash>, at most 63 characters, and would create none; shorten the release name or set fullnameOverride" $name (len $name)) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "ponto.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels. Call with (list $ "component"). */}}
{{- define "ponto.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ponto.name" (index . 0) }}
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/*
A pod template's labels: the selector's and the two that never change. Not the chart's
version nor the app's (they stay on the objects' own metadata): a pod template that
changes rolls its pods, so each chart release would roll etcd's members and restart
every Redis (emptying the regions' caches) for a label. Call with (list $ "component").
*/}}
{{- define "ponto.podLabels" -}}
{{ include "ponto.selectorLabels" . }}
app.kubernetes.io/part-of: ponto
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
{{- end -}}

{{- define "ponto.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "ponto.chart" $root }}
{{ include "ponto.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: ponto
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end -}}

{{- define "ponto.image" -}}
{{- $img := .Values.image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* Addresses inside the cluster. */}}
{{- define "ponto.controlPlane.host" -}}
{{- printf "%s.%s.svc" (include "ponto.part" (list . "control")) .Release.Namespace -}}
{{- end -}}

{{/*
What the proxies dial (--control-plane): the release's own control plane Service, or in
a proxies-only release (controlPlane.enabled false) controlPlane.address, the central
release's as this cluster reaches it.
*/}}
{{- define "ponto.controlPlane.address" -}}
{{- if .Values.controlPlane.enabled -}}
{{- printf "%s:%d" (include "ponto.controlPlane.host" .) (int .Values.controlPlane.service.port) -}}
{{- else -}}
{{- .Values.controlPlane.address -}}
{{- end -}}
{{- end -}}

{{/* "true" when the release runs etcd: it runs a control plane and etcd.enabled. */}}
{{- define "ponto.etcd.bundled" -}}
{{- if and .Values.controlPlane.enabled .Values.etcd.enabled }}true{{ end -}}
{{- end -}}

{{/*
"true" when the release applies the topology: it runs a control plane and
topology.apply. A proxies-only release applies none: the topology is the central
release's, and one applied from each cluster would undo the others' regions (prune)
or fight over the same ones.
*/}}
{{- define "ponto.topology.applied" -}}
{{- if and .Values.controlPlane.enabled .Values.topology.apply }}true{{ end -}}
{{- end -}}

{{/*
A proxies-only release (controlPlane.enabled false): what it needs and what it must not
be given. Its proxies register with another release's control plane, so their
credentials are that release's, copied here: nothing generated in this release could
be trusted there. Values that only the central release's topology applies (coordinates,
RTTs, drains, origins, tenants) fail the render here rather than go unused in silence.
*/}}
{{- define "ponto.edge.validate" -}}
{{- if not .Values.controlPlane.enabled -}}
{{- $why := "controlPlane.enabled is false (a proxies-only release; docs/helm.md, \"Several clusters\")" -}}
{{- if not .Values.controlPlane.address -}}
{{- fail (printf "%s: set controlPlane.address, HOST:PORT of the central release's control plane as this cluster reaches it (several comma-separated); its host must be a name in that control plane's certificate (the central release's tls.extraDnsNames)" $why) -}}
{{- end -}}
{{- if not .Values.auth.existingSecret -}}
{{- fail (printf "%s: set auth.existingSecret, a Secret in this namespace holding the central release's bootstrap-token (copied from its token Secret): the proxies register with the token the central control plane holds, which this release cannot generate" $why) -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecrets.proxy) -}}
{{- fail (printf "%s: set tls.existingSecrets.proxy, a Secret in this namespace holding the central release's proxy certificate (tls.crt, tls.key and ca.crt, copied from its <fullname>-proxy-tls or tls.existingSecrets.proxy): the central control plane accepts only certificates of its own CA, and ca.crt is what verifies its server certificate; or tls.enabled false if the central release runs without TLS" $why) -}}
{{- end -}}
{{- $t := .Values.topology -}}
{{- range $key := list "origins" "tenants" "extraRegions" -}}
{{- if get $t $key -}}
{{- fail (printf "%s: topology.%s is applied by the central release, not by a proxies-only one: move it to the central release's values" $why $key) -}}
{{- end -}}
{{- end -}}
{{- if $t.prune -}}
{{- fail (printf "%s: topology.prune is the central release's: this release applies no topology" $why) -}}
{{- end -}}
{{- range .Values.proxy.regions -}}
{{- $region := . -}}
{{- range $key := list "lat" "lon" "rttMs" "spillThreshold" "drained" -}}
{{- if hasKey $region $key -}}
{{- fail (printf "%s: region %q sets %s, which only the central release's topology applies: list the region there, in topology.extraRegions (name, lat, lon, rtt_ms, spill_threshold, drained), and leave it out here" $why $region.name $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ponto.etcd.endpoints" -}}
{{- $tls := .Values.etcd.external.tls | default dict -}}
{{- if and $tls.clientCertificate (not $tls.secretName) -}}
{{- fail "etcd.external.tls.clientCertificate needs etcd.external.tls.secretName (a Secret with ca.crt, tls.crt and tls.key)" -}}
{{- end -}}
{{- if .Values.etcd.enabled -}}
{{- if $tls.secretName -}}
{{- fail "etcd.external.tls is for an etcd outside the release (etcd.enabled=false); the bundled etcd is plaintext behind its NetworkPolicy" -}}
{{- end -}}
{{- printf "%s.%s.svc:2379" (include "ponto.part" (list . "etcd")) .Release.Namespace -}}
{{- else -}}
{{- $ext := .Values.etcd.external -}}
{{- if not $ext.endpoints -}}
{{- fail "etcd.enabled is false: set etcd.external.endpoints (HOST:PORT of an existing etcd cluster)" -}}
{{- end -}}
{{- range $ext.endpoints -}}
{{- if and $tls.secretName (hasPrefix "http://" .) -}}
{{- fail (printf "etcd.external.endpoints: %s says http:// but etcd.external.tls.secretName is set; write https://%s" . (trimPrefix "http://" .)) -}}
{{- end -}}
{{- if and (not $tls.secretName) (hasPrefix "https://" .) -}}
{{- fail (printf "etcd.external.endpoints: %s needs etcd.external.tls.secretName (a Secret with ca.crt, the CA that signed etcd's certificates)" .) -}}
{{- end -}}
{{- end -}}
{{- join "," $ext.endpoints -}}
{{- end -}}
{{- end -}}

{{/* TLS to an external etcd: the Secret's name, or "" for plaintext (the bundled etcd is plaintext behind its NetworkPolicy). */}}
{{- define "ponto.etcd.tlsSecret" -}}
{{- if not .Values.etcd.enabled -}}{{ (.Values.etcd.external.tls | default dict).secretName | default "" }}{{- end -}}
{{- end -}}

{{/* Secret names: the user's when given, else the chart's. */}}
{{- define "ponto.tokens.secretName" -}}
{{- .Values.auth.existingSecret | default (include "ponto.part" (list . "tokens")) -}}
{{- end -}}

{{/* The TLS Secret of "control", "proxy" or "admin". Call with (list $ key). */}}
{{- define "ponto.tls.secretName" -}}
{{- $root := index . 0 -}}
{{- $key := index . 1 -}}
{{- $field := get (dict "control" "controlPlane" "proxy" "proxy" "admin" "admin") $key -}}
{{- get $root.Values.tls.existingSecrets $field | default (include "ponto.part" (list $root (printf "%s-tls" $key))) -}}
{{- end -}}

{{- define "ponto.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "ponto.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext -}}
{{- end -}}

{{/*
Soft or hard anti-affinity on the node, for pods carrying the given selector labels.
Call with (list mode selectorLabelsYaml).
*/}}
{{- define "ponto.antiAffinity" -}}
{{- $mode := index . 0 -}}
{{- $labels := index . 1 | fromYaml -}}
{{- if eq $mode "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- toYaml $labels | nindent 10 }}
{{- else if eq $mode "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- toYaml $labels | nindent 12 }}
{{- end }}
{{- end -}}

{{/*
Secret material: tokens and TLS. Computed once per render and kept on the root
context, so that the Secrets and the checksum annotations on the pods see the same
values. Existing Secrets (lookup) are reused, which keeps generated tokens and
certificates stable across upgrades; a certificate is issued again when it is
within tls.renewBeforeDays of its end. `helm template` and `--dry-run` have no
cluster, so they show freshly generated material each time.
Result ($.pontoMaterial):
  tokens: {admin-token, bootstrap-token} (base64) or absent with auth.existingSecret
  tls:    {ca, control, proxy, admin} -> {data: {...base64}, notAfter} or absent
*/}}
{{- define "ponto.material" -}}
{{- if not (hasKey $ "pontoMaterial") -}}
{{- $ns := .Release.Namespace -}}
{{- $m := dict -}}
{{- if not .Values.auth.existingSecret -}}
{{- $old := (lookup "v1" "Secret" $ns (include "ponto.tokens.secretName" .)).data | default dict -}}
{{- $admin := .Values.auth.adminToken | default (get $old "admin-token" | b64dec) | default (randAlphaNum 48) -}}
{{- $boot := .Values.auth.bootstrapToken | default (get $old "bootstrap-token" | b64dec) | default (randAlphaNum 48) -}}
{{- $_ := set $m "tokens" (dict "admin-token" (b64enc $admin) "bootstrap-token" (b64enc $boot)) -}}
{{- end -}}
{{- $given := .Values.tls.existingSecrets -}}
{{- $nGiven := len (compact (list $given.controlPlane $given.proxy $given.admin)) -}}
{{- /* A proxies-only release mounts the proxy Secret alone (ponto.edge.validate requires it) and issues nothing: a CA of its own would be one the central control plane does not trust. */ -}}
{{- if and .Values.tls.enabled .Values.controlPlane.enabled (ne $nGiven 0) (ne $nGiven 3) -}}
{{- fail "tls.existingSecrets: give all of controlPlane, proxy and admin, or none (the chart then issues all three from one CA)" -}}
{{- end -}}
{{- if and .Values.tls.enabled .Values.controlPlane.enabled (eq $nGiven 0) -}}
{{- $now := now | unixEpoch | int64 -}}
{{- $renewAt := add $now (mul .Values.tls.renewBeforeDays 86400) -}}
{{- $caName := include "ponto.part" (list . "ca") -}}
{{- $caOld := lookup "v1" "Secret" $ns $caName | default dict -}}
{{- $caNotAfter := int64 (dig "metadata" "annotations" "ponto.io/not-after" "0" $caOld) -}}
{{- $ca := dict -}}
{{- $caFresh := true -}}
{{- $tls := dict -}}
{{- if and $caOld.data (gt $caNotAfter $renewAt) -}}
{{- $ca = buildCustomCert (index $caOld.data "tls.crt") (index $caOld.data "tls.key") -}}
{{- $caFresh = false -}}
{{- $_ := set $tls "ca" (dict "data" $caOld.data "notAfter" $caNotAfter) -}}
{{- else -}}
{{- /* ECDSA P-256: as strong as RSA-3072 for these uses, and generated in microseconds. */ -}}
{{- $ca = genCAWithKey (printf "%s CA" (include "ponto.fullname" .)) (int .Values.tls.caValidityDays) (genPrivateKey "ecdsa") -}}
{{- $_ := set $tls "ca" (dict "data" (dict "tls.crt" (b64enc $ca.Cert) "tls.key" (b64enc $ca.Key)) "notAfter" (add $now (mul .Values.tls.caValidityDays 86400))) -}}
{{- end -}}
{{- $host := include "ponto.controlPlane.host" . -}}
{{- $cpNames := concat (list (include "ponto.part" (list . "control")) (printf "%s.%s" (include "ponto.part" (list . "control")) $ns) $host (printf "%s.%s" $host .Values.clusterDomain) "localhost") .Values.tls.extraDnsNames -}}
{{- /* The common names ponto-proxy and ponto-admin state the client role the control plane checks (Helm cannot write the URI name spiffe://ponto/role/...; docs/security.md). */ -}}
{{- $leaves := dict "control" (list "ponto-control-plane" $cpNames) "proxy" (list "ponto-proxy" list) "admin" (list "ponto-admin" list) -}}
{{- range $key := list "control" "proxy" "admin" -}}
{{- $name := include "ponto.part" (list $ (printf "%s-tls" $key)) -}}
{{- $old := lookup "v1" "Secret" $ns $name | default dict -}}
{{- $notAfter := int64 (dig "metadata" "annotations" "ponto.io/not-after" "0" $old) -}}
{{- if and (not $caFresh) $old.data (gt $notAfter $renewAt) -}}
{{- $_ := set $tls $key (dict "data" $old.data "notAfter" $notAfter) -}}
{{- else -}}
{{- $spec := get $leaves $key -}}
{{- $ips := ternary (list "127.0.0.1") list (eq $key "control") -}}
{{- $cert := genSignedCertWithKey (index $spec 0) $ips (index $spec 1) (int $.Values.tls.certValidityDays) $ca (genPrivateKey "ecdsa") -}}
{{- $_ := set $tls $key (dict "data" (dict "tls.crt" (b64enc $cert.Cert) "tls.key" (b64enc $cert.Key) "ca.crt" (b64enc $ca.Cert)) "notAfter" (add $now (mul $.Values.tls.certValidityDays 86400))) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $m "tls" $tls -}}
{{- end -}}
{{- $_ := set $ "pontoMaterial" $m -}}
{{- end -}}
{{- end -}}

{{/* A checksum of the secret material a component mounts. Call with (list $ "control"|"proxy"|"admin"). */}}
{{- define "ponto.material.checksum" -}}
{{- $root := index . 0 -}}
{{- include "ponto.material" $root -}}
{{- $m := $root.pontoMaterial -}}
{{- $tls := get (get $m "tls" | default dict) (index . 1) -}}
{{- /* The origin CA too: both read it once, at start (a configMap's content is
its owner's to roll, as an existing Secret's is). */ -}}
{{- list (get $m "tokens") $tls $root.Values.auth.existingSecret $root.Values.tls $root.Values.originCA | toJson | sha256sum -}}
{{- end -}}

{{/* Checks the schema cannot express; fails the render with the reason. */}}
{{- define "ponto.validate" -}}
{{- /* First: a long release name fails every longer name too, and this message says
what else goes wrong with it. */ -}}
{{- include "ponto.edge.validate" . -}}
{{- if include "ponto.etcd.bundled" . }}{{ $_ := include "ponto.statefulSetName" (list $ "etcd") }}{{ end -}}
{{- $regions := list -}}
{{- range .Values.proxy.regions }}{{ $regions = append $regions .name }}{{ end -}}
{{- range .Values.topology.extraRegions }}{{ $regions = append $regions .name }}{{ end -}}
{{- range $r := $regions -}}
{{- $n := 0 -}}
{{- range $regions }}{{ if eq . $r }}{{ $n = add1 $n }}{{ end }}{{ end -}}
{{- if gt $n 1 -}}
{{- fail (printf "region %q is listed twice (proxy.regions and topology.extraRegions together)" $r) -}}
{{- end -}}
{{- end -}}
{{- range .Values.topology.origins -}}
{{- if not (has .region $regions) -}}
{{- fail (printf "origin %q is in region %q, which is neither in proxy.regions nor in topology.extraRegions" .name .region) -}}
{{- end -}}
{{- end -}}
{{- $proxyRegions := list -}}
{{- range .Values.proxy.regions }}{{ $proxyRegions = append $proxyRegions .name }}{{ end -}}
{{- /* The Services made per region, by name: each name is checked against the DNS
label limit (the longest, "<fullname>-proxy-<region>-metrics", included), and two
regions must not make the same one (regions "us" and "us-metrics"), which would
render one Service over the other. */ -}}
{{- $services := dict -}}
{{- range $r := $proxyRegions -}}
{{- $made := list (list (printf "proxy-%s" $r) "proxy Service") (list (printf "proxy-%s-metrics" $r) "metrics Service") -}}
{{- if include "ponto.redis.deployed" (list $ $r) -}}
{{- $made = append $made (list (printf "redis-%s" $r) "Redis Service") -}}
{{- end -}}
{{- range $made -}}
{{- $name := include "ponto.part" (list $ (index . 0)) -}}
{{- $what := printf "the %s of region %q" (index . 1) $r -}}
{{- with get $services $name -}}
{{- fail (printf "%s and %s would both be named %q: rename one of the regions" . $what $name) -}}
{{- end -}}
{{- $_ := set $services $name $what -}}
{{- end -}}
{{- end -}}
{{- range $region, $_ := .Values.cache.redis.urls -}}
{{- if not (has $region $proxyRegions) -}}
{{- fail (printf "cache.redis.urls names region %q, which is not in proxy.regions" $region) -}}
{{- end -}}
{{- end -}}
{{- /* A password file goes with an external store whose URL holds none: the
chart's own servers run without a password, and a password in the URL too is
refused by the proxy (two passwords). */ -}}
{{- if .Values.cache.redis.passwordSecret.name -}}
{{- range $r := $proxyRegions -}}
{{- if include "ponto.redis.deployed" (list $ $r) -}}
{{- fail (printf "cache.redis.passwordSecret is set, but region %q uses the chart's own Redis (cache.redis.deploy), which runs without a password: give that region an external store (cache.redis.url or urls) or unset passwordSecret" $r) -}}
{{- end -}}
{{- end -}}
{{- range $url := prepend (values (.Values.cache.redis.urls | default dict)) (.Values.cache.redis.url | default "") -}}
{{- /* In the user part, or as a password= option, which the proxy's client reads too. */ -}}
{{- if or (regexMatch "^[a-z]+://[^/@]*:[^/@]*@" $url) (regexMatch "(?i)[?&]password=[^&]" $url) -}}
{{- fail "cache.redis.passwordSecret is set, and a cache.redis URL holds a password too: take it out of the URL (the proxy refuses two)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* A stopping proxy pod: the preStop sleep, then SIGTERM, after which each worker
answers for --drain-seconds and its supervisor gives it 75 s more (up to 60 s for
requests still running, then its clean-up; dataplane/supervisor.py SHUTDOWN_GRACE_S).
A grace period shorter than all of it has the kubelet kill streams the proxy would
have finished. */ -}}
{{- $p := .Values.proxy -}}
{{- $stop := addf ($p.preStopSleepSeconds | float64) ($p.drainSeconds | float64) 75 -}}
{{- if lt ($p.terminationGracePeriodSeconds | float64) $stop -}}
{{- fail (printf "proxy.terminationGracePeriodSeconds %v is below what a stopping proxy may take, %v s: preStopSleepSeconds %v, then drainSeconds %v, then 75 s (up to 60 s for requests still running, then the clean-up); past the grace period the kubelet kills the proxy and cuts its streams: raise terminationGracePeriodSeconds to %v or lower the others" $p.terminationGracePeriodSeconds $stop $p.preStopSleepSeconds $p.drainSeconds (ceil $stop)) -}}
{{- end -}}
{{- if .Values.controlPlane.enabled }}{{ include "ponto.resources.check" (list .Values.controlPlane.resources "controlPlane") }}{{ end -}}
{{- if include "ponto.etcd.bundled" . }}{{ include "ponto.resources.check" (list .Values.etcd.resources "etcd") }}{{ end -}}
{{- range .Values.proxy.regions }}{{ if include "ponto.redis.deployed" (list $ .name) }}{{ include "ponto.resources.check" (list $.Values.cache.redis.resources "cache.redis") }}{{ end }}{{ end -}}
{{- if include "ponto.topology.applied" . }}{{ include "ponto.resources.check" (list .Values.topology.job.resources "topology.job") }}{{ end -}}
{{- if and .Values.geoip.enabled (not .Values.geoip.volume) -}}
{{- fail "geoip.enabled needs geoip.volume: the volume that holds the .mmdb file" -}}
{{- end -}}
{{- /* The proxies of other clusters check the control plane's certificate against the
host they dial (their controlPlane.address), which is no in-cluster name: a generated
certificate covers only the names listed. */ -}}
{{- $given := .Values.tls.existingSecrets -}}
{{- if and .Values.controlPlane.enabled .Values.controlPlane.externalService.enabled .Values.tls.enabled (not $given.controlPlane) (not .Values.tls.extraDnsNames) -}}
{{- fail "controlPlane.externalService is enabled: list the DNS name the other clusters' proxies dial (their controlPlane.address) in tls.extraDnsNames, or they refuse the control plane's generated certificate" -}}
{{- end -}}
{{- end -}}

{{/*
A CPU quantity in millicores: "2" and 2 -> 2000, "1500m" -> 1500, 2.5 and "2.5" -> 2500;
none ("" or absent) -> 0.
*/}}
{{- define "ponto.cpu.millis" -}}
{{- $cpu := . | default "" | toString -}}
{{- if hasSuffix "m" $cpu -}}
{{- trimSuffix "m" $cpu | atoi -}}
{{- else if $cpu -}}
{{- mulf ($cpu | float64) 1000 | floor | int -}}
{{- else -}}
0
{{- end -}}
{{- end -}}

{{/*
A resource quantity as a number, for comparing a request with its limit: "2",
"1500m", 2.5, "256Mi", "1Gi", "500M", "1e3". Binary (Ki..Ei) and decimal (n..E)
suffixes: every form the schema's `quantity` pattern lets through.
*/}}
{{- define "ponto.quantity" -}}
{{- $q := . | toString -}}
{{- $units := dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "m" 1e-3 "u" 1e-6 "n" 1e-9 -}}
{{- $value := "" -}}
{{- range $unit := list "Ki" "Mi" "Gi" "Ti" "Pi" "Ei" "k" "M" "G" "T" "P" "E" "m" "u" "n" -}}
{{- if and (not $value) (hasSuffix $unit $q) -}}
{{- $value = mulf (trimSuffix $unit $q | float64) (get $units $unit) | toString -}}
{{- end -}}
{{- end -}}
{{- $value | default ($q | float64 | toString) -}}
{{- end -}}

{{/*
Fails the render when a request is above its limit, naming the values to change (the
API server would refuse the workload, long after the render). The proxies' resources
are checked after their merge, by "ponto.proxy.resources". Call with (list resources
where), where the values' path ("controlPlane").
*/}}
{{- define "ponto.resources.check" -}}
{{- $res := index . 0 | default dict -}}
{{- $where := index . 1 -}}
{{- with include "ponto.resources.over" $res -}}
{{- $request := index $res "requests" . -}}
{{- $limit := index $res "limits" . -}}
{{- fail (printf "%s.resources: requests.%s %v is above limits.%s %v: lower the request or raise the limit" $where . $request . $limit) -}}
{{- end -}}
{{- end -}}

{{/*
The first resource (by name) whose request is above its limit in resources (a dict of
requests and limits), "" for none: each caller fails with its own advice.
*/}}
{{- define "ponto.resources.over" -}}
{{- $limits := get . "limits" | default dict -}}
{{- $over := "" -}}
{{- range $k, $request := (get . "requests" | default dict) -}}
{{- $limit := get $limits $k -}}
{{- if and (not $over) $request $limit (gt (include "ponto.quantity" $request | float64) (include "ponto.quantity" $limit | float64)) -}}
{{- $over = $k -}}
{{- end -}}
{{- end -}}
{{- $over -}}
{{- end -}}

{{/*
A region's proxy resources: its own requests and limits merged key by key over
proxy.resources (requests and limits each on their own), so that a region giving only
`requests: {cpu: "1"}` keeps the default limits. A key the region sets to null is
dropped (e.g. `limits: {cpu: null}`: no CPU limit in that region). A request above
its limit after the merge fails the render, naming the values to set (the API server
would refuse the Deployment). Returns YAML. Call with (list proxy.resources
region.resources where), where naming the region in the message.
*/}}
{{- define "ponto.proxy.resources" -}}
{{- $base := index . 0 | default dict -}}
{{- $own := index . 1 | default dict -}}
{{- $where := index . 2 -}}
{{- $out := dict -}}
{{- range $part := list "requests" "limits" -}}
{{- $q := deepCopy (get $base $part | default dict) -}}
{{- range $k, $v := (get $own $part | default dict) -}}
{{- if kindIs "invalid" $v -}}
{{- $_ := unset $q $k -}}
{{- else -}}
{{- $_ := set $q $k $v -}}
{{- end -}}
{{- end -}}
{{- if $q -}}
{{- $_ := set $out $part $q -}}
{{- end -}}
{{- end -}}
{{- with include "ponto.resources.over" $out -}}
{{- $request := index $out "requests" . -}}
{{- $limit := index $out "limits" . -}}
{{- fail (printf "%s: resources.requests.%s %v is above resources.limits.%s %v (a region's resources merge key by key over proxy.resources): set the region's limits.%s (or requests.%s), or null for none" $where . $request . $limit . .) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
ponto-proxy --workers: the given count, else the whole cores of the CPU limit ("2" and
2 -> 2, "1500m" and 1.5 -> 1, at least 1), else 1. One worker per core the container
may use: more would only share the same quota, so a count above the whole cores of
the CPU limit fails the render; 1 never does (a pod has one worker at least, and
workers 0 gives 1 under the same limit). Call with (list workers resources where),
where naming the values ("proxy" or "region NAME") in the message.
*/}}
{{- define "ponto.proxy.workers" -}}
{{- $workers := index . 0 | default 0 | int -}}
{{- $cpu := dig "limits" "cpu" "" ((index . 1) | default dict) -}}
{{- $millis := include "ponto.cpu.millis" $cpu | int -}}
{{- $cores := max 1 (div $millis 1000) -}}
{{- if and $workers $millis (gt $workers $cores) -}}
{{- fail (printf "%s: workers %d is above the CPU limit %v (resources.limits.cpu): each worker is an event loop that needs a whole core; lower workers, raise the limit, or set it to null for none" (index . 2) $workers $cpu) -}}
{{- end -}}
{{- if not $workers -}}
{{- $workers = $cores -}}
{{- end -}}
{{- $workers -}}
{{- end -}}

{{/*
The CPU one proxy pod can use, in millicores: a core per worker, capped by the CPU
limit when there is one. The HPA's target is a share of it. Call with (list workers
resources), workers as "ponto.proxy.workers" returns it.
*/}}
{{- define "ponto.proxy.cpuCapacity" -}}
{{- $cores := mul (index . 0 | int) 1000 -}}
{{- $limit := include "ponto.cpu.millis" (dig "limits" "cpu" "" ((index . 1) | default dict)) | int -}}
{{- ternary (min $cores $limit) $cores (gt $limit 0) -}}
{{- end -}}

{{/* An alert's labels: its severity and alerts.alertLabels. Call with (list alerts "key"). */}}
{{- define "ponto.alert.labels" -}}
{{- $a := index . 0 -}}
labels:
  severity: {{ (get $a (index . 1)).severity }}
  {{- with $a.alertLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}

{{/* runbook_url of an alert when alerts.runbookUrl is set. Call with (list alerts "AlertName"). */}}
{{- define "ponto.alert.runbookUrl" -}}
{{- $a := index . 0 -}}
{{- with $a.runbookUrl -}}
runbook_url: {{ printf "%s#%s" . (index $ 1 | lower) | quote }}
{{- end -}}
{{- end -}}

{{/*
The regional cache's store for a region's proxies (ponto-proxy --redis), by precedence:
cache.redis.urls[region]; the urlSecret's URL ($(PONTO_REDIS_URL), which the proxy's
env reads from the Secret and the kubelet expands into the argument: the pod spec never
holds the password, the process's command line does); cache.redis.url; the chart's own server for the region
when deploy is on; else "" (per-pod caches). Call with (list $ regionName).
*/}}
{{- define "ponto.redis.url" -}}
{{- $root := index . 0 -}}
{{- $region := index . 1 -}}
{{- $r := $root.Values.cache.redis -}}
{{- if hasKey ($r.urls | default dict) $region -}}
{{- get $r.urls $region -}}
{{- else if $r.urlSecret.name -}}
$(PONTO_REDIS_URL)
{{- else if $r.url -}}
{{- $r.url -}}
{{- else if $r.deploy -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "ponto.part" (list $root (printf "redis-%s" $region))) $root.Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* "true" when the chart runs the region's store itself. Call with (list $ regionName). */}}
{{- define "ponto.redis.deployed" -}}
{{- $root := index . 0 -}}
{{- $r := $root.Values.cache.redis -}}
{{- if and $r.deploy (not $r.url) (not $r.urlSecret.name) (not (hasKey ($r.urls | default dict) (index . 1))) -}}
true
{{- end -}}
{{- end -}}

{{/*
The ConfigMap holding the origin CA bundle (key ca.crt), "" when none is set.
*/}}
{{- define "ponto.originCA.configMap" -}}
{{- if and .Values.originCA.bundle .Values.originCA.configMap -}}
{{- fail "originCA: set bundle or configMap, not both" -}}
{{- else if .Values.originCA.bundle -}}
{{ include "ponto.fullname" . }}-origin-ca
{{- else -}}
{{ .Values.originCA.configMap }}
{{- end -}}
{{- end -}}

{{/*
Pod topology spread constraints as given, each with the component's own pods as its
labelSelector when it names none (a constraint without one counts no pods at all).
Call with (list constraints selectorYaml).
*/}}
{{- define "ponto.spread" -}}
{{- $selector := index . 1 | fromYaml -}}
{{- $out := list -}}
{{- range index . 0 -}}
{{- $c := deepCopy . -}}
{{- if not (hasKey $c "labelSelector") -}}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) -}}
{{- end -}}
{{- $out = append $out $c -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
HOST:PORT a server of the release listens on, every address of the pod's:
listenAddress "0.0.0.0" (IPv4) or "::" (IPv6 and IPv4: every server takes
IPv4 connections there too, as IPv4-mapped addresses). Call with (list $ port).
*/}}
{{- define "ponto.listen" -}}
{{- $host := (index . 0).Values.listenAddress -}}
{{- if contains ":" $host -}}[{{ $host }}]:{{ index . 1 }}{{- else -}}{{ $host }}:{{ index . 1 }}{{- end -}}
{{- end -}}
