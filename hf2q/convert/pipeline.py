"""HF directory → GGUF file, streamed tensor by tensor in llama.cpp's order and arithmetic.

Per tensor: rows come off the memory map in slabs → float32 → (quantized / F16 targets)
rounded to float16 exactly as llama.cpp's F16 export would store them → encoded by the codec
→ appended to ``NAME.tmp``. Peak memory is one slab and its encoding, not the model. The
file is fsynced and renamed only when every tensor is written (``hf2q.atomic``), so a failure
(bad input found late, disk full, interrupt) never leaves a partial ``NAME``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

from hf2q.arch.base import Direct, Metadata, Packed, PlannedTensor
from hf2q.arch.registry import family_class
from hf2q.atomic import atomic_output
from hf2q.convert import report as report_mod
from hf2q.convert.checkpoint_check import check_config, check_plan, check_vocabulary
from hf2q.convert.gguf_writer import GGUFStream, TensorLayout, layout
from hf2q.convert.imatrix_plan import add_metadata, tensor_weights
from hf2q.convert.imatrix_plan import describe as describe_imatrix
from hf2q.convert.policy import ModelFacts, TensorFacts, ggml_n_dims, plan_types
from hf2q.convert.quant_names import QuantName
from hf2q.convert.tier_plan import TierPlan, plan_tier
from hf2q.errors import ConversionError, InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.progress import progress_bar
from hf2q.sources.hf_config import architecture_name, load_config
from hf2q.sources.imatrix import ImatrixFile
from hf2q.sources.integrity import hash_inputs
from hf2q.sources.safetensors_reader import SafetensorsCheckpoint
from hf2q.sources.tokenizer_meta import add_tokenizer, release_tokenizer_cache

log = logging.getLogger("hf2q.convert")
T = gguf.GGMLQuantizationType
SLAB_BYTES = 32 << 20  # float32 bytes of source rows handled at once
ERROR_SAMPLE_ROWS = 256  # rows per tensor used for the RMSE / cosine report


@attrs.define
class ConversionPlan:
    src: Path
    family: Any
    checkpoint: SafetensorsCheckpoint
    quant: QuantName
    tensors: list[PlannedTensor]
    types: list[gguf.GGMLQuantizationType]
    layouts: list[TensorLayout]
    metadata: Metadata
    # per tensor: imatrix weights [n_expert, ncols] or None; empty when converting without an imatrix
    imatrix_rows: list[np.ndarray | None] = attrs.field(factory=list)
    tier: TierPlan | None = None  # the plan of a mixed-bit tier (``--quant dynamic-*|apex-*``)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.layouts)


def build_plan(src: Path, quant: QuantName, has_imatrix: bool = False, mtp: str = "keep",
               imatrix: ImatrixFile | None = None) -> ConversionPlan:
    """Everything decided before the output is written: names, types, layout, metadata.

    ``mtp``: ``keep`` the multi-token-prediction head, ``drop`` it, or write ``only`` it. A tier
    (``quant.tier``) reads a row sample of each tensor here to measure its sensitivity, with
    ``imatrix``'s weights when given."""
    src = Path(src)
    cfg = load_config(src)
    family_cls = family_class(architecture_name(cfg))
    ck = SafetensorsCheckpoint(src)
    try:
        family, tensors = plan_checked(family_cls, cfg, src, ck, mtp)
        family.check_quant(quant)
        facts = ModelFacts(family.arch_name, family.block_count, family.n_head, family.n_head_kv, family.n_expert)
        tier = None
        if quant.tier:
            types, tier = plan_tier(quant, facts, tensors, ck, imatrix)
        else:
            types = plan_types(quant, facts, [TensorFacts(t.name, t.ne, t.f32_only) for t in tensors], has_imatrix)
        types = [q if t.stored_type is None else t.stored_type for t, q in zip(tensors, types)]
        try:
            layouts = layout([(t.name, stored_ne(t.ne, quant), q) for t, q in zip(tensors, types)])
        except ValueError as e:
            raise InputError(str(e)) from None
        md = build_metadata(family, src, cfg, quant)
        check_vocabulary(md, tensors)
    except BaseException:
        ck.close()
        raise
    finally:
        release_tokenizer_cache()
    return ConversionPlan(src, family, ck, quant, tensors, types, layouts, md, tier=tier)


def plan_checked(family_cls, cfg: dict, src: Path, ck: SafetensorsCheckpoint, mtp: str = "keep"):
    """The family and its tensor plan, with the config checked against the checkpoint's headers first."""
    check_config(cfg, ck)
    family = family_cls(cfg, src, mtp=mtp)
    family.check_config()
    tensors = family.plan(ck)
    if not tensors:
        raise InputError(f"{src}: the checkpoint has no tensors")
    check_plan(family, ck, tensors)
    return family, tensors


def stored_ne(ne: list[int], quant: QuantName) -> list[int]:
    """The dimensions a tensor is written with: llama.cpp's float export keeps the checkpoint's
    axes, while ``llama-quantize`` rewrites every tensor with ``ggml_n_dims`` axes (trailing size-1
    axes dropped: Qwen 3.5's ``[1, d]`` shared-expert gate becomes 1-D)."""
    return ne if quant.is_float else ne[:ggml_n_dims(ne)]


def build_metadata(family, src: Path, cfg: dict, quant: QuantName) -> Metadata:
    md = Metadata()
    md.string(Keys.General.ARCHITECTURE, family.arch_name)
    md.string(Keys.General.TYPE, "model")
    md.string(Keys.General.NAME, cfg.get("_name_or_path") or cfg.get("_model_name_or_path") or src.name)
    family.hparams(md)
    md.u32(Keys.General.FILE_TYPE, int(family.file_type(quant)))
    md.u32(Keys.General.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)
    add_tokenizer(md, src, cfg, family.tokenizer_kind,
                  pre_fallback="qwen2" if family.arch_name.startswith("qwen") else "default")
    family.tokenizer_overrides(md)
    return md


# --------------------------------------------------------------------------- encoding
def encode(x: np.ndarray, qtype: gguf.GGMLQuantizationType, threads: int,
           imatrix: np.ndarray | None = None) -> np.ndarray:
    """float32 rows → bytes of ``qtype`` (hf2q's codecs; gguf-py's for what they lack).

    ``imatrix``: per-column importance weights for every row of ``x`` (llama.cpp's quant_weights)."""
    if qtype == T.F32:
        return np.ascontiguousarray(x, dtype="<f4")
    if qtype == T.F16:
        return np.ascontiguousarray(x.astype("<f2"))
    try:
        from hf2q.ggml import codec
    except ImportError:  # pragma: no cover — codecs not installed in this tree
        codec = None
    if codec is not None and qtype in codec.SUPPORTED:
        return codec.quantize(x, qtype, threads, imatrix=imatrix)
    if imatrix is not None:
        raise ConversionError(f"no importance-weighted quantizer for {qtype.name}")
    try:
        return gguf.quants.quantize(x, qtype)
    except (NotImplementedError, gguf.QuantError) as e:
        raise ConversionError(f"no quantizer for {qtype.name} ({e})") from None


def decode(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape) -> np.ndarray:
    try:
        from hf2q.ggml import codec
        if qtype in codec.SUPPORTED:
            return codec.dequantize(raw, qtype, shape)
    except ImportError:  # pragma: no cover
        pass
    return gguf.quants.dequantize(raw, qtype).reshape(shape)


def round_like_export(x: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """llama.cpp quantizes from its F16 export: round to float16 first (F32/BF16 targets excepted)."""
    if qtype in (T.F32, T.BF16, T.F16):
        return x
    return x.astype(np.float16).astype(np.float32)


@attrs.define
class ErrorStats:
    sq: float = 0.0
    dot: float = 0.0
    xx: float = 0.0
    yy: float = 0.0
    n: int = 0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        # elementwise sums, not BLAS dot: a BLAS thread pool spinning on a busy machine costs more
        x64, y64 = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
        d = x64 - y64
        self.sq += float(np.square(d).sum())
        self.dot += float((x64 * y64).sum())
        self.xx += float(np.square(x64).sum())
        self.yy += float(np.square(y64).sum())
        self.n += x64.size

    def result(self) -> tuple[float, float]:
        rmse = (self.sq / self.n) ** 0.5 if self.n else 0.0
        denom = (self.xx * self.yy) ** 0.5
        cos = self.dot / denom if denom > 0 else (1.0 if self.sq == 0 else 0.0)
        return rmse, cos


def _sample_rows(n_rows: int) -> np.ndarray:
    if n_rows <= ERROR_SAMPLE_ROWS:
        return np.arange(n_rows)
    return np.linspace(0, n_rows - 1, ERROR_SAMPLE_ROWS).astype(np.int64)


def _encode_rows(x: np.ndarray, qtype, pool: ThreadPoolExecutor | None, threads: int,
                 first_row: int = 0, imatrix: np.ndarray | None = None, rows_per_expert: int = 0) -> np.ndarray:
    """Round + encode a slab (rows ``first_row…`` of the tensor), split into row chunks across the
    worker pool (one codec thread each).

    ``imatrix`` is ``[n_expert, ncols]``: expert ``e`` owns tensor rows ``[e·rows_per_expert,
    (e+1)·rows_per_expert)`` and its own weights, so the slab is first cut at expert boundaries
    (llama-quantize's chunks never cross one either)."""
    if imatrix is None:
        return _encode_chunked(x, qtype, pool, threads, None)
    if rows_per_expert <= 0 or (first_row + x.shape[0] - 1) // rows_per_expert >= imatrix.shape[0]:
        raise ConversionError("internal error: tensor rows beyond the imatrix's experts")
    parts = []
    a = 0
    while a < x.shape[0]:
        e = (first_row + a) // rows_per_expert
        b = min(x.shape[0], (e + 1) * rows_per_expert - first_row)
        parts.append(_encode_chunked(x[a:b], qtype, pool, threads, imatrix[e]))
        a = b
    return np.concatenate(parts, axis=0)


def _encode_chunked(x: np.ndarray, qtype, pool: ThreadPoolExecutor | None, threads: int,
                    weights: np.ndarray | None, export_round: bool = True) -> np.ndarray:
    """``export_round``: round to F16 first as llama.cpp's export does (off for a packed source's rows)."""
    n = x.shape[0]
    prepare = (lambda v: round_like_export(v, qtype)) if export_round else (lambda v: v)
    if pool is None or threads <= 1 or n < 2 * threads or x.size < (1 << 16):
        return encode(prepare(x), qtype, 1, weights)
    bounds = np.linspace(0, n, min(n, 4 * threads) + 1).astype(int)
    parts = list(pool.map(lambda ab: encode(prepare(x[ab[0]:ab[1]]), qtype, 1, weights),
                          itertools.pairwise(bounds)))
    return np.concatenate(parts, axis=0)


def write_tensor(plan: ConversionPlan, i: int, out: GGUFStream, threads: int, timings: dict, bar,
                 pool: ThreadPoolExecutor | None = None) -> dict:
    t, qtype, lay = plan.tensors[i], plan.types[i], plan.layouts[i]
    src = t.source
    ncols = t.shape[-1]
    n_rows = src.n_rows
    weights = plan.imatrix_rows[i] if plan.imatrix_rows else None
    rows_per_expert = n_rows // weights.shape[0] if weights is not None else 0
    slab = max(1, SLAB_BYTES // (4 * ncols))
    sample = set(_sample_rows(n_rows).tolist())
    stats = ErrorStats()
    for lo in range(0, n_rows, slab):
        hi = min(n_rows, lo + slab)
        t0 = time.perf_counter()
        packed = isinstance(src, Packed)
        x = None if packed and not src.quantizes_rows else src.rows(plan.checkpoint, lo, hi)
        if x is not None and x.shape != (hi - lo, ncols):
            raise ConversionError(f"{t.name}: produced rows of shape {x.shape}, expected {(hi - lo, ncols)}")
        t1 = time.perf_counter()
        if x is None:
            q = src.packed(plan.checkpoint, lo, hi)
        elif packed:  # its own type, from its float rows as they are
            q = _encode_chunked(x, src.stored_type, pool, threads, None, export_round=False)
        else:
            q = _encode_rows(x, qtype, pool, threads, lo, weights, rows_per_expert)
        t2 = time.perf_counter()
        try:
            out.write(q)
        except OSError as e:
            raise _write_error(e, plan) from None
        if isinstance(src, Direct) and src.row_order is None:
            plan.checkpoint.release(src.name, lo, hi)
        t3 = time.perf_counter()
        picked = [r - lo for r in range(lo, hi) if r in sample]
        if picked and (x is not None or qtype != T.I32):
            # a packed source's float rows are read only for the sampled rows (integer tables have no error)
            ref = x[picked] if x is not None else \
                np.concatenate([src.rows(plan.checkpoint, lo + r, lo + r + 1) for r in picked])
            y = decode(np.ascontiguousarray(q.reshape(hi - lo, -1)[picked]), qtype, (len(picked), ncols))
            stats.add(ref, y)
        t4 = time.perf_counter()
        timings["read_s"] += t1 - t0
        timings["quantize_s"] += t2 - t1
        timings["write_s"] += t3 - t2
        timings["error_s"] += t4 - t3
        bar.advance((hi - lo) * ncols)
    for name in src.source_names:
        plan.checkpoint.release(name)
    rmse, cos = stats.result()
    return {"name": t.name, "shape": list(lay.ne), "type": qtype.name, "bytes": lay.nbytes,
            "sources": list(src.source_names), "rmse": rmse, "cosine": cos}


def _write_error(e: OSError, plan: ConversionPlan) -> ConversionError:
    if e.errno == errno.ENOSPC:
        return ConversionError(f"disk full while writing the GGUF ({plan.total_bytes / 2**20:.1f} MiB needed)")
    return ConversionError(f"cannot write the GGUF: {e.strerror or e}")


def convert_gguf(src: Path, output: Path, quant: QuantName, threads: int | None = None,
                 integrity: bool = True, report_path: Path | None = None,
                 has_imatrix: bool = False, imatrix: ImatrixFile | None = None,
                 imatrix_arg: str | None = None, mtp: str = "keep") -> dict:
    """Convert and return the report dict (also written to ``report_path``).

    ``imatrix`` (read once by the caller) weights every quantized tensor it has an entry for, as
    ``llama-quantize --imatrix imatrix_arg`` does, and is recorded in the file's metadata."""
    has_imatrix = has_imatrix or imatrix is not None
    threads = threads or os.cpu_count() or 1
    timings = {"plan_s": 0.0, "hash_s": 0.0, "read_s": 0.0, "quantize_s": 0.0, "write_s": 0.0,
               "error_s": 0.0, "total_s": 0.0}
    t_start = time.perf_counter()
    plan = build_plan(src, quant, has_imatrix, mtp, imatrix)
    timings["plan_s"] = time.perf_counter() - t_start
    output = Path(output)
    try:
        if imatrix is not None:
            plan.imatrix_rows = tensor_weights(imatrix, plan.tensors, plan.types, quant.ftype)
            add_metadata(plan.metadata, imatrix, imatrix_arg or str(imatrix.path))
        _check_output_dir(output)
        # hashing overlaps the conversion (hashlib releases the GIL on large buffers)
        hasher = _BackgroundHash(plan) if integrity else None
        rows = []
        total_elems = sum(t.n_elements for t in plan.tensors)
        try:
            with atomic_output(output) as f, progress_bar(f"convert → {quant.name}", total_elems) as bar:
                stream = GGUFStream(f, plan.metadata.entries, plan.layouts)
                plan.metadata.entries.clear()  # the vocabulary is written; free its strings
                with ThreadPoolExecutor(max_workers=threads) as pool:
                    for i in range(len(plan.tensors)):
                        rows.append(write_tensor(plan, i, stream, threads, timings, bar, pool))
                if not stream.finished():
                    raise ConversionError("internal error: not every tensor was written")
                hashes = hasher.result(timings) if hasher else {}
        except OSError as e:
            raise _write_error(e, plan) from None
    finally:
        plan.checkpoint.close()
    timings["total_s"] = time.perf_counter() - t_start
    rep = report_mod.build(plan, output, hashes, rows, timings, threads)
    if imatrix is not None:
        rep["imatrix"] = describe_imatrix(imatrix)
    if plan.tier is not None:
        rep["tier"] = plan.tier.report()
    report_mod.write(rep, report_path or report_mod.default_path(output))
    return rep


class _BackgroundHash:
    """sha256 of the inputs on a worker thread while tensors are converted."""

    def __init__(self, plan: ConversionPlan):
        import threading

        self._result: dict[str, str] = {}
        self._error: BaseException | None = None
        self._elapsed = 0.0
        self._thread = threading.Thread(target=self._run, args=(plan.src, list(plan.checkpoint.files)),
                                        name="hf2q-hash", daemon=True)
        self._thread.start()

    def _run(self, src, files) -> None:
        t0 = time.perf_counter()
        try:
            self._result = hash_inputs(src, files)
        except BaseException as e:  # noqa: BLE001 — re-raised in the caller's thread
            self._error = e
        self._elapsed = time.perf_counter() - t0

    def result(self, timings: dict) -> dict[str, str]:
        self._thread.join()
        timings["hash_s"] = self._elapsed
        if self._error is not None:
            if isinstance(self._error, OSError):
                raise InputError(f"cannot read an input file for hashing: {self._error}")
            raise self._error
        return self._result


def _check_output_dir(output: Path) -> None:
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir():
        raise ConversionError(f"cannot write {output}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConversionError(f"cannot write {output}: directory {parent} is not writable")
    if output.is_dir():
        raise ConversionError(f"cannot write {output}: it is a directory")


def dry_run(src: Path, quant: QuantName, has_imatrix: bool = False, mtp: str = "keep",
            imatrix: ImatrixFile | None = None) -> list[str]:
    """The tensor → type → bits/weight → bytes plan as printable lines (no file is written);
    for a tier, each planned tensor's role, layer band and (dynamic) weight and measured error."""
    plan = build_plan(src, quant, has_imatrix or imatrix is not None, mtp, imatrix)
    try:
        width = max(len(t.name) for t in plan.tensors)
        lines = [f"{'tensor':<{width}}  {'shape':<20} {'type':<5} {'bpw':>6} {'bytes':>12}"
                 + ("  why" if plan.tier else "")]
        n_elem = 0
        whys = plan.tier.descriptions() if plan.tier else {}
        for t, q, lay in zip(plan.tensors, plan.types, plan.layouts):
            shape = "[" + ", ".join(str(d) for d in lay.ne) + "]"
            bpw = 8 * lay.nbytes / max(1, t.n_elements)
            why = f"  {whys.get(t.name, '')}" if plan.tier else ""
            lines.append(f"{t.name:<{width}}  {shape:<20} {q.name:<5} {bpw:>6.2f} {lay.nbytes:>12}{why}".rstrip())
            n_elem += t.n_elements
        total = plan.total_bytes
        lines.append(f"total: {len(plan.tensors)} tensors, {total} bytes ({total / 2**20:.2f} MiB, "
                     f"{8 * total / max(1, n_elem):.2f} bits/weight) — {plan.family.arch_name} {quant.name}")
        if plan.tier is not None and plan.tier.budget_bytes is not None:
            lines.append(f"tier {quant.name}: {plan.tier.planned_bytes()} of {plan.tier.budget_bytes} budget bytes "
                         f"({plan.tier.reference or 'the APEX table'}'s quantized tensors), "
                         f"{'imatrix-weighted' if plan.tier.imatrix_weighted else 'unweighted'} errors")
        if summary := plan.family.layer_summary():
            lines.append(f"{plan.family.arch_name}: " + ", ".join(f"{k.replace('_', ' ')} {v}"
                                                                  for k, v in summary.items()))
        return lines
    finally:
        plan.checkpoint.close()
