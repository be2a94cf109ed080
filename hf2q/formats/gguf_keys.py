"""GGUF metadata key names: the PyPI ``gguf`` package's ``gguf.Keys``, plus the few it lacks.

Every key hf2q reads or writes is named through ``gguf.Keys`` (``Keys.LLM.BLOCK_COUNT`` is
``"{arch}.block_count"``) or through :class:`ExtraKeys` below, never as a literal string, so a
misspelt key is an ``AttributeError`` at import time instead of a silently missing value.
"""

from __future__ import annotations

from gguf import Keys

__all__ = ["DeepSeek4Keys", "DeepSeek4Tensors", "ExtraKeys", "ExtraTensors", "Keys", "arch_key"]


class ExtraKeys:
    """Keys the PyPI ``gguf`` package does not define."""

    #: BERT vocabularies: the id of ``[CLS]`` (llama.cpp's ``LLM_KV_TOKENIZER_CLS_ID``)
    CLS_ID = "tokenizer.ggml.cls_token_id"
    #: hf2q's WordPiece normaliser flags, written by ``sources.tokenizer_meta`` for BERT vocabularies
    NORMALIZER_LOWERCASE = "tokenizer.ggml.normalizer.lowercase"
    NORMALIZER_STRIP_ACCENTS = "tokenizer.ggml.normalizer.strip_accents"
    #: hybrid recurrent models (qwen35, qwen3next): one flag per block, True for a recurrent
    #: (linear-attention) layer (llama.cpp's ``LLM_KV_ATTENTION_RECURRENT_LAYERS``)
    RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
    #: DeepSeek-V4 (``deepseek4``, llama.cpp's ``LLM_KV_*`` of the same names): per-layer compression
    #: ratio (0 sliding window only, 4 compressed sparse, 128 heavily compressed), the compressed
    #: branches' RoPE base, the grouped output projection, hash-routed layers, hyper-connections
    COMPRESS_RATIOS = "{arch}.attention.compress_ratios"
    COMPRESS_ROPE_FREQ_BASE = "{arch}.attention.compress_rope_freq_base"
    OUTPUT_GROUP_COUNT = "{arch}.attention.output_group_count"
    OUTPUT_LORA_RANK = "{arch}.attention.output_lora_rank"
    HASH_LAYER_COUNT = "{arch}.hash_layer_count"
    HYPER_CONNECTION_COUNT = "{arch}.hyper_connection.count"
    HYPER_CONNECTION_SINKHORN_ITERATIONS = "{arch}.hyper_connection.sinkhorn_iterations"
    HYPER_CONNECTION_EPSILON = "{arch}.hyper_connection.epsilon"
    #: ``[rank, size]`` on the per-rank view of a tensor-parallel shard (never written to a file)
    TENSOR_PARALLEL = "hf2q.tensor_parallel"
    #: the parser's own entries (not file keys): the container version and counts
    GGUF_VERSION = "GGUF.version"
    GGUF_TENSOR_COUNT = "GGUF.tensor_count"
    GGUF_KV_COUNT = "GGUF.kv_count"


class ExtraTensors:
    """Tensor names llama.cpp writes that the PyPI ``gguf`` package's ``TENSOR_NAMES`` does not spell out.

    Gemma 4's MoE scales ride on the router and expert tensors under a ``.scale`` suffix instead of
    ``.weight`` (llama.cpp's converter forms them from ``FFN_GATE_INP`` / ``FFN_DOWN_EXP`` + ``.scale``).
    """

    #: per-channel scale of the router's input (Gemma 4 ``router.scale``)
    FFN_GATE_INP_SCALE = "blk.{bid}.ffn_gate_inp.scale"
    #: per-expert multiplier of each expert's output (Gemma 4 ``router.per_expert_scale``)
    FFN_DOWN_EXPS_SCALE = "blk.{bid}.ffn_down_exps.scale"


class DeepSeek4Keys:
    """DeepSeek-V4's architecture name and the keys of its own (llama.cpp's ``deepseek4``; gguf 0.19 lacks them)."""

    ARCH = "deepseek4"  # its metadata keys are ExtraKeys' COMPRESS_*, OUTPUT_*, HASH_*, HYPER_CONNECTION_*
    #: ``{arch}.expert_gating_func`` value of sqrt(softplus) scoring (llama.cpp's ``SQRT_SOFTPLUS``)
    GATING_SQRT_SOFTPLUS = 4


class DeepSeek4Tensors:
    """llama.cpp's ``deepseek4`` tensor names, keyed by the official checkpoint names they come from."""

    ROOT = {
        "embed.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "head.weight": "output.weight",
        "hc_head_fn": "output_hc_fn.weight", "hc_head_base": "output_hc_base.weight",
        "hc_head_scale": "output_hc_scale.weight",
    }
    #: ``layers.N.<key>`` → ``blk.{bid}.…``
    LAYER = {
        "hc_attn_fn": "blk.{bid}.hc_attn_fn.weight", "hc_attn_base": "blk.{bid}.hc_attn_base.weight",
        "hc_attn_scale": "blk.{bid}.hc_attn_scale.weight", "hc_ffn_fn": "blk.{bid}.hc_ffn_fn.weight",
        "hc_ffn_base": "blk.{bid}.hc_ffn_base.weight", "hc_ffn_scale": "blk.{bid}.hc_ffn_scale.weight",
        "attn.attn_sink": "blk.{bid}.attn_sinks.weight",
        "attn.wq_a.weight": "blk.{bid}.attn_q_a.weight", "attn.q_norm.weight": "blk.{bid}.attn_q_a_norm.weight",
        "attn.wq_b.weight": "blk.{bid}.attn_q_b.weight", "attn.wkv.weight": "blk.{bid}.attn_kv.weight",
        "attn.kv_norm.weight": "blk.{bid}.attn_kv_a_norm.weight",
        "attn.wo_a.weight": "blk.{bid}.attn_output_a.weight", "attn.wo_b.weight": "blk.{bid}.attn_output_b.weight",
        "attn.compressor.ape": "blk.{bid}.attn_compressor_ape.weight",
        "attn.compressor.wkv.weight": "blk.{bid}.attn_compressor_kv.weight",
        "attn.compressor.wgate.weight": "blk.{bid}.attn_compressor_gate.weight",
        "attn.compressor.norm.weight": "blk.{bid}.attn_compressor_norm.weight",
        "attn.indexer.wq_b.weight": "blk.{bid}.indexer.attn_q_b.weight",
        "attn.indexer.weights_proj.weight": "blk.{bid}.indexer.proj.weight",
        "attn.indexer.compressor.ape": "blk.{bid}.indexer_compressor_ape.weight",
        "attn.indexer.compressor.wkv.weight": "blk.{bid}.indexer_compressor_kv.weight",
        "attn.indexer.compressor.wgate.weight": "blk.{bid}.indexer_compressor_gate.weight",
        "attn.indexer.compressor.norm.weight": "blk.{bid}.indexer_compressor_norm.weight",
        "attn_norm.weight": "blk.{bid}.attn_norm.weight", "ffn_norm.weight": "blk.{bid}.ffn_norm.weight",
        "ffn.gate.weight": "blk.{bid}.ffn_gate_inp.weight", "ffn.gate.bias": "blk.{bid}.exp_probs_b.bias",
        "ffn.gate.bias_vl": "blk.{bid}.exp_probs_b_vl.bias", "ffn.gate.tid2eid": "blk.{bid}.ffn_gate_tid2eid.weight",
        "ffn.shared_experts.w1.weight": "blk.{bid}.ffn_gate_shexp.weight",
        "ffn.shared_experts.w2.weight": "blk.{bid}.ffn_down_shexp.weight",
        "ffn.shared_experts.w3.weight": "blk.{bid}.ffn_up_shexp.weight",
        "nextn.eh_proj.weight": "blk.{bid}.nextn.eh_proj.weight", "nextn.enorm.weight": "blk.{bid}.nextn.enorm.weight",
        "nextn.hnorm.weight": "blk.{bid}.nextn.hnorm.weight",
        "nextn.shared_head_norm.weight": "blk.{bid}.nextn.shared_head_norm.weight",
        "nextn.embed_tokens.weight": "blk.{bid}.nextn.embed_tokens.weight",
        "nextn.shared_head_head.weight": "blk.{bid}.nextn.shared_head_head.weight",
    }
    FFN_GATE_EXPS = "blk.{bid}.ffn_gate_exps.weight"
    FFN_DOWN_EXPS = "blk.{bid}.ffn_down_exps.weight"
    FFN_UP_EXPS = "blk.{bid}.ffn_up_exps.weight"


def arch_key(template: str, arch: str) -> str:
    """``template`` (a ``gguf.Keys`` name, possibly ``"{arch}.…"``) for the architecture ``arch``."""
    return template.format(arch=arch) if "{arch}" in template else template
