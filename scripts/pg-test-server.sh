#!/usr/bin/env bash
# A throwaway PostgreSQL server for tests.
#
#   scripts/pg-test-server.sh start   prints two lines: the server's URL, then
#                                     its directory (to give to `stop`)
#   scripts/pg-test-server.sh stop DIR
#                                     stops that server and deletes DIR
#
# The server listens on 127.0.0.1 only, on a free port, with its socket in
# its own directory, trust authentication and fsync off: for tests, never
# for data that matters. It uses Debian's `postgresql` package binaries
# (/usr/lib/postgresql/*/bin) or PG_BIN when set. initdb refuses to run as
# root, so under root the server runs as the `postgres` user (or `nobody`).
set -euo pipefail

die() { echo "pg-test-server: $*" >&2; exit 1; }

find_bin() {
    if [[ -n "${PG_BIN:-}" ]]; then
        echo "$PG_BIN"
        return
    fi
    local d
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
        if [[ -x "$d/initdb" && -x "$d/pg_ctl" ]]; then
            echo "$d"
            return
        fi
    done
    if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
        dirname "$(command -v initdb)"
        return
    fi
    die "PostgreSQL is not installed (no initdb under /usr/lib/postgresql/*/bin; set PG_BIN)"
}

# Runs a command as the server's owner.
as_owner() {
    if [[ $(id -u) -eq 0 ]]; then
        runuser -u "$OWNER" -- "$@"
    else
        "$@"
    fi
}

owner() {
    if [[ $(id -u) -ne 0 ]]; then
        id -un
    elif id postgres >/dev/null 2>&1; then
        echo postgres
    else
        echo nobody
    fi
}

port_free() {
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

start() {
    local bin dir port tries=0
    bin=$(find_bin)
    OWNER=$(owner)
    dir=$(mktemp -d /tmp/granary-pg.XXXXXX)
    chmod 755 "$dir"
    if [[ $(id -u) -eq 0 ]]; then
        chown "$OWNER" "$dir"
    fi
    as_owner "$bin/initdb" -D "$dir/data" -U granary -A trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; rm -rf "$dir"; die "initdb failed"; }
    while :; do
        port=$(( 20000 + RANDOM % 40000 ))
        if port_free "$port"; then
            if as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 \
                -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
                start >/dev/null 2>&1; then
                break
            fi
        fi
        tries=$((tries + 1))
        if [[ $tries -ge 5 ]]; then
            cat "$dir/server.log" >&2 || true
            rm -rf "$dir"
            die "the server did not start"
        fi
    done
    echo "$port" >"$dir/port"
    echo "$OWNER" >"$dir/owner"
    as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U granary granary_test \
        || { stop "$dir"; die "createdb failed"; }
    echo "postgres://granary@127.0.0.1:$port/granary_test"
    echo "$dir"
}

stop() {
    local dir=${1:-}
    [[ -n "$dir" && -d "$dir/data" ]] || die "usage: $0 stop DIR (a directory printed by start)"
    local bin
    bin=$(find_bin)
    OWNER=$(cat "$dir/owner" 2>/dev/null || owner)
    as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}

case "${1:-}" in
    start) start ;;
    stop) stop "${2:-}" ;;
    *) die "usage: $0 start | stop DIR" ;;
esac
