"""``hf2q convert --format mlx --quant dwq-N``: the plain mlx-N directory, then its scales and biases distilled.

The plain affine quantization is written first exactly as ``--quant mlx-N`` writes it (so the codes
and the layout are mlx-lm's), into a staging directory beside the output. DWQ then reads that
student and the full-precision teacher, fits the scales and biases (``dwq_fit``), rewrites the
shards with the fitted arrays and only then swaps the staging directory onto the output, so an
interrupted run leaves nothing that ``mlx_lm.load`` would half-load. config.json's ``quantization``
is unchanged: the format is still mlx-lm's affine one.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from hf2q.atomic import atomic_write_text
from hf2q.convert import mlx_policy
from hf2q.convert.dwq_fit import DwqSettings, distill, split_tokens
from hf2q.errors import InputError, UsageError
from hf2q.sources.hf_config import load_config

log = logging.getLogger("hf2q.convert.dwq")

FLAGS = ("dwq_corpus", "dwq_steps", "dwq_lr", "dwq_seq_len")


def settings_from_args(args: argparse.Namespace) -> DwqSettings:
    """The fit settings from the ``--dwq-*`` flags (defaults where absent); UsageError for impossible values."""
    d = DwqSettings()
    steps = d.steps if getattr(args, "dwq_steps", None) is None else args.dwq_steps
    lr = d.lr if getattr(args, "dwq_lr", None) is None else args.dwq_lr
    seq_len = d.seq_len if getattr(args, "dwq_seq_len", None) is None else args.dwq_seq_len
    if steps < 0:
        raise UsageError(f"--dwq-steps must be 0 or more (got {steps})")
    if not (lr > 0 and np.isfinite(lr)):
        raise UsageError(f"--dwq-lr must be a positive number (got {lr})")
    if seq_len < 2:
        raise UsageError(f"--dwq-seq-len must be at least 2 (got {seq_len})")
    return DwqSettings(steps=steps, lr=float(lr), seq_len=seq_len)


def check_flags_unused(args: argparse.Namespace) -> None:
    """``--dwq-*`` flags only mean something with ``--quant dwq-N``."""
    for f in FLAGS:
        if getattr(args, f, None) is not None:
            raise UsageError(f"--{f.replace('_', '-')} applies to --quant dwq-3 / dwq-4 only (or dwq-q4_1 / dwq-q5_1 for GGUF)")


def calibration_tokens(src: Path, corpus_spec: str | None) -> tuple[str, np.ndarray]:
    from tokenizers import Tokenizer

    from hf2q.quality.corpus import load_corpus

    corpus = load_corpus(corpus_spec)
    path = src / "tokenizer.json"
    if not path.is_file():
        raise InputError(f"{src}: DWQ needs tokenizer.json to tokenize its calibration text")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception on a malformed file
        raise InputError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
    return corpus.name, np.asarray(tok.encode(corpus.text, add_special_tokens=False).ids, dtype=np.int32)


def convert_dwq(args: argparse.Namespace) -> int:
    """CLI entry for ``--quant dwq-N`` (``hf2q.convert.command`` dispatches here)."""
    from hf2q.convert import mlx_writer

    if getattr(args, "imatrix", None):
        raise InputError("--imatrix applies to GGUF output only")
    quant = mlx_policy.parse_mlx_quant(args.quant)
    settings = settings_from_args(args)
    group_size = mlx_policy.check_group_size(getattr(args, "group_size", None))
    src = mlx_writer._source(args)
    base = mlx_policy.MlxQuant(f"mlx-{quant.bits}", quant.bits)
    if getattr(args, "dry_run", False):
        for line in mlx_writer.dry_run(src, base, group_size):
            print(line)
        return 0
    out = Path(args.output) if args.output else mlx_writer.default_output(src, quant.name)
    rep = write_dwq(src, out, quant, group_size, settings, getattr(args, "dwq_corpus", None),
                    integrity=not getattr(args, "no_integrity", False), report_path=report_arg(args))
    print(summary(f"{out}/", rep))
    return 0


def report_arg(args: argparse.Namespace) -> Path | None:
    return Path(args.json_report) if getattr(args, "json_report", None) else None


def summary(label: str, rep: dict) -> str:
    """The one line a DWQ conversion prints: size, time, and held-out KL before and after (as written)."""
    d = rep["dwq"]
    final = d.get("heldout_written", d["heldout_after"])
    return (f"wrote {label} ({rep['output_bytes'] / 2**20:.1f} MiB, {rep['bits_per_weight']:.2f} bpw) in "
            f"{rep['timings_s']['total_s']:.1f}s; held-out KL {d['heldout_before']['kl_mean']:.5f} -> "
            f"{final['kl_mean']:.5f} after {d['steps']} DWQ steps")


def _teacher(src: Path, quant: mlx_policy.MlxQuant, group_size: int) -> tuple[dict, dict[str, Any]]:
    """config.json and the full-precision weights under their mlx-lm names, as float32."""
    import mlx.core as mx

    from hf2q.convert import mlx_writer

    cfg, ckpt, plans = mlx_writer._plan(src, quant, group_size)
    try:
        return cfg, {p.name: mx.array(mlx_writer._load_tensor(ckpt, p)) for p in plans}
    finally:
        ckpt.close()


def write_dwq(src: Path, out: Path, quant: mlx_policy.MlxQuant, group_size: int, settings: DwqSettings,
              corpus: str | None = None, integrity: bool = True, report_path: Path | None = None,
              make_linear=None) -> dict:
    """Write the DWQ-fitted mlx-lm directory ``out``; returns the report (also written to disk)."""
    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()  # OpenBLAS for the fit's products, loaded before MLX (docs/ENGINE.md, "CPU backend")
    import mlx.core as mx

    from hf2q.convert import mlx_writer
    from hf2q.convert.dwq_forward import QuantLayout, decoder
    from hf2q.convert.dwq_matmul import default_linear

    t_start = time.perf_counter()
    src, out = Path(src), Path(out)
    cfg = load_config(src)
    dec = decoder(cfg)  # refuse an unsupported family before any work
    corpus_name, tokens = calibration_tokens(src, corpus)
    split_tokens(tokens, settings.seq_len)  # a too-short corpus fails here, not after the base conversion
    base = mlx_policy.MlxQuant(f"mlx-{quant.bits}", quant.bits)
    staging = out.with_name(out.name + ".dwq-base")
    base_report = out.with_name(out.name + ".dwq-base.report.json")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        rep = mlx_writer.write_mlx(src, staging, base, group_size, integrity=integrity, report_path=base_report)
        base_report.unlink(missing_ok=True)
        conf = json.loads((staging / "config.json").read_text())
        layout = QuantLayout.from_config(conf["quantization"])
        shards = {f.name: mx.load(str(f)) for f in sorted(staging.glob("model*.safetensors"))}
        student = {k: v for arrays in shards.values() for k, v in arrays.items()}
        _, teacher = _teacher(src, base, group_size)
        t0 = time.perf_counter()
        fitted, section = distill(dec, teacher, student, layout, tokens, settings,
                                  make_linear or default_linear, _progress_logger(settings.steps))
        dwq_s = time.perf_counter() - t0
        section["corpus"] = corpus_name
        for name, arrays in shards.items():
            for k in arrays:
                if k in fitted:
                    arrays[k] = fitted[k]
            mx.save_safetensors(str(staging / name), arrays, metadata={"format": "mlx"})
        _refresh_index(staging)
        _rescore_rows(rep["tensors"], teacher, {**student, **fitted}, layout)
        mlx_writer._publish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        base_report.unlink(missing_ok=True)
        raise
    rep.update({"output": str(out), "quant": quant.name, "dwq": section,
                "output_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file())})
    rep["timings_s"]["dwq_s"] = round(dwq_s, 4)
    rep["timings_s"]["total_s"] = round(time.perf_counter() - t_start, 4)
    atomic_write_text(report_path or out.with_name(out.name + ".report.json"), json.dumps(rep, indent=1) + "\n")
    return rep


def _progress_logger(total: int):
    every = max(1, total // 8)

    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == total:
            log.info("dwq step %d/%d: loss %.5f", step, total, loss)
    return report


def _refresh_index(d: Path) -> None:
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["total_size"] = sum(f.stat().st_size for f in d.glob("model*.safetensors"))
    index_path.write_text(json.dumps(index, indent=4) + "\n")


def _rescore_rows(rows: list[dict], teacher: dict, student: dict, layout) -> None:
    """The report's per-tensor RMSE / cosine, recomputed for the fitted quantized tensors."""
    import mlx.core as mx

    from hf2q.convert.mlx_writer import _error

    for r in rows:
        module = r["name"].removesuffix(".weight")
        if not r["bits"] or f"{module}.scales" not in student:
            continue
        bits, gs = layout.of(module)
        back = mx.dequantize(student[r["name"]], student[f"{module}.scales"], student[f"{module}.biases"],
                             group_size=gs, bits=bits)
        r["rmse"], r["cosine"] = _error(mx, teacher[r["name"]], back)
