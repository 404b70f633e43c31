# What renders the Kubernetes overlays: kustomize v4 or later, embedded in
# kubectl (1.21+) or on its own (Debian 13's `kustomize`; Debian 12's
# kubectl 1.20 embeds v2). Sourced by deploy/check.sh and scripts/test.sh.
# shellcheck shell=bash

# kustomize_renderer: sets `render` (the command, to which an overlay's
# directory is appended) and `renderer` (what it is, for the log); returns 1
# when nothing here renders.
kustomize_renderer() {
  local v
  if kubectl version --client 2>/dev/null | grep -q 'Kustomize Version: v[4-9]'; then
    render=(kubectl kustomize)
    renderer="kubectl kustomize, kustomize $(kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: //p')"
    return 0
  fi
  # Debian's build of kustomize says "(devel)"; its package knows the version.
  v=$(kustomize version 2>/dev/null | head -n 1)
  case "$v" in "" | *devel*) v=$(dpkg-query -W -f='${Version}' kustomize 2>/dev/null) ;; esac
  if grep -q '^v\?[4-9]\.' <<<"$v"; then
    render=(kustomize build)
    renderer="kustomize build, kustomize $v"
    return 0
  fi
  return 1
}
