#!/usr/bin/env bash
# Serve a Qwen 3.5 / 3.6 GGUF (qwen35, qwen35moe) for OpenCode on port 8081 with 4 slots, and print
# OpenCode's provider JSON (launchers/serve_agent.py does the work; see its --help).
#   launchers/qwen36-opencode.sh --model Qwen3.6-35B-A3B-Q4_K_M.gguf [--api-key KEY] [--ctx N] [-- serve flags]
# --port and --slots may be given to override the defaults.
set -euo pipefail
PY="${HF2Q_PYTHON:-python3}"
model=""
for ((i = 1; i <= $#; i++)); do
  case "${!i}" in
    --model) j=$((i + 1)); model="${!j:-}" ;;
    --model=*) model="${!i#--model=}" ;;
    --) break ;;
  esac
done
if [[ -z "$model" ]]; then
  echo "qwen36-opencode: error: --model PATH.gguf is required (a qwen35 or qwen35moe GGUF)" >&2
  exit 2
fi
if [[ -f "$model" ]]; then
  arch="$("$PY" -c 'import sys; from hf2q.formats.gguf_parse import read_metadata; from hf2q.formats.gguf_keys import Keys
print(read_metadata(sys.argv[1]).get(Keys.General.ARCHITECTURE, ""))' "$model" 2>/dev/null || true)"
  if [[ "$arch" != "qwen35" && "$arch" != "qwen35moe" ]]; then
    echo "qwen36-opencode: error: $model is a '${arch:-unreadable}' GGUF, not Qwen 3.5 / 3.6 (qwen35, qwen35moe)" >&2
    exit 3
  fi
fi
exec "$PY" "$(dirname "$0")/serve_agent.py" --client opencode --python "$PY" --port 8081 --slots 4 "$@"
