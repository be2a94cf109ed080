"""``--quant dwq-q4_1|dwq-q5_1`` with an importance matrix: the student is read back from the staging file,
so with ``--imatrix`` it starts from the imatrix-weighted plain blocks — bytes equal to our llama.cpp-identical
quantizer's output with those weights, and not the unweighted ones — and without one from the same blocks as
quantizing the source again; the fit lowers its training loss from that start; ``--imatrix-corpus`` writes the
plain ``q4_1 --imatrix`` file with only fitted blocks changed."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from hf2q.convert import dwq_blocks

T = gguf.GGMLQuantizationType


def _synthetic_imatrix(plain, path):
    """Heavy-tailed column weights for every ``blk.*`` matrix of the tiny model (as llama-imatrix's sums)."""
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.sources.imatrix import write_imatrix

    rng = np.random.default_rng(7)
    entries = {}
    for t in open_gguf(plain).tensors.values():
        if t.name.startswith("blk.") and len(t.shape) == 2:
            ncols = int(t.shape[1])
            entries[t.name] = (rng.gamma(0.5, 30.0, (1, ncols)).astype(np.float32), np.array([500.0], np.float32))
    return write_imatrix(path, entries, datasets=("synthetic.txt",), chunk_count=3, chunk_size=512)


@pytest.fixture(scope="module")
def staged(tiny_checkpoint, tmp_path_factory):
    """The tiny llama's plain q4_1 conversion without and with a synthetic imatrix (the staging files DWQ
    reads), the plans and the float32 teacher."""
    from hf2q.convert import mlx_policy
    from hf2q.convert.dwq_convert import _teacher
    from hf2q.convert.pipeline import build_plan, convert_gguf
    from hf2q.convert.quant_names import GGUF_QUANTS
    from hf2q.sources.imatrix import read_imatrix

    d = tmp_path_factory.mktemp("dwq-imatrix")
    src = tiny_checkpoint("llama")
    q = GGUF_QUANTS["q4_1"]
    plain = d / "plain.gguf"
    convert_gguf(src, plain, q, 1, False, report_path=d / "plain.json")
    im = read_imatrix(_synthetic_imatrix(plain, d / "syn.imatrix.gguf"))
    weighted = d / "weighted.gguf"
    convert_gguf(src, weighted, q, 1, False, report_path=d / "weighted.json", imatrix=im, imatrix_arg="syn")
    cfg, t_mx = _teacher(src, mlx_policy.MlxQuant("mlx-4", 4), 32)
    return {"src": src, "dir": d, "imatrix": im, "teacher_mx": t_mx,
            "teacher": {k: np.asarray(v) for k, v in t_mx.items()},
            "files": {None: plain, "imatrix": weighted},
            "plans": {None: build_plan(src, q), "imatrix": build_plan(src, q, has_imatrix=True, imatrix=im)}}


def _student(staged, which):
    from hf2q.convert.dwq_gguf import _Student

    return _Student(staged["plans"][which], staged["files"][which], staged["teacher"], T.Q4_1)


def _blocks(student, module: str) -> dwq_blocks.AffineBlocks:
    a = student.arrays
    return dwq_blocks.AffineBlocks(a[f"{module}.scales"], a[f"{module}.biases"], a[f"{module}.weight"])


def test_student_is_the_staging_files_blocks(staged):
    """Read back, each fitted module is our quantizer's blocks of the source in HF row order — with the
    imatrix's column weights for the weighted file, which differ from the unweighted ones — and every frozen
    matrix the decoded quantization of its type, as quantizing the source again gives."""
    from hf2q.convert.imatrix_plan import tensor_weights
    from hf2q.convert.pipeline import decode, encode, round_like_export
    from hf2q.convert.quant_names import GGUF_QUANTS
    from hf2q.ggml import codec

    plan, teacher = staged["plans"][None], staged["teacher"]
    plain, weighted = _student(staged, None), _student(staged, "imatrix")
    assert {m: n for m, (n, _) in plain.fitted.items()} == {m: n for m, (n, _) in weighted.fitted.items()}
    assert len(plain.fitted) >= 7
    rows = tensor_weights(staged["imatrix"], plan.tensors, plan.types, GGUF_QUANTS["q4_1"].ftype)
    for t, qt, w in zip(plan.tensors, plan.types, rows):
        name = t.source.name
        module = name.removesuffix(".weight")
        x = round_like_export(teacher[name].astype(np.float32), qt)
        if x.ndim == 1 or qt == T.F32:
            for s in (plain, weighted):
                np.testing.assert_array_equal(s.arrays[name], teacher[name])
        elif module in plain.fitted:
            assert w is not None, name
            want = {None: codec.quantize(x, qt, 1), "imatrix": codec.quantize(x, qt, 1, imatrix=w[0])}
            assert not np.array_equal(want[None], want["imatrix"]), name  # the weights change the start
            for which, s in ((None, plain), ("imatrix", weighted)):
                assert np.array_equal(dwq_blocks.pack(_blocks(s, module), qt), want[which]), (which, name)
        else:
            y = decode(encode(x, qt, 1), qt, x.shape)
            for s in (plain, weighted):
                np.testing.assert_array_equal(s.arrays[name], y)


def test_fit_from_the_imatrix_start_lowers_its_training_loss(staged):
    """Sixteen Adam steps over four training rows: their mean KL falls well below the imatrix start's."""
    import mlx.core as mx

    from hf2q.convert.dwq_fit import Distiller, DwqSettings, split_tokens
    from hf2q.convert.dwq_forward import QuantLayout, decoder
    from hf2q.convert.dwq_matmul import default_linear
    from hf2q.convert.dwq_convert import calibration_tokens
    from hf2q.quality.corpus import load_corpus
    from hf2q.sources.hf_config import load_config

    student = _student(staged, "imatrix")
    src = staged["src"]

    corpus = staged["dir"] / "c.txt"
    corpus.write_text(load_corpus("calibration").text[:2000], encoding="utf-8")
    _, tokens = calibration_tokens(src, str(corpus))
    train, _ = split_tokens(tokens, 16)
    train = train[:4]
    d = Distiller(decoder(load_config(src)), staged["teacher_mx"], student.mx_arrays(),
                  QuantLayout(4, 32), default_linear)
    start = {m: np.asarray(s) for m, (s, _) in d.start.items()}
    for m, s in start.items():  # the start is the imatrix file's scales, not a fresh quantization's
        np.testing.assert_array_equal(s, student.arrays[f"{m}.scales"].astype(np.float32))
    target = d.teacher_log_probs(train)
    before = d.score(train, target).kl_mean
    d.fit(train, DwqSettings(steps=16, lr=1e-3, seq_len=16))
    after = d.score(train, target).kl_mean
    assert after < 0.7 * before, (before, after)
    fitted = d.fitted()
    assert all(fitted[k].dtype == mx.float16 for k in fitted)


def test_imatrix_corpus_writes_the_weighted_plain_file_with_fitted_blocks(staged, cli):
    """``--imatrix-corpus`` (kept with ``--imatrix-out``): the output has the same tensors, offsets and
    metadata (``quantize.imatrix.*`` included) as ``--quant q4_1 --imatrix`` of that matrix; only Q4_1 blocks
    differ — none where the start's held-out KL beat the fit's, as it does here — and the report says where
    the fit started and which blocks it wrote."""
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.formats.gguf_parse import parse
    from hf2q.quality.corpus import load_corpus

    d = staged["dir"]
    corpus = d / "im.txt"
    corpus.write_text(load_corpus("calibration").text[:3000], encoding="utf-8")
    im, dwq, plain = d / "computed.imatrix.gguf", d / "dwq.gguf", d / "plain-im.gguf"
    r = cli("convert", staged["src"], "-q", "dwq-q4_1", "-o", dwq, "--no-integrity", "--dwq-steps", "2",
            "--dwq-seq-len", "16", "--dwq-lr", "1e-2", "--dwq-corpus", corpus, "--imatrix-corpus", corpus,
            "--imatrix-n-ctx", "128", "--imatrix-out", im)
    assert r.code == 0, r.err
    assert cli("convert", staged["src"], "-q", "q4_1", "-o", plain, "--no-integrity", "--imatrix", im).code == 0
    (meta_p, infos_p, _, mm_p), (meta_d, infos_d, _, mm_d) = parse(plain), parse(dwq)
    assert meta_p == meta_d and meta_p[gguf.Keys.General.FILE_TYPE] == gguf.LlamaFileType.MOSTLY_Q4_1
    assert meta_p["quantize.imatrix.file"] == str(im)
    assert infos_p == infos_d and plain.stat().st_size == dwq.stat().st_size
    a, b = open_gguf(plain).tensors, open_gguf(dwq).tensors
    changed = {k for k in a if not np.array_equal(a[k].data, b[k].data)}
    del mm_p, mm_d
    rep = json.loads((d / "dwq.gguf.report.json").read_text())
    w = rep["dwq"]
    kl = {c: w[k]["kl_mean"] for c, k in (("trained", "heldout_after"), ("re-rounded", "heldout_rerounded"),
                                           ("start", "heldout_before"))}
    assert w["heldout_written"]["kl_mean"] == min(kl.values()) == kl[w["codes"]]
    if w["codes"] == "start":
        assert changed == set() and plain.read_bytes() == dwq.read_bytes()
    else:
        assert changed and changed <= {k for k, t in a.items() if t.qtype == T.Q4_1}
    assert rep["dwq"]["start"] == "q4_1, imatrix-weighted" and rep["imatrix"]["file"] == str(im)
