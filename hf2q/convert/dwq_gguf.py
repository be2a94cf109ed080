"""``hf2q convert --quant dwq-q4_1|dwq-q5_1``: a plain Q4_1 / Q5_1 GGUF whose block scales and mins are distilled.

The plain conversion (``--quant q4_1`` / ``q5_1``, llama-quantize's bytes; with ``--imatrix`` or
``--imatrix-corpus`` its imatrix-weighted bytes) is written first to a staging file beside the output.
The student is read back from that file's blocks, in the HF tensor names and row order the DWQ forward
(``dwq_forward``) runs: every tensor of the target type that the forward multiplies by becomes an affine
module (codes, float16 ``d`` as scales, float16 ``m`` as biases, group 32), every other tensor its decoded
GGUF value, frozen. ``dwq_fit`` trains the scales and biases against the float32 teacher with
the codes frozen. Two files are then possible: the fitted pairs over the codes they were trained with,
or over the source's codes re-rounded against them (``dwq_blocks.reround``, the nearest code for each
weight); both are scored on the held-out text and the lower KL is written, as the blocks' ``d``/``m``
and codes, in place over the staging file's tensor data — same types, same offsets, same metadata —
which is then moved onto the output. Where neither beats the start's held-out KL the plain file is
written as it is.

Why only these two types: docs/QUALITY.md, "DWQ" (the other GGUF types have no float16 min, or store
their per-32 scales too coarsely to hold the fit).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import gguf
import numpy as np

from hf2q.atomic import atomic_write_text
from hf2q.convert import dwq_blocks
from hf2q.convert.dwq_fit import DwqSettings, distill, split_tokens
from hf2q.errors import ConversionError, InputError, UsageError

log = logging.getLogger("hf2q.convert.dwq")
T = gguf.GGMLQuantizationType

#: ``--quant`` name → the GGML block type it writes (and the plain quant it starts from)
GGUF_DWQ = {"dwq-q4_1": ("q4_1", T.Q4_1), "dwq-q5_1": ("q5_1", T.Q5_1)}
GROUP = 32
EMBED = "model.embed_tokens.weight"  # read by row lookup, not a product: kept frozen


def parse_gguf_dwq(name: str) -> str:
    """The canonical ``dwq-q4_1`` / ``dwq-q5_1``; InputError naming them for any other ``dwq-q*``."""
    key = name.strip().lower()
    if key in GGUF_DWQ:
        return key
    raise InputError(f"--quant {name}: DWQ for GGUF writes q4_1 or q5_1 blocks only (dwq-q4_1, dwq-q5_1): "
                     "their float16 scale and min per 32 weights hold the fitted values, the K-quants' "
                     "6-bit scale codes are too coarse and q4_0/q5_0/q8_0 have no min")


def convert_dwq_gguf(args: argparse.Namespace, default_output) -> int:
    """CLI entry for ``--quant dwq-q4_1|dwq-q5_1`` (``hf2q.convert.command`` dispatches here, with its
    ``default_output(src, quant)`` naming rule)."""
    from hf2q.convert.dwq_convert import report_arg, settings_from_args, summary
    from hf2q.convert.pipeline import dry_run
    from hf2q.convert.quant_names import GGUF_QUANTS

    name = parse_gguf_dwq(args.quant)
    if getattr(args, "quality", False):
        raise UsageError(f"--quality is not run by --quant {name}: score the output with "
                         "hf2q quality OUT --reference SRC")
    if getattr(args, "repo", None) or not getattr(args, "src", None):
        raise UsageError(f"--quant {name} needs SRC, a local HF model directory")
    settings = settings_from_args(args)
    src = Path(args.src)
    plain = GGUF_QUANTS[GGUF_DWQ[name][0]]
    from hf2q.convert.imatrix_corpus import early_imatrix, final_imatrix

    imatrix = early_imatrix(args)  # a bad file or a missing corpus stops here (exit 3), before any work
    if getattr(args, "dry_run", False):
        wants = imatrix is not None or bool(getattr(args, "imatrix_corpus", None))
        for line in dry_run(src, plain, has_imatrix=wants, imatrix=imatrix):
            print(line)
        return 0
    out = Path(args.output) if args.output else default_output(src, name)
    imatrix, imatrix_arg = final_imatrix(src, args, out, imatrix)
    rep = write_dwq_gguf(src, out, name, settings, getattr(args, "dwq_corpus", None), threads=args.threads,
                         integrity=not getattr(args, "no_integrity", False), report_path=report_arg(args),
                         imatrix=imatrix, imatrix_arg=imatrix_arg)
    print(summary(str(out), rep))
    return 0


class _Student:
    """The plain conversion's model as DWQ arrays (HF names and row order), and how to write a fit back.

    Every array is read back from the staging file's blocks rather than quantized again, so the start is
    whatever that file holds — with ``--imatrix``, llama-quantize's imatrix-weighted blocks.
    """

    def __init__(self, plan, staging: Path, teacher: dict, qtype):
        from hf2q.arch.base import Direct
        from hf2q.convert.pipeline import decode

        self.qtype = qtype
        self.arrays: dict[str, np.ndarray] = {}
        self.fitted: dict[str, tuple[str, np.ndarray | None]] = {}  # HF module → (GGUF name, row order)
        held = _file_tensors(staging)
        for t, qt in zip(plan.tensors, plan.types):
            src = t.source
            if not isinstance(src, Direct) or src.add or src.name not in teacher:
                raise InputError(f"DWQ for GGUF cannot follow {t.name}: it is not a plain copy of one HF tensor")
            shape = tuple(np.shape(teacher[src.name]))
            file_type, raw = held[t.name]
            if file_type != qt:
                raise ConversionError(f"internal error: {t.name} is {file_type.name} in the staging file, "
                                      f"{qt.name} in the plan")
            # GGUF row r is HF row row_order[r]: the inverse permutation puts the rows back in HF order
            back = None if src.row_order is None or len(shape) < 2 else np.argsort(src.row_order)
            if qt == qtype and src.name != EMBED and src.name.endswith(".weight"):
                module = src.name.removesuffix(".weight")
                b = dwq_blocks.unpack(raw, qt, shape)
                b = b if back is None else b.take_rows(back)
                self.arrays[src.name] = b.q
                self.arrays[f"{module}.scales"], self.arrays[f"{module}.biases"] = b.d, b.m
                self.fitted[module] = (t.name, src.row_order)
            else:
                x = decode(raw, qt, shape).astype(np.float32)
                self.arrays[src.name] = x if back is None else x[back]
        if not self.fitted:
            raise InputError(f"no tensor of this model is planned as {qtype.name}: nothing for DWQ to fit")

    def mx_arrays(self) -> dict:
        import mlx.core as mx

        return {k: mx.array(v) for k, v in self.arrays.items()}

    def _pair(self, fitted: dict, module: str) -> tuple[np.ndarray, np.ndarray]:
        return (np.asarray(fitted[f"{module}.scales"]).astype(np.float16),
                np.asarray(fitted[f"{module}.biases"]).astype(np.float16))

    def trained(self, fitted: dict) -> dict[str, dwq_blocks.AffineBlocks]:
        """HF module → the fitted d/m over the codes the fit was trained with (the plain file's)."""
        return {module: dwq_blocks.AffineBlocks(*self._pair(fitted, module), self.arrays[f"{module}.weight"])
                for module in self.fitted}

    def rerounded(self, teacher: dict, fitted: dict) -> dict[str, dwq_blocks.AffineBlocks]:
        """HF module → the fitted d/m with the source's codes re-rounded against them."""
        from hf2q.convert.pipeline import round_like_export

        out = {}
        for module in self.fitted:
            x = round_like_export(np.asarray(teacher[f"{module}.weight"], dtype=np.float32), self.qtype)
            out[module] = dwq_blocks.reround(x, *self._pair(fitted, module), self.qtype)
        return out

    def as_student(self, blocks: dict[str, dwq_blocks.AffineBlocks]) -> dict:
        import mlx.core as mx

        arrays = dict(self.arrays)
        for module, b in blocks.items():
            arrays[f"{module}.weight"], arrays[f"{module}.scales"], arrays[f"{module}.biases"] = b.q, b.d, b.m
        return {k: mx.array(v) for k, v in arrays.items()}


def _file_tensors(path: Path) -> dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]]:
    """GGUF name → (type, its data as stored: a view of the file's memory map, no copy), read with hf2q's
    header parser (gguf-py's reader decodes every vocabulary entry into Python objects first). The map
    closes once the views are dropped, before ``_patch`` writes the file."""
    from hf2q.formats.gguf_file import open_gguf

    return {t.name: (t.qtype, t.data) for t in open_gguf(path).tensors.values()}


def _patch(path: Path, student: _Student, blocks: dict[str, dwq_blocks.AffineBlocks]) -> None:
    """Overwrite each fitted tensor's data in the GGUF at ``path`` with its new blocks (GGUF row order)."""
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.formats.gguf_parse import parse

    sizes = {t.name: t.nbytes for t in open_gguf(path).tensors.values()}
    _, infos, _, mm = parse(path)
    del mm  # its memory map must close before the file is written
    where = {name: (offset, sizes[name]) for name, _, _, offset in infos}
    with open(path, "r+b") as f:
        for module, b in blocks.items():
            name, order = student.fitted[module]
            raw = dwq_blocks.pack(b if order is None else b.take_rows(order), student.qtype)
            offset, size = where[name]
            if raw.nbytes != size:
                raise ConversionError(f"internal error: {name} is {size} bytes in the file, {raw.nbytes} fitted")
            f.seek(offset)
            f.write(raw.tobytes())


#: which blocks are written → the held-out scores they had
WRITTEN_SCORES = {"trained": "heldout_after", "re-rounded": "heldout_rerounded", "start": "heldout_before"}


def _written_codes(section: dict, keep_better_start: bool = True) -> str:
    """The blocks with the lowest held-out KL: the fitted pairs over the codes they were trained with, over
    re-rounded codes, or — when neither beats it — the plain file's own blocks, left as they are (an
    imatrix-weighted start can already be closer to the teacher than a short fit gets)."""
    kl = {codes: section[key]["kl_mean"] for codes, key in WRITTEN_SCORES.items()}
    choices = ("trained", "re-rounded", "start") if keep_better_start else ("trained", "re-rounded")
    return min(choices, key=lambda c: (kl[c], c != "start"))


def write_dwq_gguf(src: Path, out: Path, name: str, settings: DwqSettings, corpus: str | None = None,
                   threads: int | None = None, integrity: bool = True, report_path: Path | None = None,
                   make_linear=None, imatrix=None, imatrix_arg: str | None = None,
                   keep_better_start: bool = True) -> dict:
    """Write the DWQ-fitted GGUF ``out``; returns the report (also written to disk).

    ``imatrix`` (an ``ImatrixFile``, named ``imatrix_arg`` in the metadata) weights the plain conversion the
    fit starts from, as ``--quant q4_1 --imatrix`` does; the fit itself still learns from calibration text.
    ``keep_better_start=False`` writes the better fitted variant even where the start scored better on the
    held-out text (to see what the fit did)."""
    from hf2q.engine.factory import prepare_mlx

    prepare_mlx()  # OpenBLAS for the fit's products, loaded before MLX (docs/ENGINE.md, "CPU backend")
    from hf2q.convert import mlx_policy
    from hf2q.convert.dwq_convert import _progress_logger, _teacher, calibration_tokens
    from hf2q.convert.dwq_forward import QuantLayout, decoder
    from hf2q.convert.dwq_matmul import default_linear
    from hf2q.convert.pipeline import ErrorStats, build_plan, convert_gguf
    from hf2q.convert.quant_names import GGUF_QUANTS
    from hf2q.sources.hf_config import load_config

    t_start = time.perf_counter()
    src, out = Path(src), Path(out)
    plain_name, qtype = GGUF_DWQ[name]
    threads = threads or os.cpu_count() or 1
    dec = decoder(load_config(src))  # refuse an unsupported family before any work
    corpus_name, tokens = calibration_tokens(src, corpus)
    split_tokens(tokens, settings.seq_len)  # a too-short corpus fails here, not after the base conversion
    staging = out.with_name(out.name + ".dwq-base")
    base_report = out.with_name(out.name + ".dwq-base.report.json")
    try:
        rep = convert_gguf(src, staging, GGUF_QUANTS[plain_name], threads, integrity, report_path=base_report,
                           imatrix=imatrix, imatrix_arg=imatrix_arg)
        base_report.unlink(missing_ok=True)
        _, teacher_mx = _teacher(src, mlx_policy.MlxQuant("mlx-4", 4), GROUP)
        teacher = {k: np.asarray(v) for k, v in teacher_mx.items()}
        plan = build_plan(src, GGUF_QUANTS[plain_name], has_imatrix=imatrix is not None, imatrix=imatrix)
        try:
            student = _Student(plan, staging, teacher, qtype)
        finally:
            plan.checkpoint.close()
        layout = QuantLayout(dwq_blocks.BITS[qtype], GROUP)
        t0 = time.perf_counter()
        rerounded_blocks = {}  # built once: scored as a variant, written if it wins

        def rerounded_student(f):
            rerounded_blocks.update(student.rerounded(teacher, f))
            return student.as_student(rerounded_blocks)

        fitted, section = distill(
            dec, teacher_mx, student.mx_arrays(), layout, tokens, settings, make_linear or default_linear,
            _progress_logger(settings.steps), variants={"rerounded": rerounded_student})
        dwq_s = time.perf_counter() - t0
        codes = _written_codes(section, keep_better_start)
        blocks = {"trained": student.trained(fitted), "re-rounded": rerounded_blocks, "start": {}}[codes]
        if blocks:  # "start": the staging file is the plain file, as it stands
            _patch(staging, student, blocks)
        section.update(corpus=corpus_name, codes=codes, heldout_written=section[WRITTEN_SCORES[codes]],
                       fitted_tensors=len(blocks), block_type=qtype.name,
                       start=f"{plain_name}, imatrix-weighted" if imatrix is not None else plain_name)
        by_gguf = {student.fitted[m][0]: b for m, b in blocks.items()}
        for r in rep["tensors"]:
            if r["name"] in by_gguf:
                stats = ErrorStats()
                stats.add(teacher[r["sources"][0]], by_gguf[r["name"]].weights())
                r["rmse"], r["cosine"] = stats.result()
        os.replace(staging, out)
    except BaseException:
        staging.unlink(missing_ok=True)
        base_report.unlink(missing_ok=True)
        raise
    rep.update({"output": str(out), "quant": name, "dwq": section, "output_bytes": out.stat().st_size})
    rep["timings_s"]["dwq_s"] = round(dwq_s, 4)
    rep["timings_s"]["total_s"] = round(time.perf_counter() - t_start, 4)
    atomic_write_text(report_path or out.with_name(out.name + ".report.json"), json.dumps(rep, indent=1) + "\n")
    return rep
