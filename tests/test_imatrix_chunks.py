"""``convert --imatrix-corpus … --imatrix-chunks N`` computes over the first N chunks only, the same matrix
``hf2q imatrix --chunks N`` writes (llama-imatrix's ``--chunks``)."""

from __future__ import annotations

import numpy as np

from hf2q.sources.imatrix import read_imatrix


def test_convert_chunks_equal_the_imatrix_command(cli, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3")
    kept, alone = tmp_path / "kept.imatrix.gguf", tmp_path / "alone.imatrix.gguf"
    r = cli("convert", str(src), "-q", "q4_k_m", "-o", tmp_path / "o.gguf", "--no-integrity",
            "--imatrix-corpus", "calibration", "--imatrix-n-ctx", "64", "--imatrix-chunks", "2",
            "--imatrix-out", str(kept))
    assert r.code == 0, r.err
    assert cli("imatrix", str(src), "-o", alone, "--n-ctx", "64", "--chunks", "2").code == 0
    a, b = read_imatrix(kept), read_imatrix(alone)
    assert a.chunk_count == b.chunk_count == 2
    assert a.weights.keys() == b.weights.keys()
    for name in a.weights:
        np.testing.assert_array_equal(np.asarray(a.weights[name]), np.asarray(b.weights[name]))
    assert cli("convert", str(src), "-q", "q4_k_m", "--imatrix-chunks", "2").code == 2
    assert cli("convert", str(src), "-q", "q4_k_m", "--imatrix-corpus", "calibration", "--imatrix-chunks", "0").code == 2
