#!/usr/bin/env bash
# Local PostgreSQL and Redis for development and tests, without Docker.
#
#   scripts/services.sh start   install if absent, start (idempotent), wait, print the URLs
#   scripts/services.sh stop    stop what this script started
#   scripts/services.sh env     print `export DATABASE_URL=... REDIS_URL=...` lines for eval
#
# A PostgreSQL primary with a streaming standby (failover drills and tests):
#   scripts/services.sh start-pg-pair    primary on 55442, standby on 55443 (synchronous unless
#                                        ZHIHUI_PG_SYNCHRONOUS=0); prints the multi-host
#                                        DATABASE_URL (target_session_attrs=read-write)
#   scripts/services.sh kill-primary     SIGKILL the primary's postmaster and its backends
#   scripts/services.sh promote-standby  promote the standby (it becomes the read-write host)
#   scripts/services.sh stop-primary     a fast shutdown of the primary (an operator's restart:
#                                        sessions ended, commits flushed); `restart-old-primary`
#                                        starts it again
#   scripts/services.sh restart-old-primary  start the killed primary again as it was: a second
#                                        read-write server on the old timeline (the mistake zhihui
#                                        fences; see src/platform/pg_fencing.rs)
#   scripts/services.sh rejoin-old-primary   the way back: stop it, pg_rewind it from the new
#                                        primary (a fresh pg_basebackup if that fails), start it
#                                        as the new primary's streaming standby
#   scripts/services.sh stop-pg-pair     stop both
# ZHIHUI_PG_PRIMARY_PORT / ZHIHUI_PG_STANDBY_PORT choose the ports, ZHIHUI_LOCAL_DIR the directory.
#
# A Redis Cluster of 3 masters and 3 replicas (cluster tests, failover drills):
#   scripts/services.sh start-redis-cluster  nodes on 55301-55306 (ZHIHUI_REDIS_CLUSTER_BASE=55300;
#                                            each node's cluster bus listens 10000 above, so the
#                                            ports stay below 55536); prints REDIS_CLUSTER_NODES
#   scripts/services.sh kill-redis-master N  SIGKILL the master that holds slot N (0-16383);
#                                            its replica is promoted by the cluster itself
#   scripts/services.sh restart-redis-node P start the node of port P again (it rejoins as a replica)
#   scripts/services.sh stop-redis-cluster   stop every node
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
PAIR_DIR="$STATE/pg-pair"
PAIR_PRIMARY_PORT="${ZHIHUI_PG_PRIMARY_PORT:-55442}"
PAIR_STANDBY_PORT="${ZHIHUI_PG_STANDBY_PORT:-55443}"
PAIR_SYNCHRONOUS="${ZHIHUI_PG_SYNCHRONOUS:-1}"
PAIR_DATABASE_URL="postgres://$PG_SUPERUSER@127.0.0.1:$PAIR_PRIMARY_PORT,127.0.0.1:$PAIR_STANDBY_PORT/$PG_DATABASE?target_session_attrs=read-write"

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

# The pair's two servers share these options; the primary alone names a synchronous standby (a
# promoted standby must not wait for a standby it does not have).
pair_options() {
    # wal_log_hints: pg_rewind can then bring an old primary back as a standby.
    echo "-p $1 -c listen_addresses=127.0.0.1 -k $PAIR_DIR/run -c max_connections=200 -c shared_buffers=128MB -c wal_level=replica -c max_wal_senders=5 -c hot_standby=on -c wal_keep_size=256MB -c wal_log_hints=on"
}

start_pg_pair() {
    ensure_postgres_installed
    local bin; bin="$(pg_bin_dir)"
    mkdir -p "$PAIR_DIR/run"
    if [ "$(id -u)" -eq 0 ]; then
        chown -R "$PG_OS_USER" "$PAIR_DIR"
        local dir="$PAIR_DIR"
        while [ "$dir" != "/" ]; do chmod o+x "$dir" 2>/dev/null || true; dir="$(dirname "$dir")"; done
    fi
    local synchronous=""
    [ "$PAIR_SYNCHRONOUS" = 1 ] && synchronous="-c synchronous_standby_names=* -c synchronous_commit=on"
    if ! pg_isready -q -h 127.0.0.1 -p "$PAIR_PRIMARY_PORT"; then
        if [ ! -s "$PAIR_DIR/primary/PG_VERSION" ]; then
            log "initialising the pair's primary in $PAIR_DIR/primary"
            # initdb's pg_hba.conf already trusts replication connections from loopback.
            as_pg_user "$bin/initdb" -D "$PAIR_DIR/primary" -U "$PG_SUPERUSER" --auth=trust \
                --encoding=UTF8 --locale=C.UTF-8 >"$PAIR_DIR/initdb.log"
            # In the configuration file, not only on the command line: pg_rewind's own crash
            # recovery of a killed primary starts it with the file's settings.
            echo "wal_log_hints = on" >>"$PAIR_DIR/primary/postgresql.conf"
        fi
        log "starting the primary on 127.0.0.1:$PAIR_PRIMARY_PORT (synchronous standby: $PAIR_SYNCHRONOUS)"
        as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/primary" -l "$PAIR_DIR/primary.log" -w -t 60 start \
            -o "$(pair_options "$PAIR_PRIMARY_PORT") $synchronous" >&2
    fi
    if ! pg_isready -q -h 127.0.0.1 -p "$PAIR_STANDBY_PORT"; then
        if [ ! -s "$PAIR_DIR/standby/PG_VERSION" ]; then
            log "copying the primary into the standby ($PAIR_DIR/standby)"
            # -R writes standby.signal and primary_conninfo: the copy starts as a streaming standby.
            as_pg_user "$bin/pg_basebackup" -h 127.0.0.1 -p "$PAIR_PRIMARY_PORT" -U "$PG_SUPERUSER" \
                -D "$PAIR_DIR/standby" -R -X stream --checkpoint=fast >&2
        fi
        log "starting the standby on 127.0.0.1:$PAIR_STANDBY_PORT"
        as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/standby" -l "$PAIR_DIR/standby.log" -w -t 60 start \
            -o "$(pair_options "$PAIR_STANDBY_PORT")" >&2
    fi
    # Streaming (and, when asked, synchronous) before anyone relies on it.
    local wanted="streaming"; [ "$PAIR_SYNCHRONOUS" = 1 ] && wanted="streaming sync"
    local tries=0
    until [ "$(psql -h 127.0.0.1 -p "$PAIR_PRIMARY_PORT" -U "$PG_SUPERUSER" -d postgres -tAc \
        "SELECT state || CASE WHEN sync_state = 'sync' THEN ' sync' ELSE '' END FROM pg_stat_replication LIMIT 1")" = "$wanted" ]; do
        tries=$((tries + 1)); [ "$tries" -lt 120 ] || { log "the standby never streamed; see $PAIR_DIR/standby.log"; exit 1; }
        sleep 0.25
    done
    # Only now: a synchronous primary waits for its standby before any commit returns.
    if ! psql -h 127.0.0.1 -p "$PAIR_PRIMARY_PORT" -U "$PG_SUPERUSER" -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = '$PG_DATABASE'" | grep -q 1; then
        createdb -h 127.0.0.1 -p "$PAIR_PRIMARY_PORT" -U "$PG_SUPERUSER" "$PG_DATABASE"
    fi
    echo "DATABASE_URL=$PAIR_DATABASE_URL"
}

kill_primary() {
    local pid; pid="$(head -n 1 "$PAIR_DIR/primary/postmaster.pid")"
    log "SIGKILL of the primary (postmaster $pid and its backends)"
    # The whole server at once, as a machine that dies: no shutdown, no last WAL sent.
    kill -9 $(pgrep -P "$pid") "$pid" 2>/dev/null || true
}

stop_primary() {
    local bin; bin="$(pg_bin_dir)"
    log "fast shutdown of the primary on port $PAIR_PRIMARY_PORT"
    as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/primary" -m fast -w -t 60 stop >&2
}

promote_standby() {
    local bin; bin="$(pg_bin_dir)"
    log "promoting the standby on port $PAIR_STANDBY_PORT"
    as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/standby" -w -t 60 promote >&2
}

# The old primary started again by mistake, as it was: read-write, on its old timeline, with no
# synchronous standby to wait for (so nothing holds a write back: the case zhihui must fence).
restart_old_primary() {
    local bin; bin="$(pg_bin_dir)"
    # The killed postmaster may not be gone yet (a zombie until it is reaped): its lock files
    # would stop the start ("another server might be running"). Wait for it; a zombie that
    # outlives the wait holds nothing, and its lock files go.
    local pid tries=0
    pid="$(head -n 1 "$PAIR_DIR/primary/postmaster.pid" 2>/dev/null || true)"
    while [ -n "$pid" ] && [ -n "$(ps -o stat= -p "$pid" 2>/dev/null || true)" ]; do
        tries=$((tries + 1))
        if [ "$tries" -ge 100 ]; then
            rm -f "$PAIR_DIR/primary/postmaster.pid" "$PAIR_DIR/run/.s.PGSQL.$PAIR_PRIMARY_PORT.lock"
            break
        fi
        sleep 0.1
    done
    log "starting the old primary again as a primary on 127.0.0.1:$PAIR_PRIMARY_PORT"
    as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/primary" -l "$PAIR_DIR/primary.log" -w -t 60 start \
        -o "$(pair_options "$PAIR_PRIMARY_PORT")" >&2
}

# The way back for an old primary: it must not write again on its own timeline; it follows the
# new primary (the promoted standby) from the point where their histories split.
rejoin_old_primary() {
    local bin; bin="$(pg_bin_dir)"
    if [ -s "$PAIR_DIR/primary/postmaster.pid" ]; then
        as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/primary" -m fast -w stop >&2 2>/dev/null || true
    fi
    local source="host=127.0.0.1 port=$PAIR_STANDBY_PORT user=$PG_SUPERUSER dbname=postgres"
    # pg_rewind reads the new primary's timeline from its control file, written at a checkpoint:
    # right after a promotion it may still say the old timeline ("no rewind required").
    psql -h 127.0.0.1 -p "$PAIR_STANDBY_PORT" -U "$PG_SUPERUSER" -d postgres -qc CHECKPOINT
    log "rewinding the old primary from the new one (port $PAIR_STANDBY_PORT)"
    # -R writes standby.signal and primary_conninfo (the new primary) into the rewound copy.
    if ! as_pg_user "$bin/pg_rewind" --target-pgdata="$PAIR_DIR/primary" --source-server="$source" \
        -R >&2; then
        log "pg_rewind failed: a fresh copy of the new primary instead"
        rm -rf "$PAIR_DIR/primary"
        as_pg_user "$bin/pg_basebackup" -h 127.0.0.1 -p "$PAIR_STANDBY_PORT" -U "$PG_SUPERUSER" \
            -D "$PAIR_DIR/primary" -R -X stream --checkpoint=fast >&2
    fi
    log "starting the old primary as the new primary's standby on 127.0.0.1:$PAIR_PRIMARY_PORT"
    as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/primary" -l "$PAIR_DIR/primary.log" -w -t 60 start \
        -o "$(pair_options "$PAIR_PRIMARY_PORT")" >&2
    local tries=0
    until [ "$(psql -h 127.0.0.1 -p "$PAIR_STANDBY_PORT" -U "$PG_SUPERUSER" -d postgres -tAc \
        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")" = "1" ]; do
        tries=$((tries + 1)); [ "$tries" -lt 120 ] || { log "the old primary never streamed; see $PAIR_DIR/primary.log"; exit 1; }
        sleep 0.25
    done
}

stop_pg_pair() {
    local bin; bin="$(pg_bin_dir)"
    local node
    for node in standby primary; do
        if [ -n "$bin" ] && [ -s "$PAIR_DIR/$node/postmaster.pid" ]; then
            as_pg_user "$bin/pg_ctl" -D "$PAIR_DIR/$node" -m immediate -w stop >&2 2>/dev/null || true
        fi
    done
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

CLUSTER_DIR="$STATE/redis-cluster"
CLUSTER_BASE="${ZHIHUI_REDIS_CLUSTER_BASE:-55300}"
CLUSTER_PORTS="$((CLUSTER_BASE + 1)) $((CLUSTER_BASE + 2)) $((CLUSTER_BASE + 3)) $((CLUSTER_BASE + 4)) $((CLUSTER_BASE + 5)) $((CLUSTER_BASE + 6))"

cluster_nodes_list() {
    local port list=""
    for port in $CLUSTER_PORTS; do list="$list${list:+,}redis://127.0.0.1:$port"; done
    echo "$list"
}

start_cluster_node() {
    local port="$1"
    mkdir -p "$CLUSTER_DIR/$port"
    # The same persistence as one node (scripts/redis.conf); a short node timeout, so a dead
    # master's replica is promoted within seconds.
    redis-server "$ROOT/scripts/redis.conf" --port "$port" --bind 127.0.0.1 \
        --cluster-enabled yes --cluster-config-file "$CLUSTER_DIR/$port/nodes.conf" \
        --cluster-node-timeout 2000 --daemonize yes --dir "$CLUSTER_DIR/$port" \
        --pidfile "$CLUSTER_DIR/$port/redis.pid" --logfile "$CLUSTER_DIR/$port/redis.log" >&2
}

cluster_ok() {
    local port
    for port in $CLUSTER_PORTS; do
        redis-cli -p "$port" cluster info 2>/dev/null | grep -q "cluster_state:ok" || return 1
    done
}

start_redis_cluster() {
    if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
        apt_install redis-server
    fi
    local port tries=0 fresh=0
    for port in $CLUSTER_PORTS; do
        if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then continue; fi
        [ -s "$CLUSTER_DIR/$port/nodes.conf" ] || fresh=1
        start_cluster_node "$port"
    done
    for port in $CLUSTER_PORTS; do
        tries=0
        until redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; do
            tries=$((tries + 1)); [ "$tries" -lt 60 ] || { log "Redis node $port did not answer"; exit 1; }
            sleep 0.2
        done
    done
    if [ "$fresh" = 1 ] && ! cluster_ok; then
        log "creating the Redis Cluster (3 masters, 3 replicas) on $CLUSTER_PORTS"
        # shellcheck disable=SC2046
        redis-cli --cluster create $(for port in $CLUSTER_PORTS; do printf '127.0.0.1:%s ' "$port"; done) \
            --cluster-replicas 1 --cluster-yes >/dev/null
    fi
    tries=0
    until cluster_ok; do
        tries=$((tries + 1)); [ "$tries" -lt 150 ] || { log "the Redis Cluster did not reach state ok"; exit 1; }
        sleep 0.2
    done
    echo "REDIS_CLUSTER_NODES=$(cluster_nodes_list)"
}

stop_redis_cluster() {
    local port pid
    for port in $CLUSTER_PORTS; do
        if [ -s "$CLUSTER_DIR/$port/redis.pid" ]; then
            pid="$(cat "$CLUSTER_DIR/$port/redis.pid")"
            kill "$pid" 2>/dev/null || true
            rm -f "$CLUSTER_DIR/$port/redis.pid"
        fi
    done
}

# The port of the master that holds slot $1 (CLUSTER NODES: id addr flags master ping pong epoch
# link slot-ranges...).
master_of_slot() {
    local slot="$1" port
    for port in $CLUSTER_PORTS; do
        if redis-cli -p "$port" ping 2>/dev/null | grep -q PONG; then
            redis-cli -p "$port" cluster nodes | awk -v slot="$slot" '
                $3 ~ /master/ && $3 !~ /fail/ {
                    for (i = 9; i <= NF; i++) {
                        n = split($i, range, "-"); from = range[1]; to = (n == 2) ? range[2] : range[1]
                        if (slot + 0 >= from + 0 && slot + 0 <= to + 0) { split($2, addr, "[:@]"); print addr[2]; exit }
                    }
                }'
            return
        fi
    done
}

kill_redis_master() {
    local slot="${1:?slot}" port pid
    port="$(master_of_slot "$slot")"
    [ -n "$port" ] || { log "no master found for slot $slot"; exit 1; }
    pid="$(cat "$CLUSTER_DIR/$port/redis.pid")"
    log "SIGKILL of the Redis master on $port (pid $pid), holding slot $slot"
    kill -9 "$pid"
    rm -f "$CLUSTER_DIR/$port/redis.pid"
    echo "$port"
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
    start-pg-pair) start_pg_pair ;;
    kill-primary) kill_primary ;;
    stop-primary) stop_primary ;;
    promote-standby) promote_standby ;;
    restart-old-primary) restart_old_primary ;;
    rejoin-old-primary) rejoin_old_primary ;;
    stop-pg-pair) stop_pg_pair ;;
    start-redis-cluster) start_redis_cluster ;;
    stop-redis-cluster) stop_redis_cluster ;;
    kill-redis-master) kill_redis_master "${2:-}" ;;
    restart-redis-node) start_cluster_node "${2:?port}" ;;
    *)
        echo "usage: $0 start|stop|env|start-pg-pair|kill-primary|stop-primary|promote-standby|restart-old-primary|rejoin-old-primary|stop-pg-pair|start-redis-cluster|stop-redis-cluster|kill-redis-master SLOT|restart-redis-node PORT" >&2; exit 2
        ;;
esac
