"""BERT family (all-MiniLM, bge, …) → GGUF arch ``bert``: a bidirectional encoder with pooling.

The pooler and MLM heads are dropped (embeddings only), ``gamma``/``beta`` are renamed to
``weight``/``bias``, position and token-type embeddings stay F32, and the sentence-transformers
pooling mode (mean for MiniLM) becomes ``bert.pooling_type``. Tokenizer: WordPiece.
"""

from __future__ import annotations

import gguf

from hf2q.arch.base import MT, Family, Metadata
from hf2q.arch.pooling import add_pooling_type
from hf2q.formats.gguf_keys import Keys

_DROP = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


class Bert(Family):
    hf_architectures = ("BertModel", "BertForMaskedLM")
    gguf_arch = gguf.MODEL_ARCH.BERT
    tokenizer_kind = "wordpiece"
    plain_layout = True
    required_tensors = (MT.TOKEN_EMBD, MT.TOKEN_EMBD_NORM)
    block_tensors = (MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.ATTN_OUT_NORM, MT.FFN_UP, MT.FFN_DOWN,
                     MT.LAYER_OUT_NORM)

    @staticmethod
    def _canonical(hf_name: str) -> str:
        name = hf_name.removeprefix("bert.")
        if name.endswith(".gamma"):
            name = name[:-6] + ".weight"
        if name.endswith(".beta"):
            name = name[:-5] + ".bias"
        return name

    def skip(self, hf_name: str) -> bool:
        name = self._canonical(hf_name)
        return super().skip(hf_name) or name in _DROP or name.startswith(("cls.predictions", "cls.seq_relationship"))

    def map_name(self, hf_name: str) -> str:
        return super().map_name(self._canonical(hf_name))

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a = self.arch_name
        md.boolean(Keys.Attention.CAUSAL.format(arch=a), False)
        add_pooling_type(self.src, self.cfg, md, a)
