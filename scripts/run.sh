#!/usr/bin/env bash
# Run zhihui end to end on this machine: local PostgreSQL and Redis (installed and started when
# absent), migrations, then `zhihui serve` on http://127.0.0.1:${ZHIHUI_HTTP__PORT:-8080}.
# Stop with Ctrl-C; `scripts/services.sh stop` stops the services.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

eval "$(scripts/services.sh start | sed 's/^/export /')"
export ZHIHUI_DATABASE__URL="${ZHIHUI_DATABASE__URL:-$DATABASE_URL}"
export ZHIHUI_REDIS__URL="${ZHIHUI_REDIS__URL:-$REDIS_URL}"

cargo build --release --locked --bin zhihui
./target/release/zhihui migrate
exec ./target/release/zhihui serve
