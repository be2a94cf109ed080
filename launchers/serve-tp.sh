#!/usr/bin/env bash
# Serve one GGUF across N tensor-parallel ranks (mx.distributed; docs/TENSOR_PARALLEL.md).
#   launchers/serve-tp.sh N --model path/to/model.gguf [other `hf2q serve` flags]
# Rank 0 is the server process itself; it starts ranks 1..N-1 and they exit with it.
# On CUDA each rank gets one GPU (rank r → GPU r of CUDA_VISIBLE_DEVICES order) and talks
# NCCL; on CPU the ranks form an MLX ring on 127.0.0.1. NVLink SHARP (NVLS) stays off.
# A rank that dies poisons the engine (/readyz 503); restarting the process is the
# recovery — run this under systemd (Restart=on-failure) or a loop of your own.
set -euo pipefail
if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $(basename "$0") N --model MODEL.gguf [hf2q serve flags]" >&2
  exit 2
fi
N="$1"; shift
export NCCL_NVLS_ENABLE=0
PY="${HF2Q_PYTHON:-python3}"
exec "$PY" -m hf2q serve --tensor-parallel "$N" "$@"
