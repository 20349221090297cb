#!/usr/bin/env bash
# Money under chaos across two `zhihui serve` processes (bench/src/bin/chaos_two_processes.rs):
# tasks, prioritises and cancels sent to random processes while each process is killed with
# SIGKILL and restarted, Redis is flushed, PostgreSQL is restarted and a simulator crashes; then
# every task must have ended once and `zhihui audit verify` must find nothing, not even pending.
#
#   scripts/chaos.sh [TASKS]     (default 220; a few minutes)
#
# Uses the local services of scripts/services.sh (started when absent). It restarts that
# PostgreSQL cluster once and flushes Redis database 7, which is its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

eval "$(scripts/services.sh start | sed 's/^/export /')"
REDIS_URL="${CHAOS_REDIS_URL:-${REDIS_URL%/*}/7}"
export REDIS_URL
if [ -z "${CHAOS_PG_RESTART:-}" ] && [ -s .local/postgres/data/postmaster.pid ]; then
    bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
    # pg_ctl restart starts it again with the options it was started with.
    CHAOS_PG_RESTART="runuser -u ${ZHIHUI_PG_OS_USER:-postgres} -- $bin/pg_ctl -D $ROOT/.local/postgres/data -m fast -w restart"
    export CHAOS_PG_RESTART
fi
cargo build --release --locked -p zhihui --bin zhihui
cargo build --release --locked -p zhihui-bench --bin chaos_two_processes
ZHIHUI_BIN="$ROOT/target/release/zhihui" exec target/release/chaos_two_processes "$@"
