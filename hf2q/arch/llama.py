"""Llama family (Llama 2/3, SmolLM2, Mistral-style dense models) → GGUF arch ``llama``.

Llama-style checkpoints store Q/K in HF's rotate-half layout; llama.cpp's rope kernel
expects the interleaved layout, so the Q and K rows (and biases) are permuted exactly as
llama.cpp's converter does. Tokenizer: SentencePiece when ``tokenizer.model`` exists,
otherwise the GPT-2-style BPE of ``tokenizer.json``.

Llama 3.x checkpoints (``rope_type: llama3``) get the extra ``rope_freqs.weight`` tensor
llama.cpp's converter generates: one divisor per rotary pair (1 for short wavelengths,
``factor`` for long ones, a smooth blend between), by which llama.cpp's rope divides each
pair's angle. No ``rope.scaling.*`` key is written for it, as in llama.cpp.
"""

from __future__ import annotations

import json
import math

import attrs
import gguf
import numpy as np

from hf2q.arch.base import MT, Direct, Family, Metadata, RowSource, permute_rows
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.sources.hf_config import require

ROPE_FREQS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"


@attrs.define
class Generated(RowSource):
    """A tensor computed from the config rather than read from the checkpoint (``rope_freqs``)."""

    values: np.ndarray
    shape: tuple[int, ...]

    @property
    def source_names(self) -> tuple[str, ...]:
        return ()

    def rows(self, ck, lo, hi):
        return np.ascontiguousarray(self.values.reshape(-1, self.shape[-1])[lo:hi], dtype=np.float32)


def llama3_rope_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-pair divisors of Llama 3 rope scaling, in float32 step by step like llama.cpp's converter.

    A pair whose wavelength (tokens per turn) is below ``original_max_position_embeddings /
    high_freq_factor`` keeps its frequency (1); above ``… / low_freq_factor`` it is slowed by
    ``factor``; in between the inverse divisor moves linearly in ``context / wavelength`` from
    ``1/factor`` to 1 — the rule of transformers' ``_compute_llama3_parameters``.
    """
    f32 = np.float32
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 8.0))
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    n_orig = float(rope.get("original_max_position_embeddings", 8192))
    if high <= low:
        raise InputError(f"config.json: llama3 rope scaling needs high_freq_factor ({high:g}) above "
                         f"low_freq_factor ({low:g})")
    inv_freq = f32(1.0) / (f32(base) ** (np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)))
    out = np.empty(inv_freq.shape, dtype=f32)
    for i, freq in enumerate(inv_freq):
        wavelen = f32(2.0 * math.pi) / freq
        if wavelen < n_orig / high:
            out[i] = 1.0
        elif wavelen > n_orig / low:
            out[i] = factor
        else:
            smooth = (f32(n_orig) / wavelen - f32(low)) / f32(high - low)
            out[i] = f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth)
    return out


class Llama(Family):
    hf_architectures = ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM", "LlamaModel")
    gguf_arch = gguf.MODEL_ARCH.LLAMA
    tokenizer_kind = "auto"
    plain_layout = True
    block_tensors = (MT.ATTN_NORM, MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.FFN_NORM, MT.FFN_GATE, MT.FFN_UP,
                     MT.FFN_DOWN)

    def check_config(self) -> None:
        super().check_config()
        if self.head_dim % 2:  # the Q/K permutation pairs rows within each head
            raise InputError(f"config.json: head_dim {self.head_dim} is odd; rotary embeddings need an even one")

    def source_tensor(self, ck, hf_name, gguf_name):
        shape = ck.entry(hf_name).shape
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return Direct(hf_name, shape, row_order=permute_rows(shape[0], self.n_head))
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return Direct(hf_name, shape, row_order=permute_rows(shape[0], self.n_head_kv))
        return Direct(hf_name, shape)

    def collect(self, ck):
        yield from super().collect(ck)
        rope = self.rope_parameters()
        rope = rope.get("full_attention", rope)
        if str(rope.get("rope_type") or "").lower() == "llama3":
            values = llama3_rope_divisors(rope, self.head_dim)
            yield ROPE_FREQS, ROPE_FREQS, Generated(values, values.shape)

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a = self.arch_name
        md.u32(Keys.LLM.VOCAB_SIZE.format(arch=a), require(self.cfg, "vocab_size"))
        md.u32(Keys.Rope.DIMENSION_COUNT.format(arch=a), self.head_dim)

    def tokenizer_overrides(self, md: Metadata) -> None:
        tc = self.src / "tokenizer_config.json"
        if tc.is_file():
            try:
                prefix = json.loads(tc.read_text(encoding="utf-8")).get("add_prefix_space")
            except ValueError:
                prefix = None
            if prefix is not None:
                md.boolean(Keys.Tokenizer.ADD_PREFIX, prefix)
        # llama.cpp's converter turns BOS off for 49152-token vocabularies (Granite / SmolLM)
        if self.cfg.get("vocab_size", 32000) == 49152:
            md.boolean(Keys.Tokenizer.ADD_BOS, False)
