"""BERT family (all-MiniLM, bge, …) → GGUF arch ``bert``: a bidirectional encoder with pooling.

The pooler and MLM heads are dropped (embeddings only), ``gamma``/``beta`` are renamed to
``weight``/``bias``, position and token-type embeddings stay F32, and the sentence-transformers
pooling mode (mean for MiniLM) becomes ``bert.pooling_type``. Tokenizer: WordPiece.
Nomic-BERT (``nomic-bert``) is the same encoder with rotary positions, fused QKV and a gated MLP;
its v2 (``nomic-bert-moe``) has biases, a GELU MLP, an expert mixture every other layer and an XLM-R
Unigram tokenizer.
"""

from __future__ import annotations

import gguf

from hf2q.arch.base import MT, Direct, ExpertColumns, Family, Metadata, RowSource
from hf2q.arch.pooling import add_pooling_type
from hf2q.errors import InputError
from hf2q.formats.gguf_keys import Keys
from hf2q.sources.hf_config import require

_DROP = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


class Bert(Family):
    hf_architectures = ("BertModel", "BertForMaskedLM")
    gguf_arch = gguf.MODEL_ARCH.BERT
    tokenizer_kind = "wordpiece"
    plain_layout = True
    required_tensors = (MT.TOKEN_EMBD, MT.TOKEN_EMBD_NORM)
    block_tensors = (MT.ATTN_Q, MT.ATTN_K, MT.ATTN_V, MT.ATTN_OUT, MT.ATTN_OUT_NORM, MT.FFN_UP, MT.FFN_DOWN,
                     MT.LAYER_OUT_NORM)
    smoke_cases = None  # an embedding model: no chat turn to check
    parity_prompts = ()

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


class NomicBert(Bert):
    """nomic-embed-text v1 / v1.5 (``NomicBertModel``, Hub layout) → GGUF arch ``nomic-bert``.

    The Hub checkpoint keeps its fused QKV and gated MLP (``fc11`` up, ``fc12`` gate) as they are, has no
    biases and no learned positions (rotary, NeoX halves, base ``rotary_emb_base``). Its config has the
    GPT-2 style keys (n_embd, n_head, n_inner, n_layer); they are read first. v1/v1.5 declare 8192
    positions but were trained on 2048, which is the context llama.cpp's converter writes. Every setting
    its graph does not model (pre-norm, partial or interleaved rotary, biases, a causal mask) is refused.
    A config with ``moe_every_n_layers`` is the v2 (:class:`NomicBertMoe`), which the constructor returns.
    """

    hf_architectures = ("NomicBertModel",)
    gguf_arch = gguf.MODEL_ARCH.NOMIC_BERT
    block_tensors = (MT.ATTN_QKV, MT.ATTN_OUT, MT.ATTN_OUT_NORM, MT.FFN_UP, MT.FFN_GATE, MT.FFN_DOWN,
                     MT.LAYER_OUT_NORM)

    #: (setting, the value the nomic-bert graph implements)
    _FIXED = (("activation_function", "swiglu"), ("causal", False), ("qkv_proj_bias", False),
              ("mlp_fc1_bias", False), ("mlp_fc2_bias", False), ("prenorm", False), ("rotary_emb_fraction", 1.0),
              ("rotary_emb_interleaved", False), ("rotary_emb_scale_base", None))

    def __new__(cls, cfg, src, mtp: str = "keep"):
        if cls is NomicBert and cfg.get("moe_every_n_layers"):
            cls = NomicBertMoe  # one HF architecture name for both versions
        return super().__new__(cls)

    def __init__(self, cfg, src, mtp: str = "keep"):
        super().__init__(cfg, src, mtp=mtp)
        for key, want in self._FIXED:
            if key not in cfg or cfg[key] != want:
                raise InputError(f"config.json: {self.arch_name} needs {key} = {want!r}, found {cfg.get(key, '(none)')!r}")

    @property
    def hidden_size(self) -> int:
        return int(require(self.cfg, "n_embd", "hidden_size", kind=int))

    @property
    def n_head(self) -> int:
        return int(require(self.cfg, "n_head", "num_attention_heads", kind=int))

    @property
    def n_head_kv(self) -> int:
        return self.n_head

    def context_length(self) -> int:
        """v1/v1.5 declare 8192 positions over 2048 trained ones; llama.cpp's converter writes the trained."""
        npos, trained = self.cfg.get("n_positions"), self.cfg.get("max_trained_positions", 2048)
        if (npos, trained) != (8192, 2048):
            raise InputError(f"config.json: nomic-bert with n_positions {npos} and max_trained_positions {trained} "
                             "is not a known model (v1/v1.5: 8192 and 2048)")
        return 2048

    def hparams(self, md: Metadata) -> None:
        a, c = self.arch_name, self.cfg
        ff = int(require(c, "n_inner", "intermediate_size", kind=int))
        md.u32(Keys.LLM.BLOCK_COUNT.format(arch=a), self.block_count)
        md.u32(Keys.LLM.CONTEXT_LENGTH.format(arch=a), self.context_length())
        md.u32(Keys.LLM.EMBEDDING_LENGTH.format(arch=a), self.hidden_size)
        md.u32(Keys.LLM.FEED_FORWARD_LENGTH.format(arch=a), ff)
        md.u32(Keys.Attention.HEAD_COUNT.format(arch=a), self.n_head)
        md.f32(Keys.Rope.FREQ_BASE.format(arch=a), require(c, "rotary_emb_base", kind=(int, float)))
        md.f32(Keys.Attention.LAYERNORM_EPS.format(arch=a),
               require(c, "layer_norm_epsilon", "layer_norm_eps", kind=(int, float)))
        md.u32(Keys.Attention.KEY_LENGTH.format(arch=a), self.head_dim)
        md.u32(Keys.Attention.VALUE_LENGTH.format(arch=a), self.head_dim)
        md.boolean(Keys.Attention.CAUSAL.format(arch=a), False)
        add_pooling_type(self.src, self.cfg, md, a)

    @property
    def n_ff(self) -> int:
        return int(require(self.cfg, "n_inner", "intermediate_size", kind=int))

    def expected_dims(self):
        d, ff = self.hidden_size, self.n_ff
        dims = super().expected_dims()
        dims.update({MT.ATTN_QKV: (3 * d, d), MT.FFN_UP: (ff, d), MT.FFN_GATE: (ff, d), MT.FFN_DOWN: (d, ff)})
        return dims


class NomicBertMoe(NomicBert):
    """nomic-embed-text-v2-moe (``NomicBertModel`` with ``moe_every_n_layers``) → GGUF arch ``nomic-bert-moe``.

    As llama.cpp's converter: biased fused QKV and output, GELU MLP ``fc1``/``fc2`` with biases, and in the
    blocks ``i % moe_every_n_layers == 1`` a softmax router (``mlp.router.layer``) over experts whose fused
    ``w1`` (``[experts·ff, d]``) becomes ``ffn_up_exps`` and ``w2`` (same shape) is transposed per expert into
    ``ffn_down_exps``; the experts' shared output bias is dropped (llama.cpp's graph has none). Trained on
    512 positions (the config's 2048 are the base model's). Tokenizer: XLM-R SentencePiece Unigram (``t5``).
    """

    hf_architectures = ()  # reached through NomicBert for a config with moe_every_n_layers
    gguf_arch = gguf.MODEL_ARCH.NOMIC_BERT_MOE
    tokenizer_kind = "xlmr"
    block_tensors = ()  # dense and expert blocks alternate

    _FIXED = (("activation_function", "gelu"), ("causal", False), ("qkv_proj_bias", True),
              ("mlp_fc1_bias", True), ("mlp_fc2_bias", True), ("prenorm", False), ("rotary_emb_fraction", 1.0),
              ("rotary_emb_interleaved", False), ("rotary_emb_scale_base", None))

    def __init__(self, cfg, src, mtp: str = "keep"):
        super().__init__(cfg, src, mtp=mtp)
        self.every = int(require(cfg, "moe_every_n_layers", kind=int))
        self.top_k = int(require(cfg, "moe_top_k", kind=int))
        if self.every < 1 or not 1 <= self.top_k <= self.n_expert:
            raise InputError(f"config.json: nomic-bert-moe needs moe_every_n_layers >= 1 and 1 <= moe_top_k <= "
                             f"num_experts, found {self.every}, {self.top_k} and {self.n_expert}")

    def context_length(self) -> int:
        npos, trained = self.cfg.get("n_positions"), self.cfg.get("max_trained_positions", 2048)
        if (npos, trained) != (2048, 2048):
            raise InputError(f"config.json: nomic-bert-moe with n_positions {npos} and max_trained_positions "
                             f"{trained} is not a known model (v2: 2048 and 2048)")
        return 512

    def skip(self, hf_name: str) -> bool:
        return super().skip(hf_name) or ".mlp.experts.bias" in hf_name

    def map_name(self, hf_name: str) -> str:
        if hf_name.endswith((".mlp.experts.mlp.w1", ".mlp.experts.mlp.w2")):
            hf_name += ".weight"
        return super().map_name(hf_name)

    def source_tensor(self, ck, hf_name: str, gguf_name: str) -> RowSource:
        if hf_name.endswith(".mlp.experts.mlp.w1"):
            return Direct(hf_name, (self.n_expert, self.n_ff, self.hidden_size))
        if hf_name.endswith(".mlp.experts.mlp.w2"):
            e, ff, d = self.n_expert, self.n_ff, self.hidden_size
            # [e·ff, d] viewed [e, ff, d], transposed to [e, d, ff]: row (x, j) is w2[x·ff : (x+1)·ff, j]
            return ExpertColumns(hf_name, 0, (e, d, ff))
        return Direct(hf_name, tuple(ck.entry(hf_name).shape))

    def hparams(self, md: Metadata) -> None:
        super().hparams(md)
        a = self.arch_name
        md.u32(Keys.LLM.EXPERT_COUNT.format(arch=a), self.n_expert)
        md.u32(Keys.LLM.MOE_EVERY_N_LAYERS.format(arch=a), self.every)
        md.u32(Keys.LLM.EXPERT_USED_COUNT.format(arch=a), self.top_k)

    def expected_dims(self):
        d, ff, e = self.hidden_size, self.n_ff, self.n_expert
        dims = super().expected_dims()  # the fused QKV and dense up/down as nomic-bert's
        dims.update({MT.FFN_GATE_INP: (e, d), MT.FFN_UP_EXP: (e, ff, d), MT.FFN_DOWN_EXP: (e, d, ff)})
        return dims
