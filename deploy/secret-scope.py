"""Fails when a workload other than the gateway can read the gateway's admin
token (key `admin` of the Secret `granary-tokens`), or when a node (the
`granary-node` DaemonSet: agent and warehouse) reads `granary-tokens` at
all. Nodes get a Secret of their own (`granary-node-tokens`).

    python deploy/secret-scope.py RENDERED.yaml...
"""

import sys

import yaml

ADMIN_SECRET, ADMIN_KEY = "granary-tokens", "admin"
GATEWAY = "granary-gateway"
NODE = "granary-node"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "Pod", "ReplicaSet"}


def pod_spec(obj):
    spec = obj.get("spec") or {}
    if obj["kind"] == "Pod":
        return spec
    if obj["kind"] == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    return (spec.get("template") or {}).get("spec") or {}


def reads(spec):
    """Every (secret, key) a pod can read; key None: the whole Secret."""
    out = []
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        for e in c.get("env") or []:
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                out.append((ref.get("name"), ref.get("key")))
        for e in c.get("envFrom") or []:
            if e.get("secretRef"):
                out.append((e["secretRef"].get("name"), None))
    for v in spec.get("volumes") or []:
        sources = []
        if v.get("secret"):
            sources.append(v["secret"] | {"name": v["secret"].get("secretName")})
        for s in (v.get("projected") or {}).get("sources") or []:
            if s.get("secret"):
                sources.append(s["secret"])
        for s in sources:
            items = s.get("items")
            if items:
                out.extend((s.get("name"), i.get("key")) for i in items)
            else:
                out.append((s.get("name"), None))
    return out


def main(paths):
    problems, checked = [], 0
    for path in paths:
        with open(path) as f:
            for obj in yaml.safe_load_all(f):
                if not obj or obj.get("kind") not in WORKLOADS:
                    continue
                name = obj["metadata"]["name"]
                checked += 1
                for secret, key in reads(pod_spec(obj)):
                    what = f"{path}: {obj['kind']} {name} reads {secret}" + (f" key {key}" if key else " (every key)")
                    if name == NODE and secret == ADMIN_SECRET:
                        problems.append(f"{what}: a node reads {NODE}-tokens only")
                    elif name != GATEWAY and secret == ADMIN_SECRET and key in (ADMIN_KEY, None):
                        problems.append(f"{what}: only the gateway reads the admin token")
    for p in problems:
        print(f"secret scope: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"secret scope: {checked} workloads, none but the gateway can read the admin token; nodes read their own Secret")


if __name__ == "__main__":
    main(sys.argv[1:])
