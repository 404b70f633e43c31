# The cluster test's fleet: the network, ctl's services, Prometheus, the
# gateways and the nodes. Sourced by scripts/cluster-test.sh, which defines
# the hosts, the tokens, the run's directory and the helpers used here.
# shellcheck shell=bash

# ---------------------------------------------------------------- network

net_up() {
    ip netns add "$(ns sw)"
    ip -n "$(ns sw)" link add br0 type bridge
    ip -n "$(ns sw)" link set br0 up
    ip -n "$(ns sw)" link set lo up
    local h
    for h in "${HOSTS[@]}"; do
        ip netns add "$(ns "$h")"
        ip -n "$(ns "$h")" link set lo up
        # One link per host into the bridge; hosts see it as eth0.
        ip -n "$(ns sw)" link add "p-$h" type veth peer name eth0 netns "$(ns "$h")"
        ip -n "$(ns sw)" link set "p-$h" master br0 up
        ip -n "$(ns "$h")" addr add "${ADDR[$h]}/24" dev eth0
        [[ -n "${STOR[$h]:-}" && $h != ctl ]] && ip -n "$(ns "$h")" addr add "${STOR[$h]}/24" dev eth0
        ip -n "$(ns "$h")" link set eth0 up
    done
    # ctl's storage link: the S3 tier's own veth, so taking it down
    # partitions the tier and nothing else. Answer ARP only on the link that
    # holds the address, or eth0 would answer for it during the partition.
    ip -n "$(ns sw)" link add p-stor type veth peer name stor0 netns "$(ns ctl)"
    ip -n "$(ns sw)" link set p-stor master br0 up
    # (Written to /proc/sys, which shows the writer's namespace: a minimal
    # Debian has no sysctl program.)
    on ctl sh -c 'echo 1 >/proc/sys/net/ipv4/conf/all/arp_ignore && echo 1 >/proc/sys/net/ipv4/conf/eth0/arp_ignore' ||
        return 1
    ip -n "$(ns ctl)" addr add "${STOR[ctl]}/24" dev stor0
    ip -n "$(ns ctl)" link set stor0 up
}

# storage_delay_on MS: adds MS milliseconds each way on ctl's storage link.
# The link (p-stor) moves from the fleet's bridge to a bridge of its own,
# joined back to the fleet's through two TAP devices by delay-wire.py,
# which holds every frame MS before passing it on: what `tc qdisc ... netem
# delay` on both ends of the link would do, on kernels built with or
# without netem (the one this was written on has none).
storage_delay_on() {
    # The TUN/TAP device node, where /dev was populated without it.
    [[ -c /dev/net/tun ]] || { mkdir -p /dev/net && mknod /dev/net/tun c 10 200; } || return 1
    ip -n "$(ns sw)" link add br-stor type bridge &&
        ip -n "$(ns sw)" link set br-stor up &&
        ip -n "$(ns sw)" tuntap add dev dw-stor mode tap &&
        ip -n "$(ns sw)" tuntap add dev dw-fleet mode tap &&
        ip -n "$(ns sw)" link set dw-stor master br-stor up &&
        ip -n "$(ns sw)" link set dw-fleet master br0 up || return 1
    start sw delay-wire python3 "$ROOT/scripts/cluster/delay-wire.py" --delay-ms "$1" dw-stor dw-fleet
    wait_for "the delay wire" 10 log_has delay-wire "delay-wire: ready" || return 1
    ip -n "$(ns sw)" link set p-stor master br-stor
}
# storage_delay_off: the storage link back on the fleet's bridge, the wire
# stopped; prints what it carried.
storage_delay_off() {
    # Off the fleet's bridge first, so that no address is still learned
    # behind the wire once the link is back.
    ip -n "$(ns sw)" link set dw-fleet nomaster
    ip -n "$(ns sw)" link set p-stor master br0
    kill -TERM "${PIDS[delay-wire]}"
    wait_for "the delay wire to stop" 10 bash -c "! kill -0 ${PIDS[delay-wire]}"
    ip -n "$(ns sw)" link del dw-fleet
    ip -n "$(ns sw)" link del dw-stor
    ip -n "$(ns sw)" link del br-stor
    sed -n 's/^delay-wire: a->b \([0-9]*\) frames, b->a \([0-9]*\) frames, dropped \([0-9]*\)$/delay wire: \2 frames to S3, \1 back, \3 dropped/p' \
        "$LOGS/delay-wire.log"
}
# s3_rtt_ms HOST: the round trip from HOST to the S3 tier in ms: the median
# of five TCP connects that succeeded, of at most twenty tries ("none" if
# none did). Right after the storage link moves behind the delay wire the
# bridges may still be learning where S3 is, and a connect that fails
# reports 0 ms.
s3_rtt_ms() {
    local i t got=()
    for i in $(seq 20); do
        t=$(on "$1" curl -s -o /dev/null --max-time 2 -w '%{time_connect}' "http://$S3_ADDR/") || t=0
        if awk -v t="$t" 'BEGIN { exit !(t > 0) }'; then got+=("$t"); fi
        [[ ${#got[@]} -ge 5 ]] && break
        [[ $i -gt ${#got[@]} ]] && sleep 0.2
    done
    [[ ${#got[@]} -gt 0 ]] || { echo none; return; }
    printf '%s\n' "${got[@]}" | sort -n | awk '{ v[NR] = $1 } END { printf "%.2f\n", v[int((NR + 1) / 2)] * 1000 }'
}

# ---------------------------------------------------------------- waiting

# wait_for WHAT SECONDS CMD...: runs CMD every 0.1 s until it succeeds.
wait_for() {
    local what=$1 limit=$2 deadline
    shift 2
    deadline=$(($(date +%s%N) + limit * 1000000000))
    until "$@" >/dev/null 2>&1; do
        if [[ $(date +%s%N) -gt $deadline ]]; then
            echo "cluster-test: timed out after ${limit}s waiting for $what" >&2
            return 1
        fi
        sleep 0.1
    done
}
log_has() { grep -q -- "$2" "$LOGS/$1.log"; }
http_ok() {
    local h=$1
    shift
    on "$h" curl -fsS --max-time 2 -o /dev/null "$@"
}

# ---------------------------------------------------------------- ctl

start_ctl() {
    # PostgreSQL, as a user that is not root (initdb refuses root), data in
    # the run's directory; trust authentication for the cluster's network only.
    local owner=nobody
    id postgres >/dev/null 2>&1 && owner=postgres
    mkdir -p "$DIR/pg"
    chown "$owner" "$DIR/pg"
    runuser -u "$owner" -- "$PG_BIN/initdb" -D "$DIR/pg/data" -U granary -A trust -E UTF8 --no-sync \
        >"$LOGS/initdb.log" 2>&1 || { cat "$LOGS/initdb.log" >&2; return 1; }
    echo "host all all 198.18.0.0/24 trust" >>"$DIR/pg/data/pg_hba.conf"
    touch "$LOGS/postgres.log"
    chown "$owner" "$LOGS/postgres.log"
    on ctl runuser -u "$owner" -- "$PG_BIN/pg_ctl" -D "$DIR/pg/data" -l "$LOGS/postgres.log" -w -t 30 \
        -o "-c listen_addresses=${ADDR[ctl]} -p 5432 -k $DIR/pg -c fsync=off -c synchronous_commit=off" \
        start >/dev/null || return 1
    on ctl runuser -u "$owner" -- "$PG_BIN/createdb" -h "${ADDR[ctl]}" -U granary granary || return 1

    start ctl redis redis-server --bind "${ADDR[ctl]}" --port 6379 --save '' --appendonly no \
        --protected-mode no --dir "$DIR"

    mkdir -p "$DIR/s3/granary-kv"
    start ctl s3s-fs "$S3S_FS" --host "${STOR[ctl]}" --port 9000 \
        --access-key "$S3_KEY" --secret-key "$S3_SECRET" "$DIR/s3"

    start ctl registry env GRANARY_REGISTRY_ADMIN_TOKEN="$REG_ADMIN" "$BIN" registry serve \
        --listen "${ADDR[ctl]}:8400" --data-dir "$DIR/registry" --read-token "$REG_READ"
    wait_for "the registry" 60 log_has registry "granary registry: ready" || return 1
    on ctl env GRANARY_REGISTRY_TOKEN="$REG_ADMIN" "$BIN" registry import "dir:$(dirname "$MODEL")" \
        --name smollm2 --revision 0.1.2 --license apache-2.0 --url "http://${ADDR[ctl]}:8400" \
        >"$LOGS/import.log" 2>&1 || { cat "$LOGS/import.log" >&2; return 1; }
    start_prometheus
    wait_for "redis" 20 on ctl redis-cli -h "${ADDR[ctl]}" ping || return 1
    wait_for "s3s-fs" 20 on node1 bash -c "exec 3<>/dev/tcp/${STOR[ctl]}/9000" || return 1
}

# ---------------------------------------------------------------- prometheus

# Prometheus on ctl scrapes every component each second: the gateways and
# warehouses with the metrics-only token, the registry with its read token,
# the engines (open /metrics) from a file the script rewrites as they move.
start_prometheus() {
    mkdir -p "$DIR/prometheus"
    echo '[]' >"$DIR/prometheus/engines.json"
    cat >"$DIR/prometheus/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: gateway
    authorization: { credentials_file: $DIR/metrics-token }
    static_configs: [{ targets: ["${ADDR[gw1]}:8080", "${ADDR[gw2]}:8080"] }]
  - job_name: warehouse
    authorization: { credentials_file: $DIR/metrics-token }
    static_configs: [{ targets: ["${ADDR[node1]}:8300", "${ADDR[node2]}:8300"] }]
  - job_name: registry
    authorization: { credentials_file: $DIR/registry-read-token }
    static_configs: [{ targets: ["${ADDR[ctl]}:8400"] }]
  - job_name: engine
    file_sd_configs: [{ files: ["$DIR/prometheus/engines.json"], refresh_interval: 1s }]
EOF
    start ctl prometheus prometheus --config.file="$DIR/prometheus/prometheus.yml" \
        --storage.tsdb.path="$DIR/prometheus/data" --web.listen-address="${ADDR[ctl]}:9090"
}
# The engines' addresses, for Prometheus.
engines_sd() {
    jq -n --arg a "${ENGINE1#http://}" --arg b "${ENGINE2#http://}" \
        '[{targets: [$a], labels: {node: "node1"}}, {targets: [$b], labels: {node: "node2"}}]' \
        >"$DIR/prometheus/engines.json.tmp"
    mv "$DIR/prometheus/engines.json.tmp" "$DIR/prometheus/engines.json"
}
# promql QUERY: the first result's value (nothing when there is none).
promql() {
    on ctl curl -sS --max-time 5 "http://${ADDR[ctl]}:9090/api/v1/query" --data-urlencode "query=$1" |
        jq -r '.data.result[0].value[1] // empty'
}
# targets_up N: Prometheus has N targets up.
targets_up() { [[ $(promql 'count(up == 1)') == "$1" ]]; }

# ---------------------------------------------------------------- gateways

# start_gateway HOST [POLICY]: POLICY routes among the agents' engines
# (round_robin by default; kv_aware for the replay scenario).
start_gateway() {
    local h=$1 policy=${2:-round_robin}
    mkdir -p "$DIR/$h/spool"
    cat >"$DIR/$h/gateway.toml" <<EOF
[gateway]
listen = "${ADDR[$h]}:8080"
database = "postgres://granary@${ADDR[ctl]}:5432/granary"
redis = "redis://${ADDR[ctl]}:6379"
audit_spool_dir = "$DIR/$h/spool"
connect_timeout_ms = 1000
first_byte_timeout_s = 120

[gateway.health]
interval_ms = 250
timeout_ms = 1000

[gateway.breaker]
failures = 3
open_ms = 2000

[gateway.agents]
enabled = true
ttl_ms = 10000
load_timeout_ms = 180000
pool_policy = "$policy"

[gateway.prices]
currency = "USD"
[gateway.prices.models.smollm2]
input_per_million = 0.1
output_per_million = 0.2
EOF
    start "$h" "$h" env GRANARY_ADMIN_TOKEN="$GW_ADMIN" GRANARY_AGENT_TOKEN="$GW_AGENT" GRANARY_METRICS_TOKEN="$METRICS" \
        "$BIN" gateway --config "$DIR/$h/gateway.toml"
    wait_for "gateway $h" 60 log_has "$h" "granary: ready"
}

# gw HOST METHOD PATH [BODY]: the gateway's admin API, as JSON.
gw_admin() {
    local h=$1 method=$2 path=$3 extra=()
    [[ -n "${4:-}" ]] && extra=(-H content-type:application/json -d "$4")
    on ctl curl -sS --max-time 10 -X "$method" -H "authorization: Bearer $GW_ADMIN" "${extra[@]}" \
        "http://${ADDR[$h]}:8080$path"
}

# ---------------------------------------------------------------- nodes

start_node() {
    local h=$1
    mkdir -p "$DIR/$h/kv" "$DIR/$h/agent" "$DIR/$h/ram"
    # The remote tier's endpoint, credentials and short client timeouts
    # (the object store client retries a failed request ten times).
    cat >"$DIR/$h/warehouse.toml" <<EOF
[warehouse]
resp = "off"
http = "${ADDR[$h]}:8300"

[warehouse.store]
memory = "256MiB"
offload = "all"
queue_depth = 64

[warehouse.store.disk]
dir = "$DIR/$h/kv"
capacity = "1GiB"

[warehouse.store.remote]
url = "s3://granary-kv/cluster"
options = { aws_endpoint = "http://$S3_ADDR", aws_allow_http = "true", aws_access_key_id = "$S3_KEY", aws_secret_access_key = "$S3_SECRET", aws_region = "us-east-1", aws_virtual_hosted_style_request = "false", timeout = "2s", connect_timeout = "1s" }
EOF
    start "$h" "wh-$h" env GRANARY_ADMIN_TOKEN="$WH_ADMIN" GRANARY_METRICS_TOKEN="$METRICS" "$BIN" warehouse --config "$DIR/$h/warehouse.toml"
    wait_for "warehouse on $h" 30 log_has "wh-$h" "granary warehouse: ready" || return 1
    # The agent: engines listen on the node's address, read KV from the
    # node's warehouse over HTTP (so the tier each block came from is known).
    start "$h" "agent-$h" env GRANARY_WAREHOUSE_TOKEN="$WH_ADMIN" "$BIN" agent \
        --listen "${ADDR[$h]}:8500" --advertise "http://${ADDR[$h]}:8500" \
        --admin-token-file "$DIR/agent-admin-token" \
        --agent-id "$h" --engine-host "${ADDR[$h]}" \
        --registry "http://${ADDR[ctl]}:8400" --registry-token-file "$DIR/registry-read-token" \
        --gateway "http://${ADDR[gw1]}:8080" --gateway "http://${ADDR[gw2]}:8080" \
        --gateway-token-file "$DIR/gateway-agent-token" \
        --cache-dir "$DIR/$h/agent" --ram-dir "$DIR/$h/ram" --ram-budget 0 \
        --heartbeat-interval 500ms --health-interval 250ms \
        --engine-arg="--warehouse=http://${ADDR[$h]}:8300" --engine-arg=--kv-cache=64MiB \
        --engine-arg=--block-tokens=64
    wait_for "agent on $h" 30 log_has "agent-$h" "granary: ready"
}

# load_model HOST: loads smollm2 on the node's agent; prints the engine's URL.
load_model() {
    local h=$1 out
    out=$(on ctl curl -sS --max-time 300 -X POST -H "authorization: Bearer $AGENT_ADMIN" \
        -H content-type:application/json -d '{}' "http://${ADDR[$h]}:8500/models/smollm2/load") || return 1
    [[ $(jq -r .state <<<"$out") == ready ]] || { echo "load on $h: $out" >&2; return 1; }
    echo "load on $h: $(jq -c '{upstream, tier, load_ms}' <<<"$out")" >&2
    jq -r .upstream <<<"$out"
}

# metric HOST URL 'NAME{LABEL="V",...}' [TOKEN]: the sum of the samples of
# NAME carrying those labels (0 when there are none), as an integer.
metric() {
    local h=$1 url=$2 sel=$3 auth=()
    [[ -n "${4:-}" ]] && auth=(-H "authorization: Bearer $4")
    on "$h" curl -sS --max-time 5 "${auth[@]}" "$url/metrics" | awk -v sel="$sel" '
        BEGIN { name = sel; sub(/\{.*/, "", name); labels = ""
                if (match(sel, /\{.*\}/)) labels = substr(sel, RSTART + 1, RLENGTH - 2)
                nl = split(labels, want, ",") }
        /^#/ { next }
        { series = $1; base = series; sub(/\{.*/, "", base)
          if (base != name) next
          for (i = 1; i <= nl; i++) if (index(series, want[i]) == 0) next
          v += $NF }
        END { printf "%d\n", v }'
}
wh_metric() { metric "$1" "http://${ADDR[$1]}:8300" "$2" "$WH_ADMIN"; }
gw_metric() { metric ctl "http://${ADDR[$1]}:8080" "$2" "$GW_ADMIN"; }

# wait_routable [N]: both gateways route to N engines (default 2: both).
wait_routable() {
    local g n=${1:-2}
    for g in gw1 gw2; do
        wait_for "$g routing to $n engine(s)" 30 bash -c "[ \$(ip netns exec $(ns ctl) curl -sS --max-time 2 \
            -H 'authorization: Bearer $GW_ADMIN' http://${ADDR[$g]}:8080/admin/v1/agents |
            jq '[.data[].engines[] | select(.routable)] | length') -eq $n ]" || return 1
    done
}
