"""Our GGUF header parser against the ``gguf`` package's reader on a real file."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader

from hf2q.formats.gguf_file import open_gguf


def test_parser_matches_gguf_reader(smollm2_gguf):
    reader = GGUFReader(smollm2_gguf)
    g = open_gguf(smollm2_gguf)
    assert set(g.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        ours = g.tensors[t.name]
        assert ours.qtype == t.tensor_type
        assert ours.shape == tuple(reversed([int(x) for x in t.shape]))
        assert ours.nbytes == int(t.n_bytes)
        assert np.array_equal(np.asarray(ours.data).view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel())
    for key, field in reader.fields.items():
        want = field.contents()
        got = g.metadata[key]
        if isinstance(want, float):
            assert abs(got - want) < 1e-9, key
        else:
            assert got == want, key
    assert g.arch == "llama" and g.get(".block_count") == 30
