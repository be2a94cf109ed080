#!/usr/bin/env bash
# Serve a Qwen 3.5 / 3.6 GGUF (qwen35, qwen35moe) for OpenCode on port 8081 with 4 slots, and print
# OpenCode's provider JSON (launchers/serve_agent.py does the work; see its --help).
#   launchers/qwen36-opencode.sh --model Qwen3.6-35B-A3B-Q4_K_M.gguf [--api-key KEY] [--ctx N] [-- serve flags]
# --port and --slots may be given to override the defaults.
exec bash "$(dirname "$0")/family-opencode.sh" qwen36-opencode 8081 "qwen35 qwen35moe" \
  "Qwen 3.5 / 3.6 (qwen35, qwen35moe)" "$@"
