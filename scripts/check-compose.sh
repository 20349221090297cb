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
for needed in grafana kurrentdb postgres prometheus redis zhihui; do
    case " $services" in
        *" $needed "*) ;;
        *) echo "check-compose: service '$needed' missing from $FILE (has: $services)" >&2; exit 1 ;;
    esac
done
# The dashboard: valid JSON, and every metric its queries name is one zhihui documents (README's
# metrics table), so a renamed metric cannot leave a panel silently empty.
DASHBOARD="$(dirname "$FILE")/grafana/dashboards/zhihui.json"
python3 - "$DASHBOARD" "$ROOT/README.md" <<'PY'
import json, re, sys
dashboard = json.load(open(sys.argv[1]))
documented = set(re.findall(r"^\| `(zhihui_[a-z_]+)` \|", open(sys.argv[2]).read(), re.M))
used = set()
for panel in dashboard["panels"]:
    for target in panel["targets"]:
        used |= {re.sub(r"_(bucket|sum|count)$", "", name)
                 for name in re.findall(r"\b(zhihui_[a-z_]+)", target["expr"])}
missing = sorted(used - documented)
if missing:
    sys.exit(f"check-compose: the dashboard queries undocumented metrics: {missing}")
print(f"check-compose: dashboard {len(dashboard['panels'])} panels, {len(used)} metrics, all documented")
PY
echo "check-compose: $FILE is valid (services: $services)"
