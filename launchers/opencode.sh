#!/usr/bin/env bash
# Start hf2q for OpenCode and print its provider config (see launchers/serve_agent.py --help).
#   launchers/opencode.sh --port 8080 --slots 4 --model path/to/model.gguf --api-key KEY
set -euo pipefail
PY="${HF2Q_PYTHON:-python3}"
exec "$PY" "$(dirname "$0")/serve_agent.py" --client opencode --python "$PY" "$@"
