#!/usr/bin/env bash
# Local PostgreSQL and Redis for development and tests, without Docker.
#
#   scripts/services.sh start   install if absent, start (idempotent), wait, print the URLs
#   scripts/services.sh stop    stop what this script started
#   scripts/services.sh env     print `export DATABASE_URL=... REDIS_URL=...` lines for eval
#
# When DATABASE_URL / REDIS_URL are already set, that service is taken as given and left alone.
# Data, sockets and logs live under .local/ in the repository (git-ignored), on non-default ports
# (PostgreSQL 55432, Redis 56379) so they never collide with a system installation.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="${ZHIHUI_LOCAL_DIR:-$ROOT/.local}"
PG_PORT="${ZHIHUI_PG_PORT:-55432}"
REDIS_PORT="${ZHIHUI_REDIS_PORT:-56379}"
PG_DATA="$STATE/postgres/data"
PG_RUN="$STATE/postgres/run"
PG_LOG="$STATE/postgres/postgres.log"
REDIS_DIR="$STATE/redis"
# PostgreSQL refuses to run as root: it runs as this (system) user.
PG_OS_USER="${ZHIHUI_PG_OS_USER:-postgres}"
PG_SUPERUSER="zhihui"
PG_DATABASE="zhihui"
LOCAL_DATABASE_URL="postgres://$PG_SUPERUSER@127.0.0.1:$PG_PORT/$PG_DATABASE"
LOCAL_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/0"

log() { echo "services: $*" >&2; }

apt_install() {
    if [ "$(id -u)" -ne 0 ]; then
        log "need root to install $*"; exit 1
    fi
    log "installing $* from Debian packages"
    if [ -z "${ZHIHUI_APT_UPDATED:-}" ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        export ZHIHUI_APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

pg_bin_dir() {
    local dir
    for dir in /usr/lib/postgresql/*/bin; do
        if [ -x "$dir/postgres" ]; then echo "$dir"; fi
    done | sort -V | tail -n 1
}

ensure_postgres_installed() {
    if [ -z "$(pg_bin_dir)" ]; then
        apt_install postgresql postgresql-contrib
    fi
    if ! command -v psql >/dev/null; then
        apt_install postgresql-client
    fi
    if ! id "$PG_OS_USER" >/dev/null 2>&1; then
        useradd --system --home-dir "$STATE/postgres" --shell /usr/sbin/nologin "$PG_OS_USER"
    fi
}

as_pg_user() {
    if [ "$(id -un)" = "$PG_OS_USER" ]; then
        "$@"
    elif [ "$(id -u)" -eq 0 ]; then
        runuser -u "$PG_OS_USER" -- "$@"
    else
        # Not root: run PostgreSQL as ourselves (allowed for any non-root user).
        "$@"
    fi
}

postgres_answers() {
    pg_isready -q -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres
}

start_postgres() {
    ensure_postgres_installed
    local bin; bin="$(pg_bin_dir)"
    mkdir -p "$PG_RUN"
    if [ "$(id -u)" -eq 0 ]; then
        chown -R "$PG_OS_USER" "$STATE/postgres"
        # The data directory sits inside the checkout: the service user must be able to reach it.
        local dir="$STATE"
        while [ "$dir" != "/" ]; do chmod o+x "$dir" 2>/dev/null || true; dir="$(dirname "$dir")"; done
    fi
    if postgres_answers; then
        log "PostgreSQL already answers on port $PG_PORT"
    else
        if [ ! -s "$PG_DATA/PG_VERSION" ]; then
            log "initialising PostgreSQL in $PG_DATA"
            as_pg_user "$bin/initdb" -D "$PG_DATA" -U "$PG_SUPERUSER" --auth=trust \
                --encoding=UTF8 --locale=C.UTF-8 >"$STATE/postgres/initdb.log"
        fi
        log "starting PostgreSQL on 127.0.0.1:$PG_PORT"
        # Development settings: listen on loopback only; fsync stays ON so benchmarks are honest.
        # pg_stat_statements lets a benchmark count the statements a code path sends.
        as_pg_user "$bin/pg_ctl" -D "$PG_DATA" -l "$PG_LOG" -w -t 60 start -o \
            "-p $PG_PORT -c listen_addresses=127.0.0.1 -k $PG_RUN -c max_connections=300 -c shared_buffers=256MB -c shared_preload_libraries=pg_stat_statements" >&2
    fi
    local tries=0
    until postgres_answers; do
        tries=$((tries + 1)); [ "$tries" -lt 120 ] || { log "PostgreSQL did not answer; see $PG_LOG"; exit 1; }
        sleep 0.5
    done
    if ! psql -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = '$PG_DATABASE'" | grep -q 1; then
        createdb -h 127.0.0.1 -p "$PG_PORT" -U "$PG_SUPERUSER" "$PG_DATABASE"
    fi
}

stop_postgres() {
    local bin; bin="$(pg_bin_dir)"
    if [ -n "$bin" ] && [ -s "$PG_DATA/postmaster.pid" ]; then
        log "stopping PostgreSQL"
        as_pg_user "$bin/pg_ctl" -D "$PG_DATA" -m fast -w stop >&2 || true
    fi
}

redis_answers() {
    redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG
}

start_redis() {
    if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
        apt_install redis-server
        # The package starts a system Redis on 6379; ours is separate, leave that one alone.
    fi
    mkdir -p "$REDIS_DIR"
    if redis_answers; then
        log "Redis already answers on port $REDIS_PORT"
    else
        log "starting Redis on 127.0.0.1:$REDIS_PORT"
        # scripts/redis.conf: append-only file (sessions survive a restart), no eviction.
        redis-server "$ROOT/scripts/redis.conf" --port "$REDIS_PORT" --bind 127.0.0.1 \
            --daemonize yes --dir "$REDIS_DIR" --pidfile "$REDIS_DIR/redis.pid" \
            --logfile "$REDIS_DIR/redis.log" >&2
    fi
    local tries=0
    until redis_answers; do
        tries=$((tries + 1)); [ "$tries" -lt 60 ] || { log "Redis did not answer; see $REDIS_DIR/redis.log"; exit 1; }
        sleep 0.5
    done
}

stop_redis() {
    if [ -s "$REDIS_DIR/redis.pid" ]; then
        local pid; pid="$(cat "$REDIS_DIR/redis.pid")"
        if kill -0 "$pid" 2>/dev/null; then
            log "stopping Redis (pid $pid)"
            kill "$pid"
        fi
        rm -f "$REDIS_DIR/redis.pid"
    fi
}

print_env() {
    echo "export DATABASE_URL=${DATABASE_URL:-$LOCAL_DATABASE_URL}"
    echo "export REDIS_URL=${REDIS_URL:-$LOCAL_REDIS_URL}"
}

case "${1:-start}" in
    start)
        mkdir -p "$STATE"
        if [ -z "${DATABASE_URL:-}" ]; then start_postgres; else log "DATABASE_URL given; not starting PostgreSQL"; fi
        if [ -z "${REDIS_URL:-}" ]; then start_redis; else log "REDIS_URL given; not starting Redis"; fi
        echo "DATABASE_URL=${DATABASE_URL:-$LOCAL_DATABASE_URL}"
        echo "REDIS_URL=${REDIS_URL:-$LOCAL_REDIS_URL}"
        ;;
    env)
        print_env
        ;;
    stop)
        stop_redis
        stop_postgres
        ;;
    *)
        echo "usage: $0 start|stop|env" >&2; exit 2
        ;;
esac
