#!/usr/bin/env bash
# Validate docker/compose.yaml against the Compose specification without a Docker engine.
#
# Uses `docker compose config` when the compose plugin is present, else Debian's docker-compose
# (which validates against its bundled compose-spec JSON schema and interpolates variables, all
# without contacting a daemon), installing it if needed. Then checks what the schema cannot: the
# services zhihui's stack needs are all there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FILE="${1:-$ROOT/docker/compose.yaml}"

if docker compose version >/dev/null 2>&1; then
    validate() { docker compose -f "$1" config -q; }
    list_services() { docker compose -f "$1" config --services; }
else
    if ! command -v docker-compose >/dev/null; then
        echo "check-compose: installing docker-compose (validator only; no engine needed)" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >&2
    fi
    validate() { docker-compose -f "$1" config -q; }
    list_services() { docker-compose -f "$1" config --services; }
fi

validate "$FILE"
services="$(list_services "$FILE" | sort | tr '\n' ' ')"
for needed in kurrentdb postgres redis zhihui; do
    case " $services" in
        *" $needed "*) ;;
        *) echo "check-compose: service '$needed' missing from $FILE (has: $services)" >&2; exit 1 ;;
    esac
done
echo "check-compose: $FILE is valid (services: $services)"
