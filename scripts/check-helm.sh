#!/usr/bin/env bash
# Checks the Helm chart deploy/helm/adsrelay against the kustomize manifests it mirrors, without a
# cluster:
#   1. the chart's copy of the alerting rules (files/alerts.yaml) is byte-identical to
#      deploy/prometheus/alerts.yaml, and every kustomize overlay deploy/k8s/overlays/<region> has
#      its values file deploy/helm/regions/<region>.yaml (and the other way round);
#   2. `helm lint --strict` passes with the default values and with each region's values;
#   3. `helm template` renders with the default values, each region's values and a variant that
#      flips the chart's switches (autoscaling and NetworkPolicy off, names overridden, extra TOML);
#   4. the renders validate against the Kubernetes schemas (kubernetes-validate, strict: unknown
#      fields fail), with the CRD objects (ServiceMonitor, PrometheusRule) split off and checked
#      structurally instead, as scripts/check-deploy.sh does: the ServiceMonitor selects the admin
#      Service and its port, the PrometheusRule's groups equal deploy/prometheus/alerts.yaml;
#   5. one source of truth: object by object (kind + name), `helm template` with the default values
#      equals `kubectl kustomize deploy/k8s/base`, and with deploy/helm/regions/<region>.yaml equals
#      `kubectl kustomize deploy/k8s/overlays/<region>` (both with the Namespace and the monitoring
#      objects switched on, as kustomize always renders them). Before comparing: label and
#      annotation order is ignored; Helm's own labels (helm.sh/chart, app.kubernetes.io/managed-by,
#      app.kubernetes.io/instance, app.kubernetes.io/version) and the pod template's checksum/config
#      annotation are dropped; kustomize's hashed ConfigMap name (adsrelay-config-<hash>) is read as
#      adsrelay-config; relay.toml is compared as parsed TOML (the chart writes it from values, so
#      comments and key order differ). Any other difference fails, with a diff;
#   6. a relay.toml change changes the pod template's checksum/config annotation (it rolls the pods).
#
# Tools: helm v4.3.2, built from its Go module (helm.sh/helm/v4/cmd/helm) into target/tools/ with
# `go install` (minutes the first time, seconds from Go's build cache; skipped when
# target/tools/helm reports that version); kubectl
# and kubernetes-validate into .venv, at the versions scripts/check-deploy.sh pins.
#
# Usage: scripts/check-helm.sh [--install-only]
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_VERSION="v4.3.2"
HELM_MODULE="helm.sh/helm/v4/cmd/helm"
PYYAML_PKG="PyYAML==6.0.4"
# One pin for both scripts: kubectl, kubernetes-validate and the schema version of check-deploy.sh.
pin() { sed -n "s/^$1=\"\(.*\)\"$/\1/p" scripts/check-deploy.sh; }
KUBECTL_PKG="$(pin KUBECTL_PKG)"
VALIDATE_PKG="$(pin VALIDATE_PKG)"
K8S_VERSION="$(pin K8S_VERSION)"
[ -n "$KUBECTL_PKG" ] && [ -n "$VALIDATE_PKG" ] && [ -n "$K8S_VERSION" ] \
  || { echo "check-helm: cannot read the tool pins from scripts/check-deploy.sh" >&2; exit 1; }

TOOLS="$PWD/target/tools"
HELM="$TOOLS/helm"
VENV="$PWD/.venv"
CHART=deploy/helm/adsrelay
REGIONS=deploy/helm/regions

helm_version() { "$HELM" version --template '{{.Version}}' 2>/dev/null || true; }

install_tools() {
  if [ "$(helm_version)" != "$HELM_VERSION" ]; then
    command -v go >/dev/null || { echo "check-helm: Go is needed to build helm $HELM_VERSION" >&2; exit 1; }
    echo "check-helm: building helm $HELM_VERSION into target/tools (go install $HELM_MODULE@$HELM_VERSION; minutes the first time)"
    mkdir -p "$TOOLS"
    # Module mode (outside any go.mod). helm's Makefile stamps the version in with -X; without it
    # the binary reports only "v4.3". Link flags only: Go's build cache serves every package.
    (cd "$TOOLS" && GOBIN="$TOOLS" go install \
      -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
      "$HELM_MODULE@$HELM_VERSION")
    local got
    got="$(helm_version)"
    [ "$got" = "$HELM_VERSION" ] || { echo "check-helm: built helm reports '$got', want $HELM_VERSION" >&2; exit 1; }
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  local want=()
  # (Not `kubectl ... | grep -q`: under pipefail, grep's early exit can fail the pipeline.)
  case "$("$VENV/bin/kubectl" version --client 2>/dev/null || true)" in
    *"v${KUBECTL_PKG##*==}"*) ;;
    *) want+=("$KUBECTL_PKG") ;;
  esac
  [ -x "$VENV/bin/kubernetes-validate" ] || want+=("$VALIDATE_PKG")
  "$VENV/bin/python" -c 'import yaml' 2>/dev/null || want+=("$PYYAML_PKG")
  if [ ${#want[@]} -gt 0 ]; then
    echo "check-helm: installing ${want[*]}"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "${want[@]}"
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
# Keep helm away from the user's repositories, plugins and caches.
export HELM_CACHE_HOME="$OUT/helm/cache" HELM_CONFIG_HOME="$OUT/helm/config" HELM_DATA_HOME="$OUT/helm/data"
fail=0
step() { echo "== $*"; }
RELEASE=adsrelay
NAMESPACE=adsrelay
# Render as for the cluster version the manifests are validated against.
HELM_TEMPLATE=("$HELM" template "$RELEASE" "$CHART" -n "$NAMESPACE" --kube-version "$K8S_VERSION")
# What kustomize always renders and the chart switches off by default.
ALL_ON=(--set namespace.create=true --set monitoring.serviceMonitor.enabled=true
        --set monitoring.prometheusRule.enabled=true)

# 1. The rules copy, and one values file per overlay.
step "chart rules $CHART/files/alerts.yaml = deploy/prometheus/alerts.yaml"
if ! cmp -s "$CHART/files/alerts.yaml" deploy/prometheus/alerts.yaml; then
  diff -u deploy/prometheus/alerts.yaml "$CHART/files/alerts.yaml" || true
  echo "FAIL: $CHART/files/alerts.yaml differs from deploy/prometheus/alerts.yaml:" \
    "cp deploy/prometheus/alerts.yaml $CHART/files/alerts.yaml" >&2
  fail=1
fi
regions=()
for d in deploy/k8s/overlays/*/; do regions+=("$(basename "$d")"); done
[ ${#regions[@]} -ge 2 ] || { echo "check-helm: no overlays in deploy/k8s/overlays" >&2; exit 1; }
step "region values: ${regions[*]}"
for r in "${regions[@]}"; do
  [ -f "$REGIONS/$r.yaml" ] || { echo "FAIL: overlay $r has no $REGIONS/$r.yaml" >&2; fail=1; }
done
for f in "$REGIONS"/*.yaml; do
  r="$(basename "$f" .yaml)"
  [ -d "deploy/k8s/overlays/$r" ] || { echo "FAIL: $f has no overlay deploy/k8s/overlays/$r" >&2; fail=1; }
done

# 2. Lint.
lint() {
  step "helm lint --strict $CHART $*"
  "$HELM" lint --strict --quiet "$CHART" -n "$NAMESPACE" --kube-version "$K8S_VERSION" "$@" \
    || { echo "FAIL: helm lint $*" >&2; fail=1; }
}
lint
lint "${ALL_ON[@]}"
for r in "${regions[@]}"; do
  [ -f "$REGIONS/$r.yaml" ] && lint -f "$REGIONS/$r.yaml"
done

# 3. Render: "name|helm arguments". `variant` flips the chart's switches, so every branch of the
#    templates is rendered and validated (and its relay.toml differs from `base`'s: check 6).
cat >"$OUT/variant.yaml" <<'EOF'
fullnameOverride: relay
region: test-1
autoscaling: { enabled: false }
networkPolicy: { enabled: false }
podDisruptionBudget: { maxUnavailable: 25% }
snapshotVolume: { sizeLimit: null }
imagePullSecrets: [{ name: registry }]
nodeSelector: { kubernetes.io/os: linux }
tolerations: [{ key: dedicated, value: xds, effect: NoSchedule }]
podAnnotations: { example.com/team: xds }
podLabels: { example.com/tier: edge }
config:
  upstream: other-control-plane:18000
  max_connections: 10000
  group_metadata_keys: [env]
  unsubscribe_linger: null
extraConfig: |
  [[groups]]
  cluster = "edge-*"
  name = "edge-{cluster}"
monitoring:
  labels: { release: prometheus }
  serviceMonitor: { enabled: true }
  prometheusRule: { enabled: true }
EOF
renders=("default|" "base|${ALL_ON[*]}" "variant|-f $OUT/variant.yaml")
for r in "${regions[@]}"; do
  [ -f "$REGIONS/$r.yaml" ] && renders+=("$r|-f $REGIONS/$r.yaml ${ALL_ON[*]}")
done
rendered=()
for spec in "${renders[@]}"; do
  name="${spec%%|*}"
  read -r -a args <<<"${spec#*|}"
  step "helm template $name ${args[*]:-}"
  if "${HELM_TEMPLATE[@]}" "${args[@]}" >"$OUT/helm-$name.yaml"; then
    rendered+=("$name")
  else
    echo "FAIL: helm template ($name) failed" >&2
    fail=1
  fi
done

# 4 and 5. Kustomize renders to compare with.
kustomized=()
for t in base "${regions[@]}"; do
  dir=deploy/k8s/overlays/$t
  [ "$t" = base ] && dir=deploy/k8s/base
  step "kubectl kustomize $dir"
  if "$KUBECTL" kustomize "$dir" >"$OUT/kustomize-$t.yaml"; then
    kustomized+=("$t")
  else
    echo "FAIL: kustomize could not render $dir" >&2
    fail=1
  fi
done

step "split CRDs, check them, compare with kustomize"
if ! "$PY" - "$OUT" deploy/prometheus/alerts.yaml "${rendered[*]}" "${kustomized[*]}" <<'PYEOF'
import difflib, sys, tomllib, yaml
out, alerts_path, rendered, kustomized = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
alerts = yaml.safe_load(open(alerts_path))
CRD_GROUPS = {"monitoring.coreos.com"}
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version"}
HELM_ANNOTATIONS = {"checksum/config"}
errors = []

def load(path):
    return [d for d in yaml.safe_load_all(open(path)) if d]

def ident(d):
    return f"{d['kind']}/{d['metadata']['name']}"

def matches(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())

# 4. CRDs out of the schema validation, checked structurally; the rest written for
#    kubernetes-validate.
for name in rendered:
    docs = load(f"{out}/helm-{name}.yaml")
    core = [d for d in docs if d["apiVersion"].split("/")[0] not in CRD_GROUPS]
    crds = [d for d in docs if d["apiVersion"].split("/")[0] in CRD_GROUPS]
    yaml.safe_dump_all(core, open(f"{out}/helm-{name}.core.yaml", "w"), sort_keys=False)
    svcs = [d for d in docs if d["kind"] == "Service"]
    deps = [d for d in docs if d["kind"] == "Deployment"]
    pod = deps[0]["spec"]["template"] if len(deps) == 1 else None
    if pod is None:
        errors.append(f"{name}: expected one Deployment, found {len(deps)}")
    for d in crds:
        meta = d["metadata"]
        if d["apiVersion"] != "monitoring.coreos.com/v1" or not meta.get("namespace"):
            errors.append(f"{name}: {ident(d)}: apiVersion {d['apiVersion']}, namespace {meta.get('namespace')}")
        if d["kind"] == "ServiceMonitor":
            picked = [s for s in svcs if matches(d["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
            ports = {p["name"] for s in picked for p in s["spec"]["ports"]}
            for ep in d["spec"]["endpoints"]:
                if ep["port"] not in ports or ep.get("path") != "/metrics":
                    errors.append(f"{name}: ServiceMonitor endpoint {ep} does not scrape /metrics on a selected Service port ({ports})")
                region = (pod or {}).get("metadata", {}).get("labels", {}).get("region")
                relabel = [r for r in ep.get("relabelings", []) if r.get("targetLabel") == "region"]
                if region and (not relabel or relabel[0].get("replacement") != region):
                    errors.append(f"{name}: ServiceMonitor does not relabel region to the pods' region {region}")
        elif d["kind"] == "PrometheusRule":
            if d["spec"]["groups"] != alerts["groups"]:
                errors.append(f"{name}: PrometheusRule groups differ from {alerts_path}")
        else:
            errors.append(f"{name}: unexpected CRD object {ident(d)}")
    kinds = {d["kind"] for d in crds}
    if len(kinds) == 2:
        rl = {d["kind"]: d["metadata"].get("labels", {}).get("release") for d in crds}
        if not rl["ServiceMonitor"] or rl["ServiceMonitor"] != rl["PrometheusRule"]:
            errors.append(f"{name}: ServiceMonitor and PrometheusRule need the same `release` label: {rl}")
    if pod is not None:
        if not pod["metadata"].get("annotations", {}).get("checksum/config"):
            errors.append(f"{name}: pod template has no checksum/config annotation")
        cms = {v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v}
        have = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
        for cm in cms:
            if cm not in have:
                errors.append(f"{name}: pod mounts ConfigMap {cm}, not rendered ({sorted(have)})")
                continue
            try:
                tomllib.loads(have[cm]["data"]["relay.toml"])
            except (KeyError, tomllib.TOMLDecodeError) as e:
                errors.append(f"{name}: ConfigMap {cm}: relay.toml missing or not TOML: {e}")
    print(f"   {name}: {len(core)} objects for schema validation; CRDs checked structurally: "
          f"{', '.join(ident(d) for d in crds) or 'none'}")

# 6. A config change rolls the pods.
def checksum(name):
    for d in load(f"{out}/helm-{name}.yaml"):
        if d["kind"] == "Deployment":
            return d["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/config")
if {"base", "variant"} <= set(rendered) and checksum("base") == checksum("variant"):
    errors.append("checksum/config does not change with relay.toml")

# 5. Helm against kustomize, object by object.
def normalize(docs, helm):
    docs = [yaml.safe_load(yaml.safe_dump(d)) for d in docs]
    if not helm:
        # configMapGenerator's hashed names -> the generator's name, everywhere they are referenced.
        renames = {}
        for d in docs:
            n = d["metadata"]["name"]
            if d["kind"] == "ConfigMap" and len(n) > 11 and n[-11] == "-":
                renames[n] = n[:-11]
        def walk(x):
            if isinstance(x, dict):
                return {k: walk(v) for k, v in x.items()}
            if isinstance(x, list):
                return [walk(v) for v in x]
            return renames.get(x, x) if isinstance(x, str) else x
        docs = [walk(d) for d in docs]
    for d in docs:
        for meta in (d.get("metadata", {}), d.get("spec", {}).get("template", {}).get("metadata")):
            if meta is None:
                continue
            for key, drop in (("labels", HELM_LABELS), ("annotations", HELM_ANNOTATIONS)):
                if helm and key in meta:
                    meta[key] = {k: v for k, v in meta[key].items() if k not in drop}
                if key in meta and not meta[key]:
                    del meta[key]
        if d["kind"] == "ConfigMap" and "relay.toml" in d.get("data", {}):
            d["data"]["relay.toml"] = tomllib.loads(d["data"]["relay.toml"])
    return {ident(d): d for d in docs}

def dump(d):
    return yaml.safe_dump(d, sort_keys=True, width=120).splitlines()

for target in kustomized:
    if target not in rendered:
        continue
    helm_objs = normalize(load(f"{out}/helm-{target}.yaml"), True)
    kust_objs = normalize(load(f"{out}/kustomize-{target}.yaml"), False)
    what = "deploy/k8s/base" if target == "base" else f"deploy/k8s/overlays/{target}"
    values = "default values" if target == "base" else f"deploy/helm/regions/{target}.yaml"
    for key in sorted(set(helm_objs) | set(kust_objs)):
        if key not in helm_objs:
            errors.append(f"{target}: {key} is in {what} but the chart ({values}) does not render it")
        elif key not in kust_objs:
            errors.append(f"{target}: the chart ({values}) renders {key}, {what} has no such object")
        elif helm_objs[key] != kust_objs[key]:
            diff = "\n".join(difflib.unified_diff(dump(kust_objs[key]), dump(helm_objs[key]),
                                                  f"kustomize {what}: {key}", f"helm {values}: {key}",
                                                  lineterm=""))
            errors.append(f"{target}: {key} differs (normalized):\n{diff}")
    same = len(set(helm_objs) & set(kust_objs))
    print(f"   {target}: helm and kustomize render {len(kust_objs)} and {len(helm_objs)} objects, "
          f"{same} by kind+name")
for e in errors:
    print(f"FAIL: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PYEOF
then
  fail=1
fi

core=()
for name in "${rendered[@]}"; do
  [ -f "$OUT/helm-$name.core.yaml" ] && core+=("$OUT/helm-$name.core.yaml")
done
if [ ${#core[@]} -gt 0 ]; then
  step "kubernetes-validate (Kubernetes $K8S_VERSION schemas, strict): ${rendered[*]}"
  if ! "$VENV/bin/kubernetes-validate" --strict --quiet -k "$K8S_VERSION" "${core[@]}"; then
    echo "FAIL: the chart's rendered manifests do not validate" >&2
    fail=1
  fi
fi

if [ "$fail" != 0 ]; then
  echo "check-helm: FAILED" >&2
  exit 1
fi
echo "check-helm: all helm checks passed"
