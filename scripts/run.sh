#!/usr/bin/env bash
# Run zhihui end to end on this machine: local PostgreSQL and Redis (installed and started when
# absent), two ComfyUI simulators (ports 8188 and 8189, images under .local/sim-*), migrations,
# then `zhihui serve` on http://127.0.0.1:${ZHIHUI_HTTP__PORT:-8080} dispatching to both.
# Stop with Ctrl-C (the simulators stop with it); `scripts/services.sh stop` stops the services.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

eval "$(scripts/services.sh start | sed 's/^/export /')"
export ZHIHUI_DATABASE__URL="${ZHIHUI_DATABASE__URL:-$DATABASE_URL}"
export ZHIHUI_REDIS__URL="${ZHIHUI_REDIS__URL:-$REDIS_URL}"

cargo build --release --locked --bin zhihui
cargo build --release --locked -p comfyui-sim --bin comfyui-sim
./target/release/zhihui migrate

SIM_PIDS=()
stop_sims() {
    for pid in "${SIM_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap stop_sims EXIT
MODELS="majicmixRealistic_v7.safetensors,anythingelseV4_v45.safetensors"
for port in 8188 8189; do
    ./target/release/comfyui-sim --listen 127.0.0.1 --port "$port" \
        --output-directory ".local/sim-$port" --models "$MODELS" --step-delay-ms "${SIM_STEP_DELAY_MS:-50}" &
    SIM_PIDS+=("$!")
done
export ZHIHUI_DISPATCH__BACKENDS="${ZHIHUI_DISPATCH__BACKENDS:-gpu-1 http://127.0.0.1:8188 1,gpu-2 http://127.0.0.1:8189 1}"
export ZHIHUI_DISPATCH__IMAGES_DIRECTORY="${ZHIHUI_DISPATCH__IMAGES_DIRECTORY:-.local/images}"
cat >&2 <<MESSAGE

  zhihui is starting: open http://127.0.0.1:${ZHIHUI_HTTP__PORT:-8080}/ in a browser (Chinese, or
  English with the switch at the top), sign up, and make a first image.
  An admin, from another shell:
    echo 'a long password' | ./target/release/zhihui users create boss --admin --password-stdin
  then log in as boss: the 管理 (Admin) pages grant points and run the servers, codes and sales.

MESSAGE
./target/release/zhihui serve
