#!/usr/bin/env bash
# The body of the per-family OpenCode launchers (qwen36-opencode.sh, gemma4-opencode.sh): refuse a GGUF of another
# architecture with one line (exit 3; a missing --model is exit 2), then run serve_agent.py on the family's port
# with 4 slots. Not for direct use:
#   family-opencode.sh NAME PORT "ARCH …" "FAMILY (ARCH, …)" [launcher arguments]
set -euo pipefail
name="$1" port="$2" arches="$3" family="$4"
shift 4
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
  echo "$name: error: --model PATH.gguf is required (a ${arches// / or } GGUF)" >&2
  exit 2
fi
if [[ -f "$model" ]]; then
  arch="$("$PY" -c 'import sys; from hf2q.formats.gguf_parse import read_metadata; from hf2q.formats.gguf_keys import Keys
print(read_metadata(sys.argv[1]).get(Keys.General.ARCHITECTURE, ""))' "$model" 2>/dev/null || true)"
  if [[ -z "$arch" || " $arches " != *" $arch "* ]]; then
    echo "$name: error: $model is a '${arch:-unreadable}' GGUF, not $family" >&2
    exit 3
  fi
fi
exec "$PY" "$(dirname "$0")/serve_agent.py" --client opencode --python "$PY" --port "$port" --slots 4 "$@"
