#!/usr/bin/env bash
# Checks everything under deploy/: renders each Kubernetes overlay with
# `kubectl kustomize`, validates the objects against the Kubernetes API
# schemas (kubernetes-validate, strict), scans them and the Dockerfile with
# checkov (every skipped check carries its reason in an annotation or
# comment), checks that only the gateway can read its admin token and that
# nodes read a Secret of their own (deploy/secret-scope.py), and checks and
# unit-tests the Prometheus rules with promtool.
# Installs kubernetes-validate and checkov into .venv-deploy once.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v promtool >/dev/null || { echo "deploy/check.sh: promtool is not installed (Debian: apt-get install prometheus)" >&2; exit 1; }
echo "== promtool"
promtool check rules deploy/prometheus/granary-rules.yaml
promtool test rules deploy/prometheus/granary-rules.test.yaml

# shellcheck source=deploy/kustomize.sh
source deploy/kustomize.sh
if ! kustomize_renderer; then
  echo "SKIPPED: the Kubernetes overlays were not rendered or validated: neither kubectl with kustomize v4+ nor kustomize v4+ is installed" >&2
  exit 0
fi
if ! .venv-deploy/bin/python -c 'import kubernetes_validate, checkov' 2>/dev/null; then
  echo "== installing kubernetes-validate and checkov into .venv-deploy (once)"
  python3 -m venv .venv-deploy
  .venv-deploy/bin/pip install -q 'kubernetes-validate==1.37.0' 'checkov==3.3.30'
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "== $renderer"
for dir in deploy/kubernetes/overlays/*/; do
  name=$(basename "$dir")
  "${render[@]}" "$dir" > "$out/$name.yaml"
  echo "$name: $(grep -c '^kind:' "$out/$name.yaml") objects ($(grep '^kind:' "$out/$name.yaml" | sort | uniq -c | awk '{printf "%s %s, ", $1, $3}' | sed 's/, $//'))"
done

echo "== secret scope (deploy/secret-scope.py)"
.venv-deploy/bin/python deploy/secret-scope.py "$out"/*.yaml

echo "== kubernetes-validate --strict (Kubernetes 1.37; ServiceMonitor is the Prometheus Operator's CRD, outside the API schemas: reported as a warning)"
.venv-deploy/bin/kubernetes-validate --strict --quiet "$out"/*.yaml

echo "== checkov (kubernetes objects and the Dockerfile)"
.venv-deploy/bin/checkov --quiet --compact --skip-download --framework kubernetes dockerfile \
  $(for f in "$out"/*.yaml; do printf -- '-f %s ' "$f"; done) -f deploy/Dockerfile
echo "== deploy checks passed"
