"""``--mtp`` on the Qwen 3.5 MoE checkpoint: the draft file alone, byte-identical to llama.cpp's converter.

Writing only the MTP head used to fail on the MoE layout (its per-expert decoder tensors were
looked up one to one before being left out); ``tests/test_convert_qwen35.py`` covers the dense one.
"""

from __future__ import annotations

import pytest

from tests.test_llamacpp_parity import compare_gguf, llamacpp_reference


@pytest.mark.slow
@pytest.mark.llamacpp
def test_moe_mtp_only_matches_llamacpp(tiny_checkpoint, llama_cpp_bin, tmp_path):
    from hf2q.cli import main

    src = tiny_checkpoint("qwen35moe_parity_mtp")
    out = tmp_path / "draft.gguf"
    assert main(["convert", str(src), "--quant", "q8_0", "-o", str(out), "--no-integrity", "--mtp"]) == 0
    assert compare_gguf(out, llamacpp_reference(src, "q8_0", ("--mtp",))) == []
