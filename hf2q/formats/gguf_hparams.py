"""The model hyper-parameters a GGUF declares, read in one place with one table of defaults.

The engine's family builders, tensor parallelism, the memory plan, ``hf2q info`` and the
runner all ask :class:`GGUFHparams`; none of them parses metadata keys itself, so a key
the file omits means the same thing everywhere. The defaults follow llama.cpp's
``llama_model::load_hparams`` (``src/llama-model.cpp``): the KV head count falls back to
the head count, the key *and* value head sizes to ``embedding_length / head_count`` (of
the first layer), the RoPE dimension count to the key head size, the RoPE base to 10000,
a scaling factor of 0 to 1. Where llama.cpp refuses a file (no ``context_length``) hf2q
keeps a default (:data:`DEFAULTS`), because engine tests build headers without one.

Values are read on first use, not at construction: ``hf2q info`` reports a missing key as
a reason instead of failing, and a family reads only the keys it uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf2q.errors import InputError
from hf2q.formats.gguf_keys import ExtraKeys, Keys, arch_key

_A, _L, _R, _S = Keys.Attention, Keys.LLM, Keys.Rope, Keys.SSM

#: encoder-only architectures: no causal KV cache
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe"})


def moe_block(i: int, every: int) -> bool:
    """Whether nomic-bert-moe block ``i`` is an expert block (llama.cpp: ``il % moe_every_n_layers == 1``)."""
    return every > 0 and i % every == 1


#: keys without which no transformer can be built (llama.cpp requires them too)
REQUIRED = frozenset({_L.BLOCK_COUNT, _L.EMBEDDING_LENGTH, _A.HEAD_COUNT})

#: the value of a key the file does not hold; a callable derives it from the other hparams.
#: Keys absent from this table (and from ``REQUIRED``) read as None.
DEFAULTS: dict[str, Any] = {
    _L.CONTEXT_LENGTH: 4096,
    _A.HEAD_COUNT_KV: lambda hp: hp.n_heads,
    _A.KEY_LENGTH: lambda hp: hp.hidden // hp.first_layer_heads,
    _A.VALUE_LENGTH: lambda hp: hp.hidden // hp.first_layer_heads,
    _R.DIMENSION_COUNT: lambda hp: hp.key_length,
    _A.LAYERNORM_RMS_EPS: 1e-6,
    _A.LAYERNORM_EPS: 1e-12,
    _R.FREQ_BASE: 10000.0,
    _R.FREQ_BASE_SWA: 10000.0,  # Gemma 3's local layers (llama.cpp sets it for that family)
    _R.SCALING_FACTOR: 1.0,
    _R.SCALING_ATTN_FACTOR: 1.0,
    _R.SCALING_YARN_EXT_FACTOR: 1.0,
    _R.SCALING_YARN_LOG_MUL: 0.0,
    _R.SCALING_YARN_BETA_FAST: 32.0,
    _R.SCALING_YARN_BETA_SLOW: 1.0,
    _A.SLIDING_WINDOW_PATTERN: 6,  # Gemma 3: five local layers per global one
    _L.EXPERT_WEIGHTS_NORM: True,  # Qwen3-MoE renormalises its top-k (llama.cpp hard-codes it there)
    _L.POOLING_TYPE: 1,  # mean
    _L.FULL_ATTENTION_INTERVAL: 4,  # qwen35 / qwen3next: every 4th layer full attention
    _L.NEXTN_PREDICT_LAYERS: 0,
}

#: hybrid architectures whose linear-attention layers keep a recurrent state instead of KV
RECURRENT_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next"})


class GGUFHparams:
    """Typed, defaulted access to one GGUF's hyper-parameters (``GGUFFile.hparams``)."""

    def __init__(self, metadata: Mapping[str, Any], source: str = "GGUF"):
        self.metadata = metadata
        self.source = source
        self.arch = str(metadata.get(Keys.General.ARCHITECTURE, ""))

    # ---- raw access ------------------------------------------------------------------

    def key(self, template: str) -> str:
        """The file's key for a ``gguf.Keys`` template (``{arch}`` filled in)."""
        return arch_key(template, self.arch)

    def stored(self, template: str) -> Any:
        """What the file holds for ``template``, None when absent (no default applied)."""
        return self.metadata.get(self.key(template))

    def value(self, template: str) -> Any:
        """The file's value, else the default of :data:`DEFAULTS`; a missing required key is an ``InputError``."""
        v = self.stored(template)
        if v is not None:
            return v
        if template in REQUIRED:
            raise InputError(f"{self.source}: missing GGUF metadata key {self.key(template)!r}")
        d = DEFAULTS.get(template)
        return d(self) if callable(d) else d

    def require(self, template: str) -> Any:
        v = self.stored(template)
        if v is None:
            raise InputError(f"{self.source}: missing GGUF metadata key {self.key(template)!r}")
        return v

    # ---- shape -----------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return int(self.value(_L.BLOCK_COUNT))

    @property
    def hidden(self) -> int:
        return int(self.value(_L.EMBEDDING_LENGTH))

    @property
    def n_heads(self) -> int | list[int]:
        """Query heads: one count, or one per layer."""
        return _count(self.value(_A.HEAD_COUNT))

    @property
    def n_kv_heads(self) -> int | list[int]:
        return _count(self.value(_A.HEAD_COUNT_KV))

    @property
    def first_layer_heads(self) -> int:
        """The head count llama.cpp derives head sizes from (``n_head()``: layer 0's)."""
        h = self.n_heads
        return h[0] if isinstance(h, list) else h

    def uniform_heads(self, why: str = "") -> tuple[int, int]:
        """``(n_heads, n_kv_heads)`` as single counts; per-layer counts are an ``InputError``."""
        h, kv = self.n_heads, self.n_kv_heads
        if isinstance(h, list) or isinstance(kv, list):
            raise InputError(f"{self.source}: per-layer head counts are not supported{why}")
        return h, kv

    @property
    def key_length(self) -> int:
        return int(self.value(_A.KEY_LENGTH))

    @property
    def value_length(self) -> int:
        return int(self.value(_A.VALUE_LENGTH))

    @property
    def feed_forward_length(self) -> int | list[int] | None:
        v = self.value(_L.FEED_FORWARD_LENGTH)
        return None if v is None else _count(v)

    @property
    def n_ctx_train(self) -> int:
        return int(self.value(_L.CONTEXT_LENGTH))

    @property
    def rms_eps(self) -> float:
        return float(self.value(_A.LAYERNORM_RMS_EPS))

    @property
    def norm_eps(self) -> float:
        return float(self.value(_A.LAYERNORM_EPS))

    # ---- RoPE ------------------------------------------------------------------------

    @property
    def rope_dims(self) -> int:
        return int(self.value(_R.DIMENSION_COUNT))

    @property
    def rope_base(self) -> float:
        return float(self.value(_R.FREQ_BASE))

    @property
    def rope_base_swa(self) -> float:
        return float(self.value(_R.FREQ_BASE_SWA))

    @property
    def rope_scaling(self) -> Any:
        """``rope.scaling.type`` as stored (None, "none", "linear", "yarn", …)."""
        return self.stored(_R.SCALING_TYPE)

    @property
    def rope_scaling_factor(self) -> float:
        """The context scaling factor; 0 means none, as in llama.cpp."""
        return float(self.value(_R.SCALING_FACTOR) or 1.0)

    @property
    def rope_original_context(self) -> int | None:
        v = self.stored(_R.SCALING_ORIG_CTX_LEN)
        return int(v) if v else None

    @property
    def rope_attn_factor(self) -> float:
        return float(self.value(_R.SCALING_ATTN_FACTOR))

    @property
    def yarn_ext_factor(self) -> float:
        return float(self.value(_R.SCALING_YARN_EXT_FACTOR))

    @property
    def yarn_log_multiplier(self) -> float:
        return float(self.value(_R.SCALING_YARN_LOG_MUL) or 0.0)

    @property
    def yarn_beta_fast(self) -> float:
        return float(self.value(_R.SCALING_YARN_BETA_FAST))

    @property
    def yarn_beta_slow(self) -> float:
        return float(self.value(_R.SCALING_YARN_BETA_SLOW))

    # ---- family extras ---------------------------------------------------------------

    @property
    def sliding_window(self) -> int | None:
        v = self.stored(_A.SLIDING_WINDOW)
        return int(v) if v else None

    @property
    def sliding_window_pattern(self) -> int | list[bool]:
        """Every n-th layer global (an int), or one is-local flag per layer."""
        v = self.value(_A.SLIDING_WINDOW_PATTERN)
        return [bool(x) for x in v] if isinstance(v, list) else int(v)

    @property
    def final_logit_softcap(self) -> float | None:
        v = self.stored(_L.FINAL_LOGIT_SOFTCAPPING)
        return float(v) if v else None

    @property
    def expert_used_count(self) -> int:
        return int(self.require(_L.EXPERT_USED_COUNT))

    @property
    def expert_weights_norm(self) -> bool:
        return bool(self.value(_L.EXPERT_WEIGHTS_NORM))

    @property
    def pooling_type(self) -> int:
        return int(self.value(_L.POOLING_TYPE))

    # ---- hybrid recurrent (Gated DeltaNet) layers --------------------------------------

    @property
    def nextn_predict_layers(self) -> int:
        """Multi-token-prediction blocks stored after the main ones (counted in ``block_count``)."""
        return int(self.value(_L.NEXTN_PREDICT_LAYERS) or 0)

    @property
    def n_main_layers(self) -> int:
        """The blocks the main forward pass runs (``block_count`` less the MTP blocks)."""
        return self.n_layers - self.nextn_predict_layers

    @property
    def recurrent_layers(self) -> list[bool]:
        """Per main block: True for a recurrent layer. The stored flags, else llama.cpp's rule for
        these families: every ``full_attention_interval``-th layer is full attention. All False
        for architectures without recurrent layers."""
        n = self.n_main_layers
        if self.arch not in RECURRENT_ARCHS:
            return [False] * n
        flags = self.stored(ExtraKeys.RECURRENT_LAYERS)
        if flags is not None:
            flags = [bool(x) for x in flags]
            if len(flags) < n:
                raise InputError(f"{self.source}: {self.key(ExtraKeys.RECURRENT_LAYERS)} has {len(flags)} entries "
                                 f"for {n} layers")
            return flags[:n]
        interval = int(self.value(_L.FULL_ATTENTION_INTERVAL))
        if interval <= 0:
            raise InputError(f"{self.source}: {self.key(_L.FULL_ATTENTION_INTERVAL)} must be positive")
        return [(i + 1) % interval != 0 for i in range(n)]

    @property
    def ssm_conv_kernel(self) -> int:
        return int(self.require(_S.CONV_KERNEL))

    @property
    def ssm_state_size(self) -> int:
        """Key head size of a linear-attention layer (llama.cpp's ``ssm_d_state``)."""
        return int(self.require(_S.STATE_SIZE))

    @property
    def ssm_group_count(self) -> int:
        """Key heads of a linear-attention layer."""
        return int(self.require(_S.GROUP_COUNT))

    @property
    def ssm_time_step_rank(self) -> int:
        """Value heads of a linear-attention layer."""
        return int(self.require(_S.TIME_STEP_RANK))

    @property
    def ssm_inner_size(self) -> int:
        """Value heads × value head size."""
        return int(self.require(_S.INNER_SIZE))

    def recurrent_state_parts(self, elem_bytes: int = 4) -> tuple[int, int]:
        """``(conv, ssm)`` bytes of recurrent state one sequence holds over all linear-attention layers:
        the conv window ``(conv_kernel − 1) × conv channels`` in the activation type (``elem_bytes``)
        and the float32 delta-rule matrix ``value heads × value head size × key head size`` ((0, 0)
        without recurrent layers)."""
        n = sum(self.recurrent_layers) if self.arch in RECURRENT_ARCHS else 0
        if not n:
            return 0, 0
        k_dim = self.ssm_state_size * self.ssm_group_count
        inner = self.ssm_inner_size
        return n * (self.ssm_conv_kernel - 1) * (2 * k_dim + inner) * elem_bytes, n * inner * self.ssm_state_size * 4

    def recurrent_state_bytes(self, elem_bytes: int = 4) -> int:
        """One copy of a sequence's recurrent state (:meth:`recurrent_state_parts`, summed)."""
        return sum(self.recurrent_state_parts(elem_bytes))

    @property
    def is_encoder(self) -> bool:
        return self.arch in ENCODER_ARCHS

    # ---- derived -----------------------------------------------------------------------

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """KV cache bytes one token takes over all layers, K and V: the sum over layers of
        ``kv_heads × (key_length + value_length) × elem_bytes`` (0 for encoders). Recurrent
        layers hold no KV (their state is per sequence, :meth:`recurrent_state_bytes`)."""
        if self.is_encoder:
            return 0
        n_layers, kv = self.n_layers, self.n_kv_heads
        per_layer = kv if isinstance(kv, list) else [kv] * n_layers
        if len(per_layer) != n_layers:
            raise InputError(f"{self.source}: {self.key(_A.HEAD_COUNT_KV)} has {len(per_layer)} entries "
                             f"for {n_layers} layers")
        if self.arch in RECURRENT_ARCHS:
            recurrent = self.recurrent_layers
            per_layer = [h for i, h in enumerate(per_layer[:len(recurrent)]) if not recurrent[i]]
        return sum(per_layer) * (self.key_length + self.value_length) * elem_bytes


def _count(v: Any) -> int | list[int]:
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else int(v)
