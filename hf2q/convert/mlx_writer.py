"""``hf2q convert --format mlx``: an HF checkpoint → an mlx-lm directory (affine-quantized).

Decisions (names, which tensors, how many bits) come from ``mlx_policy``; this module only
moves data: read each source tensor from the memory-mapped safetensors, quantize it with
``mx.quantize``, collect shards of at most ``SHARD_BYTES`` and save them with
``mx.save_safetensors``. Peak memory is one shard plus one tensor.

The directory is built as ``OUT.tmp/`` and renamed onto ``OUT`` only when complete, so an
interrupted conversion never leaves a directory that ``mlx_lm.load`` would half-load.
Non-quantized tensors (norms, and weights whose width is not a multiple of the group
size) keep the checkpoint's dtype, as ``mlx_lm.convert`` does; scales and biases share it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from hf2q import __version__
from hf2q.atomic import atomic_write_text, fsync_dir, replace_dir
from hf2q.convert import mlx_policy
from hf2q.convert.mlx_policy import MlxQuant, TensorPlan
from hf2q.errors import ConversionError, InputError, UsageError
from hf2q.sources.hf_config import load_config

log = logging.getLogger("hf2q.convert.mlx")

SHARD_BYTES = 5 << 30  # mlx-lm's shard size
SCHEMA = "hf2q.convert.report/1"
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "vocab.txt", "chat_template.jinja",
                "chat_template.json", "generation_config.json")
_FLOAT_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def default_output(src: Path, quant: str) -> Path:
    return Path.cwd() / f"{src.name}-{quant}"


def _source(args: argparse.Namespace) -> Path:
    if getattr(args, "repo", None) and getattr(args, "src", None):
        raise UsageError("give either SRC or --repo, not both")
    if getattr(args, "repo", None):
        from hf2q.sources.hub import resolve_repo
        return Path(resolve_repo(args.repo, args.revision, args.cache_dir))
    if not getattr(args, "src", None):
        raise UsageError("convert needs SRC (an HF model directory) or --repo ID")
    return Path(args.src)


def convert_mlx(args: argparse.Namespace) -> int:
    """CLI entry (``hf2q.convert.command`` dispatches here for ``--format mlx`` / ``mlx-*`` names)."""
    if getattr(args, "imatrix", None):
        raise InputError("--imatrix applies to GGUF output only")
    quant = mlx_policy.parse_mlx_quant(args.quant)
    group_size = mlx_policy.check_group_size(getattr(args, "group_size", None))
    src = _source(args)
    if getattr(args, "dry_run", False):
        for line in dry_run(src, quant, group_size):
            print(line)
        return 0
    out = Path(args.output) if args.output else default_output(src, quant.name)
    rep = write_mlx(src, out, quant, group_size, integrity=not getattr(args, "no_integrity", False),
                    report_path=Path(args.json_report) if getattr(args, "json_report", None) else None)
    print(f"wrote {out}/ ({rep['output_bytes'] / 2**20:.1f} MiB, {rep['tensor_count']} tensors, "
          f"{rep['bits_per_weight']:.2f} bpw) in {rep['timings_s']['total_s']:.1f}s")
    return 0


def _plan(src: Path, quant: MlxQuant, group_size: int):
    from hf2q.sources.safetensors_reader import SafetensorsCheckpoint

    cfg = load_config(src)
    mlx_policy.model_type(cfg)
    ckpt = SafetensorsCheckpoint(src)
    _check_against_config(cfg, src, ckpt)
    shapes = {e.name: tuple(e.shape) for e in ckpt}
    return cfg, ckpt, mlx_policy.plan_tensors(cfg, shapes, quant, group_size)


def _check_against_config(cfg: dict[str, Any], src: Path, ckpt) -> None:
    """The GGUF path's header-only checks (config values, layers, tensor names and shapes), so a broken
    checkpoint is refused the same way whichever format is asked for."""
    from hf2q.arch.registry import family_class
    from hf2q.convert.checkpoint_check import check_config
    from hf2q.convert.pipeline import plan_checked
    from hf2q.sources.hf_config import architecture_name

    try:
        family_cls = family_class(architecture_name(cfg))
    except InputError:  # mlx_policy knows the family by model_type; the GGUF table may not
        check_config(cfg, ckpt)  # plan_checked runs it for the families it knows
        return
    from hf2q.sources.tokenizer_meta import release_tokenizer_cache
    try:
        plan_checked(family_cls, cfg, src, ckpt)
    finally:
        release_tokenizer_cache()


def _float_dtype(cfg: dict[str, Any], ckpt) -> str:
    """The dtype kept for non-quantized tensors: config's torch_dtype, else the weights' own."""
    for key in ("torch_dtype", "dtype"):
        if cfg.get(key) in _FLOAT_DTYPES:
            return _FLOAT_DTYPES[cfg[key]]
    dtypes = {e.dtype for e in ckpt}
    for st in ("BF16", "F16", "F32"):
        if st in dtypes:
            return _ST_DTYPES[st]
    return "float16"


def dry_run(src: Path, quant: MlxQuant, group_size: int) -> list[str]:
    cfg, ckpt, plans = _plan(src, quant, group_size)
    try:
        fbytes = 2 if _float_dtype(cfg, ckpt) != "float32" else 4
    finally:
        ckpt.close()
    lines = [f"{'tensor':60} {'shape':>22} {'stored as':>12} {'bytes':>12}"]
    total = 0
    for p in plans:
        n = int(np.prod(p.shape))
        b = mlx_policy.quantized_bytes(p.shape, p.bits, p.group_size, fbytes) if p.bits else n * fbytes
        total += b
        kind = f"{p.bits}b/g{p.group_size}" if p.bits else "float"
        lines.append(f"{p.name:60} {list(p.shape)!s:>22} {kind:>12} {b:>12}")
    lines.append(f"total {total} bytes ({total / 2**20:.1f} MiB) in {len(plans)} tensors, {quant.name}")
    return lines


def _load_tensor(ckpt, p: TensorPlan) -> np.ndarray:
    if len(p.sources) == 1:
        return ckpt.f32(p.sources[0])
    return np.stack([ckpt.f32(s) for s in p.sources])


def _error(mx, w, q) -> tuple[float, float]:
    """RMSE and cosine of the stored (dequantized) values against the source, in float32."""
    a = w.astype(mx.float32).reshape(-1)
    b = q.astype(mx.float32).reshape(-1)
    rmse = float(mx.sqrt(mx.mean((a - b) ** 2)).item())
    den = float((mx.linalg.norm(a) * mx.linalg.norm(b)).item())
    cos = float((mx.sum(a * b)).item()) / den if den > 0 else 1.0
    return rmse, cos


def _write_shard(mx, tmp: Path, index: int, arrays: dict) -> str:
    name = f"model-{index:05d}.safetensors"  # renamed once the shard count is known
    mx.save_safetensors(str(tmp / name), arrays, metadata={"format": "mlx"})
    return name


def write_mlx(src: Path, out: Path, quant: MlxQuant, group_size: int = 64, integrity: bool = True,
              report_path: Path | None = None, shard_bytes: int = SHARD_BYTES) -> dict:
    """Convert ``src`` into the mlx-lm directory ``out``; returns the report (also written to disk)."""
    import mlx.core as mx

    t_start = time.perf_counter()
    timings = {"plan_s": 0.0, "hash_s": 0.0, "quantize_s": 0.0, "write_s": 0.0, "total_s": 0.0}
    src, out = Path(src), Path(out)
    cfg, ckpt, plans = _plan(src, quant, group_size)
    timings["plan_s"] = time.perf_counter() - t_start
    if not out.parent.is_dir():
        raise InputError(f"{out.parent}: output directory does not exist")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a directory (mlx output is a directory)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise InputError(f"{out.parent}: cannot create the output directory ({e.strerror})") from None
    dtype = getattr(mx, _float_dtype(cfg, ckpt))
    try:
        hashes = {}
        if integrity:
            from hf2q.sources.integrity import hash_inputs
            t0 = time.perf_counter()
            hashes = hash_inputs(src, ckpt.files)
            timings["hash_s"] = time.perf_counter() - t0
        rows, shard_files, weight_map = [], [], {}
        shard: dict = {}
        shard_size = 0
        n_elements = 0
        for p in plans:
            t0 = time.perf_counter()
            source = mx.array(_load_tensor(ckpt, p))
            w = source.astype(dtype)
            for s in p.sources:
                ckpt.release(s)
            if p.bits:
                wq, scales, biases = mx.quantize(w, group_size=p.group_size, bits=p.bits)
                back = mx.dequantize(wq, scales, biases, group_size=p.group_size, bits=p.bits)
                stored = {p.name: wq, f"{p.module}.scales": scales, f"{p.module}.biases": biases}
            else:
                back = w
                stored = {p.name: w}
            mx.eval(*stored.values())
            rmse, cos = _error(mx, source, back)
            del source
            timings["quantize_s"] += time.perf_counter() - t0
            nbytes = sum(a.nbytes for a in stored.values())
            if shard and shard_size + nbytes > shard_bytes:
                t0 = time.perf_counter()
                shard_files.append((_write_shard(mx, tmp, len(shard_files) + 1, shard), list(shard)))
                timings["write_s"] += time.perf_counter() - t0
                shard, shard_size = {}, 0
            shard.update(stored)
            shard_size += nbytes
            n_elements += int(np.prod(p.shape))
            rows.append({"name": p.name, "sources": list(p.sources), "shape": list(p.shape),
                         "type": f"affine{p.bits}" if p.bits else str(dtype).removeprefix("mlx.core."),
                         "bits": p.bits, "group_size": p.group_size, "bytes": nbytes,
                         "rmse": rmse, "cosine": cos})
        t0 = time.perf_counter()
        if shard or not shard_files:
            shard_files.append((_write_shard(mx, tmp, len(shard_files) + 1, shard), list(shard)))
        _finish_layout(tmp, shard_files, weight_map)
        _write_config(tmp, cfg, plans, quant, group_size)
        for name in COPIED_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        timings["write_s"] += time.perf_counter() - t0
        _publish(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConversionError(f"writing {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    timings["total_s"] = time.perf_counter() - t_start
    total = sum(r["bytes"] for r in rows)
    rep = {
        "schema": SCHEMA, "hf2q_version": __version__, "created_unix": int(time.time()),
        "source": str(src), "output": str(out), "format": "mlx", "quant": quant.name,
        "group_size": group_size, "architecture": cfg.get("model_type"),
        "inputs_sha256": hashes, "integrity_checked": bool(hashes), "tensor_count": len(rows),
        "total_tensor_bytes": total,
        "output_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()),
        "bits_per_weight": 8 * total / max(1, n_elements),
        "timings_s": {k: round(v, 4) for k, v in timings.items()}, "tensors": rows,
    }
    report = report_path or out.with_name(out.name + ".report.json")
    atomic_write_text(report, json.dumps(rep, indent=1) + "\n")
    return rep


def _finish_layout(tmp: Path, shard_files: list[tuple[str, list[str]]], weight_map: dict) -> None:
    """Give shards mlx-lm's names and write the index (mlx-lm writes one even for one shard)."""
    n = len(shard_files)
    total = 0
    for i, (name, keys) in enumerate(shard_files, start=1):
        final = "model.safetensors" if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(tmp / name, tmp / final)
        total += (tmp / final).stat().st_size
        for k in keys:
            weight_map[k] = final
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")


def _write_config(tmp: Path, cfg: dict, plans: list[TensorPlan], quant: MlxQuant, group_size: int) -> None:
    conf = mlx_policy.mlx_config(cfg)
    q = mlx_policy.quantization_config(plans, quant, group_size)
    conf["quantization"] = q
    conf["quantization_config"] = q  # mlx-lm writes both
    (tmp / "config.json").write_text(json.dumps(conf, indent=4, sort_keys=True) + "\n")


def _publish(tmp: Path, out: Path) -> None:
    """fsync the files, then swap the finished directory into place (replacing an older one)."""
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    replace_dir(tmp, out)
