#!/usr/bin/env bash
# Serve a Gemma 4 GGUF (gemma4: dense, E2B/E4B, 26B-A4B MoE) for OpenCode on port 8082 with 4 slots, and print
# OpenCode's provider JSON (launchers/serve_agent.py does the work; see its --help). Tool calls use Gemma 4's own
# syntax; thinking is off unless a request asks for it (enable_thinking, reasoning_effort: docs/API.md).
#   launchers/gemma4-opencode.sh --model gemma-4-31B-it-Q4_K_M.gguf [--api-key KEY] [--ctx N] [-- serve flags]
# --port and --slots may be given to override the defaults.
exec bash "$(dirname "$0")/family-opencode.sh" gemma4-opencode 8082 "gemma4" "Gemma 4 (gemma4)" "$@"
