# The cluster test's requests, results and scenarios. Sourced by
# scripts/cluster-test.sh after scripts/cluster/fleet.sh.
# shellcheck shell=bash

# ---------------------------------------------------------------- requests

# A prompt of about $2 words, distinct per $1.
prompt() {
    local tag=$1 words=$2 i out
    out="Notes $tag:"
    local w=(granary warehouse block engine gateway tenant prefix shard bucket replica
        namespace breaker agent latency budget token chain region cluster ledger)
    for ((i = 0; i < words; i++)); do
        out+=" ${w[$(((i * 7 + ${#tag} + i / 20) % 20))]}$((i % 13))"
    done
    echo "$out. Summarise in one word."
}

# complete URL PROMPT MAX_TOKENS: a non-streamed completion straight to an
# engine; prints the answer's JSON.
complete() {
    local body
    body=$(jq -cn --arg p "$2" --argjson m "$3" '{model: "smollm2", prompt: $p, max_tokens: $m, temperature: 0}')
    on ctl curl -sS --max-time 180 -H content-type:application/json -d "$body" "$1/v1/completions"
}

# chat GW KEY PROMPT OUTFILE: one non-streamed chat request through a
# gateway; appends "gw status seconds" to OUTFILE.
chat() {
    local gw=$1 key=$2 text=$3 out=$4 body res
    body=$(jq -cn --arg p "$text" '{model: "smollm2", messages: [{role: "user", content: $p}], max_tokens: 4, temperature: 0}')
    res=$(on ctl curl -sS --max-time 120 -o /dev/null -w '%{http_code} %{time_total}' \
        -H "authorization: Bearer $key" -H content-type:application/json -d "$body" \
        "http://${ADDR[$gw]}:8080/v1/chat/completions" 2>/dev/null) || res="${res:-000} curl-failed"
    echo "$gw $res" >>"$out"
}

# load NAME COUNT CONCURRENCY KEY WORDS GW...: COUNT chat requests, at most
# CONCURRENCY at once, spread over the gateways in turn, each a distinct
# prompt (of about WORDS more words, so that it fills KV blocks); results
# in $DIR/NAME.results. Bounded: COUNT requests of at most 120 s each.
load() {
    local name=$1 count=$2 conc=$3 key=$4 words=$5 i text
    shift 5
    local gws=("$@")
    : >"$DIR/$name.results"
    for ((i = 0; i < count; i++)); do
        text="Load $name $RUN request $i: name one colour."
        [[ $words -gt 0 ]] && text=$(prompt "$name-$RUN-$i" "$words")
        chat "${gws[$((i % ${#gws[@]}))]}" "$key" "$text" "$DIR/$name.results" &
        while [[ $(jobs -rp | wc -l) -ge $conc ]]; do
            wait -n
        done
    done
    wait
}
# Median and largest request time (s) in a results file.
times() {
    awk '{ print $3 }' "$1" | sort -n | awk '{ t[NR] = $1 } END { if (NR) printf "median %.1f s, max %.1f s", t[int((NR + 1) / 2)], t[NR] }'
}
# Objects under the shared tier's prefix.
s3_objects() { find "$DIR/s3/granary-kv/cluster/default" -type f 2>/dev/null | wc -l; }
# s3_steady MIN SECONDS: waits until at least MIN objects are there and their
# count held still for a second (copies still being retried land too).
s3_steady() {
    local prev=-1 now=0 deadline=$(($(date +%s) + $2))
    while [[ $(date +%s) -lt $deadline ]]; do
        now=$(s3_objects)
        [[ $now -eq $prev && $now -ge $1 ]] && return 0
        prev=$now
        sleep 1
    done
    echo "cluster-test: timed out after $2 s waiting for $1 objects in S3 ($now)" >&2
    return 1
}
# metric_at_least HOST URL SELECTOR N [TOKEN]
metric_at_least() { [[ $(metric "$1" "$2" "$3" "${5:-}") -ge $4 ]]; }
# Tokens an engine takes from cache for a prompt of N tokens whose every
# full block is stored (a prompt of whole blocks computes its last token).
full_blocks() {
    local full=$(($1 / 64 * 64))
    if [[ $full -eq $1 ]]; then echo $(($1 - 1)); else echo "$full"; fi
}
# ok_count FILE / fail_count FILE / status_count FILE CODE
status_count() { awk -v c="$2" '$2 == c { n++ } END { print n + 0 }' "$1"; }
fail_count() { awk '$2 != "200" { n++ } END { print n + 0 }' "$1"; }

# ---------------------------------------------------------------- results

declare -a ROWS=()
FAILED=0
row() {
    local name=$1 outcome=$2 figures=$3
    ROWS+=("$(printf '%-34s %-5s %s' "$name" "$outcome" "$figures")")
    [[ $outcome == FAIL ]] && FAILED=$((FAILED + 1))
    printf '>>> %-34s %-5s %s\n' "$name" "$outcome" "$figures"
}
wants() { [[ " $ONLY " == *" $1 "* ]]; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }

# ---------------------------------------------------------------- scenarios

# 1. A long prompt served on node1, then on node2 with its KV from S3.
scenario_shared_tier() {
    local p a b c1 c2 objs prompt_tokens remote_tok remote_hits t1 t2 ms1 ms2
    p=$(prompt "shared-$RUN" 420)
    t1=$(now_ms)
    a=$(complete "$ENGINE1" "$p" 1) || { row "1 shared tier node1->node2" FAIL "node1 request failed: $a"; return; }
    ms1=$(($(now_ms) - t1))
    prompt_tokens=$(jq -r .usage.prompt_tokens <<<"$a")
    c1=$(jq -r '.usage.prompt_tokens_details.cached_tokens // 0' <<<"$a")
    # The blocks reach S3 asynchronously: wait for node1's offloads.
    s3_steady "$((prompt_tokens / 64))" 60
    objs=$(s3_objects)
    t2=$(now_ms)
    b=$(complete "$ENGINE2" "$p" 1) || { row "1 shared tier node1->node2" FAIL "node2 request failed: $b"; return; }
    ms2=$(($(now_ms) - t2))
    c2=$(jq -r '.usage.prompt_tokens_details.cached_tokens // 0' <<<"$b")
    remote_tok=$(metric node2 "$ENGINE2" 'granary_engine_prompt_tokens_total{source="remote"}')
    remote_hits=$(wh_metric node2 'granary_warehouse_hits_total{tier="remote"}')
    local figs="prompt=$prompt_tokens tok, S3 objects=$objs, node1 cached=$c1 (${ms1} ms), node2 cached=$c2 (${ms2} ms), node2 engine remote tok=$remote_tok, node2 warehouse remote hits=$remote_hits"
    if [[ $c1 -eq 0 && $c2 -gt 0 && $remote_tok -gt 0 && $remote_hits -gt 0 ]]; then
        row "1 shared tier node1->node2" PASS "$figs"
    else
        row "1 shared tier node1->node2" FAIL "$figs"
    fi
}

# chat_usage GW KEY PROMPT: one non-streamed chat request through a gateway;
# prints "STATUS CACHED_TOKENS PROMPT_TOKENS SECONDS".
chat_usage() {
    local body out
    body=$(jq -cn --arg p "$3" '{model: "smollm2", messages: [{role: "user", content: $p}], max_tokens: 1, temperature: 0}')
    out=$(on ctl curl -sS --max-time 120 -w '\n%{http_code} %{time_total}' -H "authorization: Bearer $2" \
        -H content-type:application/json -d "$body" "http://${ADDR[$1]}:8080/v1/chat/completions" 2>/dev/null) || out=$'{}\n000 0'
    local tail=${out##*$'\n'} json=${out%$'\n'*}
    echo "${tail%% *} $(jq -r '.usage.prompt_tokens_details.cached_tokens // 0' <<<"$json" 2>/dev/null || echo 0) \
$(jq -r '.usage.prompt_tokens // 0' <<<"$json" 2>/dev/null || echo 0) ${tail##* }"
}

# 9. Two tenants, one gateway, the same long prompt: the second tenant
# reuses none of the first one's KV. Round robin sends the first tenant's
# three requests to both engines (so each holds its blocks, or reads them
# from S3); the second tenant's first request then lands on an engine that
# holds them and must find nothing cached (its second may find its own
# blocks, through S3).
scenario_tenants() {
    local beta p a_cached=0 b_first=-1 b_then=0 fails=0 a_first b_secs=() i status c pt secs
    gw_admin gw1 POST /admin/v1/tenants '{"name": "beta"}' >/dev/null
    beta=$(gw_admin gw1 POST /admin/v1/keys '{"tenant": "beta"}' | jq -r .key)
    [[ $beta == gk_* ]] || { row "9 tenants share no KV" FAIL "no key for tenant beta"; return; }
    p=$(prompt "tenants-$RUN" 420)
    for i in 1 2 3; do
        read -r status c pt secs <<<"$(chat_usage gw1 "$KEY" "$p")"
        [[ $status == 200 ]] || fails=$((fails + 1))
        [[ $i -eq 1 ]] && a_first="$c cached, ${secs} s"
        [[ $i -gt 1 && $c -gt $a_cached ]] && a_cached=$c
    done
    for i in 1 2; do
        read -r status c pt secs <<<"$(chat_usage gw1 "$beta" "$p")"
        [[ $status == 200 ]] || fails=$((fails + 1))
        if [[ $i -eq 1 ]]; then b_first=$c; else b_then=$c; fi
        b_secs+=("${secs} s")
    done
    local figs="prompt=$pt tok; tenant acme: first $a_first, then up to $a_cached cached; tenant beta: first $b_first cached (${b_secs[0]}), then $b_then cached, its own (${b_secs[1]}); failed=$fails"
    if [[ $fails -eq 0 && $pt -gt 0 && $a_cached -gt 0 && $b_first -eq 0 ]]; then
        row "9 tenants share no KV" PASS "$figs"
    else
        row "9 tenants share no KV" FAIL "$figs"
    fi
}

# 4. The S3 tier partitioned away under load, then back.
scenario_partition() {
    local e10 e20 e1 e2 d10 d20 d1 d2 fails n p a b pt c2=0 expect=-1 t_err1="never" t_err2="never" i=0
    e10=$(wh_metric node1 'granary_warehouse_tier_errors_total{tier="remote"}')
    e20=$(wh_metric node2 'granary_warehouse_tier_errors_total{tier="remote"}')
    d10=$(wh_metric node1 'granary_warehouse_offloads_dropped_total')
    d20=$(wh_metric node2 'granary_warehouse_offloads_dropped_total')
    ip -n "$(ns ctl)" link set stor0 down
    local t_down
    t_down=$(now_ms)
    log "storage link down"
    # Load through both gateways: new prompts of a few blocks each, so the
    # engines compute and save them, and the warehouses' copies to S3 (and
    # their lookups there) fail.
    load partition 10 3 "$KEY" 60 gw1 gw2 &
    local loader=$!
    # The remote tier's errors show once the object store client gives up
    # (it retries ten times). Until both nodes count one, keep their
    # engines saving blocks (bounded: 150 s, one request at a time).
    while [[ $(($(now_ms) - t_down)) -lt 150000 ]]; do
        e1=$(wh_metric node1 'granary_warehouse_tier_errors_total{tier="remote"}')
        e2=$(wh_metric node2 'granary_warehouse_tier_errors_total{tier="remote"}')
        [[ $e1 -gt $e10 && $t_err1 == never ]] && t_err1=$(($(now_ms) - t_down))
        [[ $e2 -gt $e20 && $t_err2 == never ]] && t_err2=$(($(now_ms) - t_down))
        [[ $t_err1 != never && $t_err2 != never ]] && break
        i=$((i + 1))
        if [[ $((i % 2)) -eq 0 ]]; then
            complete "$ENGINE1" "$(prompt "part-$RUN-$i" 60)" 1 >/dev/null
        else
            complete "$ENGINE2" "$(prompt "part-$RUN-$i" 60)" 1 >/dev/null
        fi
    done
    wait "$loader"
    d1=$(wh_metric node1 'granary_warehouse_offloads_dropped_total')
    d2=$(wh_metric node2 'granary_warehouse_offloads_dropped_total')
    fails=$(fail_count "$DIR/partition.results")
    n=$(wc -l <"$DIR/partition.results")
    local during
    during=$(times "$DIR/partition.results")
    ip -n "$(ns ctl)" link set stor0 up
    local t_up
    t_up=$(now_ms)
    log "storage link up"
    # Recovery: a prompt computed on node1 after the link is back reaches S3
    # (once the count of objects is steady: the copies that were retrying
    # land too) and node2 reads every full block of it from there.
    p=$(prompt "recover-$RUN" 200)
    local objs0
    objs0=$(s3_objects)
    a=$(complete "$ENGINE1" "$p" 1)
    pt=$(jq -r '.usage.prompt_tokens // 0' <<<"$a")
    s3_steady "$((objs0 + pt / 64))" 120
    local t_back=$(($(now_ms) - t_up))
    b=$(complete "$ENGINE2" "$p" 1)
    c2=$(jq -r '.usage.prompt_tokens_details.cached_tokens // 0' <<<"$b")
    expect=$(full_blocks "$pt")
    local figs="requests=$n failed=$fails ($during), remote-tier errors node1 $e10->$e1 node2 $e20->$e2 (first after $t_err1 / $t_err2 ms), offloads dropped node1 $d10->$d1 node2 $d20->$d2; link up: S3 steady after $t_back ms, node2 cached $c2/$pt tok from it"
    if [[ $n -eq 10 && $fails -eq 0 && $e1 -gt $e10 && $e2 -gt $e20 && $pt -gt 0 && $c2 -eq $expect ]]; then
        row "4 S3 tier partitioned" PASS "$figs"
    else
        row "4 S3 tier partitioned" FAIL "$figs"
    fi
}

# 2. node2's processes SIGKILLed under load through both gateways.
scenario_node_killed() {
    local up="agent:node2:smollm2" active=0 a2=0 killed t_kill t_open="never" fails n after s
    load nodekill 16 4 "$KEY" 0 gw1 gw2 &
    local loader=$!
    # Kill once node2 has requests in flight (or after 30 s of load).
    local deadline=$(($(date +%s) + 30))
    while [[ $(date +%s) -lt $deadline ]]; do
        active=$(gw_metric gw1 "granary_gateway_upstream_active_requests{upstream=\"$up\"}")
        a2=$(gw_metric gw2 "granary_gateway_upstream_active_requests{upstream=\"$up\"}")
        active=$(($active + $a2))
        [[ $active -gt 0 ]] && break
        sleep 0.05
    done
    killed=$(kill_host node2)
    t_kill=$(now_ms)
    log "node2: $killed processes killed, $active requests in flight on it"
    # The breaker opens on both gateways (health checks and failed attempts).
    local open1="" open2=""
    while [[ $(($(now_ms) - t_kill)) -lt 10000 ]]; do
        for g in gw1 gw2; do
            s=$(gw_admin "$g" GET /admin/v1/agents |
                jq -r '.data[] | select(.agent_id == "node2") | .engines[] | .breaker' 2>/dev/null)
            if [[ $s == open ]]; then
                [[ $g == gw1 && -z $open1 ]] && open1=$(($(now_ms) - t_kill))
                [[ $g == gw2 && -z $open2 ]] && open2=$(($(now_ms) - t_kill))
            fi
        done
        [[ -n $open1 && -n $open2 ]] && break
        sleep 0.1
    done
    wait "$loader"
    fails=$(fail_count "$DIR/nodekill.results")
    n=$(wc -l <"$DIR/nodekill.results")
    # Still served, by node1.
    local served
    served=$(gw_admin gw2 GET /admin/v1/agents |
        jq -r '[.data[] | .engines[] | select(.routable) | .name] | join(",")')
    : >"$DIR/after-kill.results"
    chat gw1 "$KEY" "After the node loss $RUN: say yes." "$DIR/after-kill.results"
    chat gw2 "$KEY" "After the node loss $RUN: say no." "$DIR/after-kill.results"
    after=$(status_count "$DIR/after-kill.results" 200)
    local figs="requests=$n failed=$fails, in flight on node2 at kill=$active, breaker open after gw1=${open1:-never} ms gw2=${open2:-never} ms, routable now: ${served:-none}, after: $after/2 ok"
    if [[ $n -eq 16 && $fails -eq 0 && $active -gt 0 && -n $open1 && $open1 -le 5000 && -n $open2 && $open2 -le 5000 &&
        $after -eq 2 && $served == "agent:node1:smollm2" ]]; then
        row "2 node2 killed under load" PASS "$figs"
    else
        row "2 node2 killed under load" FAIL "$figs"
    fi
}

# A burst of N requests at once with KEY over the gateways in turn; prints
# how many got 200 and how many 429 ("ok limited").
burst() {
    local name=$1 n=$2 key=$3
    shift 3
    local gws=("$@") i
    : >"$DIR/$name.results"
    for ((i = 0; i < n; i++)); do
        chat "${gws[$((i % ${#gws[@]}))]}" "$key" "Burst $name $RUN $i: one word." "$DIR/$name.results" &
    done
    wait
    echo "$(status_count "$DIR/$name.results" 200) $(status_count "$DIR/$name.results" 429)"
}

# 3. gw1 killed: gw2 keeps serving; per-key limits shared through Redis and
# usage through PostgreSQL stay exact.
scenario_gateway_killed() {
    local rpm=4 ka kb r1 r2 r3 t_first t_burst drained expect fails n usage
    ka=$(gw_admin gw1 POST /admin/v1/keys "{\"tenant\": \"limits\", \"limits\": {\"requests_per_minute\": $rpm}}" | jq -r .key)
    kb=$(gw_admin gw2 POST /admin/v1/keys "{\"tenant\": \"limits\", \"limits\": {\"requests_per_minute\": $rpm}}" | jq -r .key)
    # Before: 2N at once over both gateways: exactly N admitted.
    r1=$(burst limit-before $((2 * rpm)) "$ka" gw1 gw2)
    # Key B: one request on each gateway, then gw1 dies, then N on gw2.
    t_first=$(now_ms)
    r2=$(burst limit-split 2 "$kb" gw1 gw2)
    sleep 0.6 # the audit writer's batch (100 ms) reaches the database
    local killed
    killed=$(kill_host gw1)
    log "gw1: $killed processes killed"
    t_burst=$(now_ms)
    r3=$(burst limit-after "$rpm" "$kb" gw2)
    # Clients of gw2 go on.
    load gw2-only 6 3 "$KEY" 0 gw2
    fails=$(fail_count "$DIR/gw2-only.results")
    n=$(wc -l <"$DIR/gw2-only.results")
    # What drained between key B's first admission and the burst (GCRA: one
    # request per 60/N s) is admitted too.
    drained=$(((t_burst - t_first) * rpm / 60000))
    expect=$((rpm - 2 + drained))
    [[ $expect -gt $rpm ]] && expect=$rpm
    sleep 1 # audit batches reach the database
    usage=$(gw_admin gw2 GET "/admin/v1/usage?tenant=limits&format=json")
    local ureq uerr
    ureq=$(jq '[.. | objects | select(has("requests")) | .requests] | add // 0' <<<"$usage")
    uerr=$(jq '[.. | objects | select(has("errors")) | .errors] | add // 0' <<<"$usage")
    local sent=$((2 * rpm + 2 + rpm)) ok=$((${r1% *} + ${r2% *} + ${r3% *})) limited=$((${r1#* } + ${r2#* } + ${r3#* }))
    local figs="gw2 alone: $n requests, $fails failed; key A ${rpm}rpm 2N at once over gw1+gw2: ${r1% *} ok ${r1#* } 429; key B 1+1 before the kill: ${r2% *} ok, $rpm after on gw2: ${r3% *} ok (expected $expect, ${drained} drained) ${r3#* } 429; usage (PostgreSQL, via gw2): requests=$ureq errors=$uerr (sent $sent, ok $ok, 429 $limited)"
    if [[ $n -eq 6 && $fails -eq 0 && $r1 == "$rpm $rpm" && $r2 == "2 0" && ${r3% *} -eq $expect &&
        $((${r3% *} + ${r3#* })) -eq $rpm && $ureq -eq $sent && $uerr -eq $limited ]]; then
        row "3 gw1 killed, limits via Redis" PASS "$figs"
    else
        row "3 gw1 killed, limits via Redis" FAIL "$figs"
    fi
}

# The engine's TTFT histogram's sum and count, "sum count".
ttft_sum() {
    on ctl curl -sS --max-time 5 "$1/metrics" |
        awk '$1 == "granary_engine_ttft_seconds_sum" { s = $2 } $1 == "granary_engine_ttft_seconds_count" { c = $2 }
             END { print s + 0, c + 0 }'
}
# ttft_of URL PROMPT: sends one completion, prints "TTFT_MS CACHED PROMPT_TOKENS"
# (TTFT from the engine's own histogram: arrival to first token).
ttft_of() {
    local before after a
    before=$(ttft_sum "$1")
    a=$(complete "$1" "$2" 1)
    after=$(ttft_sum "$1")
    awk -v b="$before" -v a="$after" -v c="$(jq -r '.usage.prompt_tokens_details.cached_tokens // 0' <<<"$a")" \
        -v p="$(jq -r '.usage.prompt_tokens // 0' <<<"$a")" \
        'BEGIN { split(b, x, " "); split(a, y, " "); if (y[2] - x[2] != 1) { print "-1", c, p; exit }
                 printf "%d %d %d\n", (y[1] - x[1]) * 1000, c, p }'
}

# 5. A prompt's KV on node2 from the shared tier, then from node2's own
# disk, beside computing it (node1), with 2 ms added each way on the
# storage link first (storage_delay, fleet.sh): the S3 tier as far away as
# a neighbouring rack rather than a veth. The round trip to S3 is measured
# (a TCP connect) before and with the delay, and must have grown by it.
scenario_kv_sources() {
    local delay delay_ms=2 q r1 r2 r3 pt c_s3 c_disk ms_compute ms_s3 ms_disk rtt0 rtt1
    local s3_before disk_before s3_tok disk_tok entries0 h
    rtt0=$(s3_rtt_ms node2)
    storage_delay_on "$delay_ms" || { row "5 KV from S3 vs local disk" FAIL "the delay wire did not start"; return; }
    rtt1=$(s3_rtt_ms node2)
    q=$(prompt "sources-$RUN" 420)
    local objs0
    objs0=$(s3_objects)
    r1=$(ttft_of "$ENGINE1" "$q")
    ms_compute=${r1%% *}
    pt=${r1##* }
    s3_steady "$((objs0 + pt / 64))" 60
    s3_before=$(metric ctl "$ENGINE2" 'granary_engine_prompt_tokens_total{source="remote"}')
    entries0=$(wh_metric node2 'granary_warehouse_tier_entries{tier="disk"}')
    r2=$(ttft_of "$ENGINE2" "$q")
    ms_s3=${r2%% *}
    c_s3=$(cut -d' ' -f2 <<<"$r2")
    s3_tok=$(($(metric ctl "$ENGINE2" 'granary_engine_prompt_tokens_total{source="remote"}') - s3_before))
    # Those blocks were copied onto node2's disk as they were read. A new
    # warehouse process (memory empty, disk recovered) and a new engine
    # (its own block cache empty) then find them on the disk only.
    wait_for "node2's disk copies" 30 metric_at_least node2 "http://${ADDR[node2]}:8300" \
        'granary_warehouse_tier_entries{tier="disk"}' "$((entries0 + pt / 64))" "$WH_ADMIN"
    kill -TERM "${PIDS[wh-node2]}"
    wait_for "node2's warehouse to stop" 20 bash -c "! kill -0 ${PIDS[wh-node2]}"
    mv "$LOGS/wh-node2.log" "$LOGS/wh-node2.1.log"
    start node2 wh-node2 env GRANARY_ADMIN_TOKEN="$WH_ADMIN" GRANARY_METRICS_TOKEN="$METRICS" "$BIN" warehouse --config "$DIR/node2/warehouse.toml"
    wait_for "node2's warehouse again" 30 log_has wh-node2 "granary warehouse: ready"
    on ctl curl -sS --max-time 60 -X POST -H "authorization: Bearer $AGENT_ADMIN" \
        "http://${ADDR[node2]}:8500/models/smollm2/unload" >/dev/null
    ENGINE2=$(load_model node2)
    engines_sd
    # A new engine's first request pays for its own start-up (buffers,
    # threads); a short prompt with no full block takes that first.
    complete "$ENGINE2" "warm-up $RUN" 1 >/dev/null
    disk_before=$(metric ctl "$ENGINE2" 'granary_engine_prompt_tokens_total{source="disk"}')
    r3=$(ttft_of "$ENGINE2" "$q")
    ms_disk=${r3%% *}
    c_disk=$(cut -d' ' -f2 <<<"$r3")
    disk_tok=$(($(metric ctl "$ENGINE2" 'granary_engine_prompt_tokens_total{source="disk"}') - disk_before))
    delay=$(storage_delay_off)
    wait_routable
    local expect
    expect=$(full_blocks "$pt")
    local figs="prompt=$pt tok, TTFT computed (node1) $ms_compute ms, from S3 (node2) $ms_s3 ms ($c_s3 cached, $s3_tok from remote), from node2's disk $ms_disk ms ($c_disk cached, $disk_tok from disk); $delay_ms ms each way on the storage link: round trip node2-S3 $rtt0 -> $rtt1 ms ($delay)"
    if [[ $c_s3 -eq $expect && $s3_tok -eq $expect && $c_disk -eq $expect && $disk_tok -eq $expect &&
        $ms_compute -ge 0 && $ms_s3 -ge 0 && $ms_disk -ge 0 ]] &&
        awk -v a="$rtt0" -v b="$rtt1" -v d="$delay_ms" 'BEGIN { exit !(b - a >= 2 * d - 0.5) }'; then
        row "5 KV from S3 vs local disk" PASS "$figs"
    else
        row "5 KV from S3 vs local disk" FAIL "$figs"
    fi
}

# restart_gateway HOST POLICY: stops HOST's gateway (SIGTERM) and starts it
# again routing with POLICY; returns once both gateways route to both engines.
restart_gateway() {
    local h=$1
    kill -TERM "${PIDS[$h]}"
    wait_for "$h to stop" 20 bash -c "! kill -0 ${PIDS[$h]}" || return 1
    mv "$LOGS/$h.log" "$LOGS/$h.$(date +%s).log"
    start_gateway "$h" "$2" || return 1
    wait_routable
}

# The engines' prompt tokens by where they came from, summed over both
# engines: "computed engine memory disk remote".
sources_sum() {
    local s out=""
    for s in computed engine memory disk remote; do
        out+="$(($(metric ctl "$ENGINE1" "granary_engine_prompt_tokens_total{source=\"$s\"}") +
            $(metric ctl "$ENGINE2" "granary_engine_prompt_tokens_total{source=\"$s\"}"))) "
    done
    echo "${out% }"
}

# replay NAME GW SALT: a slice of the Mooncake conversation trace as real
# prompts (`granary bench soak --url`), through GW; prints "errors ended
# hit% ttft_p50_ms" and leaves the run's JSON in $DIR/NAME/soak.json.
replay() {
    local name=$1 gw=$2 salt=$3
    on ctl "$BIN" bench soak --url "http://${ADDR[$gw]}:8080" --api-key "$KEY" --model smollm2 \
        --duration "${REPLAY_SECONDS}s" --sample-every 10s --requests "$REPLAY_REQUESTS" --concurrency 2 \
        --speedup 0 --trace-start "$REPLAY_START" --trace-len "$REPLAY_REQUESTS" --block-words 48 --max-blocks 8 \
        --max-tokens 4 --request-timeout 120s --salt "$salt" --out "$DIR/$name" >"$LOGS/$name.log" 2>&1
    jq -r '[.errors, .requests_ended, (.hit_rate * 1000 | round / 10),
            ([.samples[] | select(.requests > 0) | .ttft_p50_ms] | sort | .[length / 2 | floor] // -1 | round)] | @tsv' \
        "$DIR/$name/soak.json" 2>/dev/null || echo "-1 0 0 -1"
}

# 7. Conversation replay: the same slice of the Mooncake trace through gw1
# routing round robin, then through gw2 routing KV-aware (restarted with
# that policy, then back), each under its own salt so neither run finds the
# other's KV. The prefix hit rate and where the cached tokens came from,
# side by side. Every engine block is shared through S3 too, so round robin
# finds blocks computed on the other node there; KV-aware routing sends a
# conversation's next turn where its KV already is.
REPLAY_START=${CLUSTER_REPLAY_START:-1200}
REPLAY_REQUESTS=${CLUSTER_REPLAY_REQUESTS:-30}
REPLAY_SECONDS=${CLUSTER_REPLAY_SECONDS:-150}
scenario_replay() {
    local s0 s1 s2 rr kv figs
    s0=$(sources_sum)
    rr=$(replay replay-rr gw1 1)
    s1=$(sources_sum)
    restart_gateway gw2 kv_aware || { row "7 replay: KV-aware vs round robin" FAIL "gw2 did not come back"; return; }
    log "gw2 routes KV-aware"
    kv=$(replay replay-kv gw2 2)
    s2=$(sources_sum)
    restart_gateway gw2 round_robin || { row "7 replay: KV-aware vs round robin" FAIL "gw2 did not come back"; return; }
    log "gw2 routes round robin again"
    local rr_src kv_src
    rr_src=$(awk -v a="$s0" -v b="$s1" 'BEGIN { split(a, x, " "); split(b, y, " "); n = split("computed engine memory disk remote", k, " ")
        for (i = 1; i <= n; i++) printf "%s%s=%d", (i > 1 ? " " : ""), k[i], y[i] - x[i] }')
    kv_src=$(awk -v a="$s1" -v b="$s2" 'BEGIN { split(a, x, " "); split(b, y, " "); n = split("computed engine memory disk remote", k, " ")
        for (i = 1; i <= n; i++) printf "%s%s=%d", (i > 1 ? " " : ""), k[i], y[i] - x[i] }')
    read -r rr_err rr_n rr_hit rr_ttft <<<"$rr"
    read -r kv_err kv_n kv_hit kv_ttft <<<"$kv"
    figs="trace $REPLAY_START+$REPLAY_REQUESTS; round robin (gw1): $rr_n requests, $rr_err errors, hit ${rr_hit}%, TTFT p50 ${rr_ttft} ms, tokens $rr_src; KV-aware (gw2): $kv_n requests, $kv_err errors, hit ${kv_hit}%, TTFT p50 ${kv_ttft} ms, tokens $kv_src"
    # Both runs complete without an error and find shared prefixes (the
    # slice has some); which policy finds more is the figure, not a rule.
    if [[ $rr_err -eq 0 && $kv_err -eq 0 && $rr_n -ge $((REPLAY_REQUESTS / 2)) && $kv_n -ge $((REPLAY_REQUESTS / 2)) &&
        $(awk -v a="$rr_hit" -v b="$kv_hit" 'BEGIN { print (a > 0 && b > 0) }') -eq 1 ]]; then
        row "7 replay: KV-aware vs round robin" PASS "$figs"
    else
        row "7 replay: KV-aware vs round robin" FAIL "$figs"
    fi
}

# 8. Every dashboard panel shows data from the fleet: each query of every
# panel of deploy/grafana/*.json, evaluated by the cluster's Prometheus
# after the other scenarios' traffic and a little more, has at least one
# series. The more: a cold start through a gateway (the model unloaded on
# both nodes, then asked for), gw2 routing KV-aware, a shared prefix twice
# through each gateway, a rejected key and a key over its limit. Runs after
# 7, before 4, 2 and 3 take hosts away; leaves both nodes serving and both
# gateways routing round robin, as they were.
scenario_dashboards() {
    local tight q gw h n total=0 panels empty=() doc out="$DIR/dashboards.results" cold
    tight=$(gw_admin gw1 POST /admin/v1/keys '{"tenant": "acme", "limits": {"requests_per_minute": 1}}' | jq -r .key)
    doc=$(prompt "dashboards-$RUN" 200)
    : >"$out"
    for h in node1 node2; do
        on ctl curl -sS --max-time 60 -X POST -H "authorization: Bearer $AGENT_ADMIN" \
            "http://${ADDR[$h]}:8500/models/smollm2/unload" >/dev/null
    done
    wait_routable 0
    chat gw1 "$KEY" "A cold start, run $RUN." "$out"
    cold=$(tail -n 1 "$out" | awk '{ printf "status %s in %.1f s", $2, $3 }')
    ENGINE1=$(load_model node1)
    ENGINE2=$(load_model node2)
    engines_sd
    restart_gateway gw2 kv_aware
    local round
    for round in 1 2; do
        for gw in gw1 gw2; do
            chat "$gw" "$KEY" "$doc What is kept?" "$out"
            chat "$gw" "$KEY" "$doc Where is it kept?" "$out"
            chat "$gw" "not-a-key" "hi" "$out"
        done
        chat gw1 "$tight" "hi" "$out"
        chat gw1 "$tight" "hi" "$out"
        # Rates need two scrapes (one a second) with traffic between.
        sleep 3
    done
    restart_gateway gw2 round_robin
    panels=$(jq -r '.title as $d | .panels[] | .title as $p | .targets[] | [$d + " / " + $p, .expr] | @tsv' \
        "$ROOT"/deploy/grafana/*.json)
    while IFS=$'\t' read -r title q; do
        total=$((total + 1))
        n=$(on ctl curl -sS --max-time 10 "http://${ADDR[ctl]}:9090/api/v1/query" --data-urlencode "query=$q" |
            jq -r '.data.result | length' 2>/dev/null)
        [[ ${n:-0} -gt 0 ]] || empty+=("$title: $q")
    done <<<"$panels"
    local figs="$total queries of $(cut -f1 <<<"$panels" | sort -u | wc -l) panels in $(ls "$ROOT"/deploy/grafana/*.json | wc -l) dashboards,"
    figs+=" $((total - ${#empty[@]})) with data; traffic: cold start through gw1 ($cold), $(status_count "$out" 200) ok, $(status_count "$out" 401) 401, $(status_count "$out" 429) 429"
    if [[ ${#empty[@]} -eq 0 && $total -gt 0 && $cold == "status 200 "* && $(status_count "$out" 429) -gt 0 ]]; then
        row "8 every dashboard panel has data" PASS "$figs"
    else
        row "8 every dashboard panel has data" FAIL "$figs; empty: $(printf '%s; ' "${empty[@]}")"
    fi
}

# 6. Prometheus on ctl scrapes every component of the fleet, and what
# scenario 1 did shows in it.
remote_hits_scraped() { [[ $(promql 'sum(granary_warehouse_hits_total{tier="remote"})') -gt 0 ]]; }
scenario_prometheus() {
    local up down remote hits
    wait_for "Prometheus to scrape all 7 targets" 30 targets_up 7
    # Scenario 1's reads may postdate the last scrape (one a second): wait,
    # bounded, for a scrape that has them.
    wants 1 && wait_for "Prometheus to show scenario 1's remote hits" 15 remote_hits_scraped
    up=$(promql 'count(up == 1)')
    down=$(promql 'count(up == 0)')
    remote=$(promql 'sum(granary_engine_prompt_tokens_total{source="remote"})')
    hits=$(promql 'sum(granary_warehouse_hits_total{tier="remote"})')
    local figs="targets up=${up:-0} down=${down:-0} (2 gateways, 2 warehouses, 2 engines, registry); remote-tier prompt tokens=${remote:-none}, warehouse remote hits=${hits:-none}"
    # The warehouses' counters are the evidence: an engine that served
    # scenario 1 may have been unloaded for idleness (and its counters with
    # it) before the first scrape, so its remote-token figure is printed only.
    if [[ ${up:-0} -eq 7 && -z $down ]] && { ! wants 1 || [[ ${hits:-0} -gt 0 ]]; }; then
        row "6 Prometheus scrapes the fleet" PASS "$figs"
    else
        row "6 Prometheus scrapes the fleet" FAIL "$figs"
    fi
}
