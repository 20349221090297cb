#!/usr/bin/env bash
# What tests, benchmark programs and chaos runs leave on the local services when they end early
# (or, for the tests' own databases, at all): their databases (`zhihui_test_*`, `zhihui_bench_*`,
# `zhihui_chaos_*`) dropped and their Redis keys (prefixes `test:` and `bench:`) removed. Needs
# DATABASE_URL and REDIS_URL; run it only while none of them is running (the gate before and after
# its tests, `scripts/bench` before each program).
#
# Why it matters beyond disk: the autovacuum launcher visits every database in turn, so a cluster
# holding a gate's ~490 leftover databases starts an autovacuum worker about every eighth of a
# second (each a new backend), and a Redis holding leftover keys rewrites a larger append-only
# file. Both fell on benchmark figures measured after a gate.
set -euo pipefail

dropped=0
while read -r stale; do
    [ -n "$stale" ] || continue
    # Without FORCE: a database something is still connected to is left alone.
    if psql "$DATABASE_URL" -qc "DROP DATABASE IF EXISTS \"$stale\"" >/dev/null 2>&1; then
        dropped=$((dropped + 1))
    fi
done < <(psql "$DATABASE_URL" -tAc "SELECT datname FROM pg_database
    WHERE datname LIKE 'zhihui\_test\_%' OR datname LIKE 'zhihui\_bench\_%'
       OR datname LIKE 'zhihui\_chaos\_%'")

removed=0
for pattern in 'test:*' 'bench:*'; do
    while read -r key_batch; do
        [ -n "$key_batch" ] || continue
        # shellcheck disable=SC2086 # a batch of keys, one word each
        redis-cli -u "$REDIS_URL" UNLINK $key_batch >/dev/null
        removed=$((removed + $(wc -w <<<"$key_batch")))
    done < <(redis-cli -u "$REDIS_URL" --scan --pattern "$pattern" | xargs -r -n 1000 echo)
done

if [ "$dropped" -gt 0 ] || [ "$removed" -gt 0 ]; then
    echo "tidy: dropped $dropped leftover databases, removed $removed leftover Redis keys"
fi
