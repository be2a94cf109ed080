#!/usr/bin/env bash
# Serve a DeepSeek-V4 GGUF (deepseek4: V4, V4-Flash) for OpenCode on port 8080 with 4 slots, and print OpenCode's
# provider JSON (launchers/serve_agent.py does the work; see its --help). Tool calls use DeepSeek's DSML syntax;
# thinking is off unless a request asks for it (enable_thinking, reasoning_effort: docs/API.md).
#   [CONTEXT_LEN=N] launchers/deepseek4-opencode.sh --model DeepSeek-V4-Flash-Q4_K_M.gguf [--api-key KEY] [-- serve flags]
# CONTEXT_LEN (or --ctx N) is the per-slot context (default: the GGUF's); --port and --slots override the defaults.
exec bash "$(dirname "$0")/family-opencode.sh" deepseek4-opencode 8080 "deepseek4" "DeepSeek-V4 (deepseek4)" \
  ${CONTEXT_LEN:+--ctx "$CONTEXT_LEN"} "$@"
