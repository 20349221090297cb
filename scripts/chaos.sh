#!/usr/bin/env bash
# Money under chaos across two `zhihui serve` processes (bench/src/bin/chaos_two_processes.rs):
# tasks, prioritises and cancels sent to random processes while each process is killed with
# SIGKILL and restarted, Redis is flushed, PostgreSQL is restarted and a simulator crashes; then
# every task must have ended once and `zhihui audit verify` must find nothing, not even pending.
#
#   scripts/chaos.sh [TASKS]     (default 220; a few minutes)
#   CHAOS_PG_FAILOVER=1 scripts/chaos.sh    step 4 kills a primary and promotes its standby
#   CHAOS_REDIS_CLUSTER=1 scripts/chaos.sh  on a Redis Cluster of the run's own (3 masters, 3
#                                           replicas): step 3 kills the master holding the queue
#                                           with SIGKILL (its replica is promoted) instead of a flush
# Both together: the Redis master, then the PostgreSQL primary.
#
# Uses the local services of scripts/services.sh (started when absent). It restarts that
# PostgreSQL cluster once and flushes Redis database 7, which is its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

eval "$(scripts/services.sh start | sed 's/^/export /')"
REDIS_URL="${CHAOS_REDIS_URL:-${REDIS_URL%/*}/7}"
export REDIS_URL
if [ "${CHAOS_PG_FAILOVER:-0}" = 1 ]; then
    # A primary with a synchronous streaming standby of this run's own (fresh each time: after
    # the drill the old primary is dead and the standby leads); step 4 kills the primary with
    # SIGKILL and promotes the standby.
    export ZHIHUI_LOCAL_DIR="$ROOT/target/chaos-pg-pair-$$"
    export ZHIHUI_PG_PRIMARY_PORT="${CHAOS_PG_PRIMARY_PORT:-55452}"
    export ZHIHUI_PG_STANDBY_PORT="${CHAOS_PG_STANDBY_PORT:-55453}"
    trap 'scripts/services.sh stop-pg-pair >/dev/null 2>&1 || true; rm -rf "$ZHIHUI_LOCAL_DIR"' EXIT
    eval "$(scripts/services.sh start-pg-pair | grep '^DATABASE_URL=' | sed 's/^/export /')"
    CHAOS_PG_RESTART="$ROOT/scripts/services.sh kill-primary && sleep 1 && $ROOT/scripts/services.sh promote-standby"
    export CHAOS_PG_RESTART
fi
if [ "${CHAOS_REDIS_CLUSTER:-0}" = 1 ]; then
    export ZHIHUI_REDIS_CLUSTER_BASE="${CHAOS_REDIS_CLUSTER_BASE:-55320}"
    CLUSTER_LOCAL_DIR="$ROOT/target/chaos-redis-cluster-$$"
    cleanup_cluster() {
        ZHIHUI_LOCAL_DIR="$CLUSTER_LOCAL_DIR" scripts/services.sh stop-redis-cluster >/dev/null 2>&1 || true
        rm -rf "$CLUSTER_LOCAL_DIR"
    }
    trap 'cleanup_cluster; if [ -n "${ZHIHUI_LOCAL_DIR:-}" ]; then scripts/services.sh stop-pg-pair >/dev/null 2>&1 || true; rm -rf "$ZHIHUI_LOCAL_DIR"; fi' EXIT
    eval "$(ZHIHUI_LOCAL_DIR="$CLUSTER_LOCAL_DIR" scripts/services.sh start-redis-cluster | sed 's/^REDIS_CLUSTER_NODES=/export CHAOS_REDIS_CLUSTER_NODES=/')"
    # The queue's slot (every key tagged {queue}): its master is the one killed.
    slot="$(redis-cli -p $((ZHIHUI_REDIS_CLUSTER_BASE + 1)) cluster keyslot queue)"
    export CHAOS_REDIS_KILL="ZHIHUI_LOCAL_DIR=$CLUSTER_LOCAL_DIR $ROOT/scripts/services.sh kill-redis-master $slot"
    export CHAOS_REDIS_RESTART="ZHIHUI_LOCAL_DIR=$CLUSTER_LOCAL_DIR $ROOT/scripts/services.sh restart-redis-node \$PORT"
fi
if [ -z "${CHAOS_PG_RESTART:-}" ] && [ -s .local/postgres/data/postmaster.pid ]; then
    bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
    # pg_ctl restart starts it again with the options it was started with.
    CHAOS_PG_RESTART="runuser -u ${ZHIHUI_PG_OS_USER:-postgres} -- $bin/pg_ctl -D $ROOT/.local/postgres/data -m fast -w restart"
    export CHAOS_PG_RESTART
fi
cargo build --release --locked -p zhihui --bin zhihui
cargo build --release --locked -p zhihui-bench --bin chaos_two_processes
# Not exec: the pair's trap must run when the program ends.
ZHIHUI_BIN="$ROOT/target/release/zhihui" target/release/chaos_two_processes "$@"
