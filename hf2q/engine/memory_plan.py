"""Will a model fit one device (or one rank's share of it)? Decided before any weight is read.

Pure: the GGUF header, its hyper-parameters and the device's memory (``device_probe``), no
MLX — ``hf2q serve`` runs it in the main thread, which never imports MLX.

Loading a model that does not fit ends in an allocator failure deep inside MLX, minutes
in, possibly after other ranks have started. This module predicts, from the GGUF header
alone, what a rank will hold — its shard of the weights in the engine's in-memory form
(``quant_repack``: affine groups of 32 with two scale/bias values per group; the 16-element
K-quants as 8-bit) plus its share of the KV budget — and compares it with the memory a
rank may use (``--memory-limit``, default 90 % of the device). A refusal names the
tensor-parallel size that would fit. Not counted: the CPU backend's extras (one byte per weight
for 3/5/6-bit decode matvecs, the bounded dense-weight cache of prefill).
"""

from __future__ import annotations

import math
from typing import Callable

import attrs
from gguf import GGMLQuantizationType as T

from hf2q.engine.device_probe import DeviceFacts, probe
from hf2q.engine.kv_layout import row_nbytes
from hf2q.engine.recurrent_policy import BLOCK_ENDS_KEPT, STATES_PER_SEQUENCE, swa_full, window_positions
from hf2q.errors import InputError
from hf2q.formats.gguf_file import GGUFFile, GGUFTensor
from hf2q.formats.gguf_keys import ExtraKeys

#: bits per weight of the affine form each GGUF type is loaded as (``quant_repack.to_affine``); on the CPU 5-bit
#: codes are stored one a byte (``repack_rows(wide=True)``)
AFFINE_BITS = {T.Q4_0: 4, T.Q4_1: 4, T.Q4_K: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q8_0: 8,
               T.Q2_K: 8, T.Q3_K: 8, T.Q6_K: 8}
GROUP = 32
#: the share of a device's memory a rank uses unless ``--memory-limit`` says otherwise
DEFAULT_FRACTION = 0.9


def tensor_bytes(t: GGUFTensor, float_bytes: int, scale_bytes: int, on_cpu: bool = False) -> int:
    """Bytes ``t`` occupies once loaded: packed weights + scales + biases, or floats."""
    n = math.prod(t.shape)
    bits = AFFINE_BITS.get(t.qtype)
    if bits is None:
        return n * float_bytes
    if on_cpu and bits == 5:
        bits = 8
    return n * bits // 8 + 2 * (n // GROUP) * scale_bytes


@attrs.frozen
class RankNeed:
    size: int
    weights: int  # bytes of weights on the most loaded rank
    kv: int  # that rank's share of the KV budget

    @property
    def total(self) -> int:
        return self.weights + self.kv


@attrs.frozen
class KvNeed:
    """The K/V a slot holds, as the engine's cache (``engine/kv_cache.py``) allocates it."""

    per_token: int  # bytes one more token of context costs (the layers that keep every position)
    window: int | None = None  # the sliding window of the layers that keep only it (gemma4, gemma3)
    window_layers: int = 0
    window_position: int = 0  # bytes of one position in one of those layers
    #: a family's own bounded part (deepseek4: ``new_tokens`` → bytes, ``models/deepseek4_layout.py``)
    bounded: Callable[[int], int] | None = None
    #: a family's own copy held per captured block end (deepseek4: a reuse point's rows)
    end_copy: int = 0

    def window_bytes(self, new_tokens: int = 1) -> int:
        """Most bytes the window layers of one slot hold while a forward of ``new_tokens`` runs."""
        held = self.bounded(new_tokens) if self.bounded is not None else 0
        if not self.window_layers:
            return held
        return held + self.window_layers * window_positions(self.window, new_tokens) * self.window_position

    def block_end_bytes(self) -> int:
        """One block end captured for the persistent store until the block is exported, beside any
        recurrent state: the window layers' last ``window`` rows, or a compact cache's reuse-point copy."""
        return self.window_layers * (self.window or 0) * self.window_position + self.end_copy

    def slot_bytes(self, ctx: int) -> int:
        """One slot at ``ctx`` tokens, decoding."""
        return ctx * self.per_token + self.window_bytes()


def gemma3_local_layers(hp) -> list[bool]:
    """Which gemma3 layers are local (sliding): the per-layer flags, or every layer but each
    ``pattern``-th (llama.cpp's rule, period 6 unless the GGUF says otherwise)."""
    pattern = hp.sliding_window_pattern
    if isinstance(pattern, list):
        return [bool(x) for x in pattern]
    return [(i + 1) % pattern != 0 for i in range(hp.n_layers)]


def token_bytes(hp, elem: int, kv_type: str = "f16") -> int:
    """K/V bytes of one token over all layers that hold K/V, stored as ``kv_type`` (``kv_layout``)."""
    if kv_type == "f16":
        return hp.kv_bytes_per_token(elem)
    heads = hp.kv_bytes_per_token(1) // (hp.key_length + hp.value_length)  # summed over the layers
    return _rows_bytes(hp, heads, elem, kv_type)


def _rows_bytes(hp, heads: int, elem: int, kv_type: str) -> int:
    """One position's K and V rows for ``heads`` heads, stored as ``kv_type``."""
    return heads * (row_nbytes(kv_type, hp.key_length, elem) + row_nbytes(kv_type, hp.value_length, elem))


def kv_need(hp, elem: int, *, on_cpu: bool = False, kv_type: str = "f16", mtp: bool = False) -> KvNeed:
    """The K/V layout of ``hp``'s model at ``elem`` bytes a value, stored as ``kv_type``, from the
    header alone — the one account of it (the runner, ``info`` and the memory check read it).

    gemma4 stores every layer in one cache layout — heads split into pieces of the smallest head size,
    padded to the widest layer (``models/gemma4.py::cache_layout``) — its KV-shared layers hold none,
    and its sliding layers keep only their window. gemma3's local layers keep only theirs too, except under
    the CPU host decode step over an 8-bit cache (``on_cpu`` with a q8 ``kv_type``), whose attention addresses
    every position. With ``HF2Q_SWA_FULL=1`` sliding
    layers count per token. Other families: ``kv_bytes_per_token``. ``mtp`` (``--speculative mtp``, qwen35):
    the draft head's attention layer keeps a K/V row of every position too (:func:`mtp_position_bytes`)."""
    from hf2q.formats.gguf_keys import Keys

    if mtp and hp.arch != "deepseek4":
        need = kv_need(hp, elem, on_cpu=on_cpu, kv_type=kv_type)
        return attrs.evolve(need, per_token=need.per_token + mtp_position_bytes(hp, elem, kv_type),
                            end_copy=need.end_copy + end_hidden_bytes(hp, elem))

    windowed = hp.sliding_window and not swa_full()
    if hp.arch == "gemma3" and windowed and not (on_cpu and kv_type != "f16"):
        local = gemma3_local_layers(hp)
        position = token_bytes(hp, elem, kv_type) // hp.n_layers
        return KvNeed((len(local) - sum(local)) * position, hp.sliding_window, sum(local), position)
    if hp.arch == "deepseek4":  # entries grow at 1/ratio, the rest is bounded (models/deepseek4_layout.py)
        from hf2q.engine.models.deepseek4_layout import compact_need

        need = compact_need(hp, elem, mtp=mtp)  # the MTP head's window layer is bounded too
        return KvNeed(need.per_token, bounded=need.bounded,
                      end_copy=need.point_copy() + (end_hidden_bytes(hp, elem) if mtp else 0))
    if hp.arch != "gemma4":
        return KvNeed(token_bytes(hp, elem, kv_type))
    a = Keys.Attention
    n = hp.n_layers
    sliding = [bool(x) for x in hp.stored(a.SLIDING_WINDOW_PATTERN)]
    kv = hp.n_kv_heads if isinstance(hp.n_kv_heads, list) else [hp.n_kv_heads] * n
    dims = [int(hp.require(a.KEY_LENGTH_SWA)) if s else int(hp.require(a.KEY_LENGTH)) for s in sliding]
    piece = min(dims)
    position = max(h * d // piece for h, d in zip(kv, dims)) * 2 * row_nbytes(kv_type, piece, elem)
    owners = range(n - int(hp.stored(a.SHARED_KV_LAYERS) or 0))
    window = hp.sliding_window
    n_window = sum(sliding[i] for i in owners) if windowed else 0
    return KvNeed((len(owners) - n_window) * position, window if n_window else None, n_window, position)


def end_hidden_bytes(hp, elem: int) -> int:
    """What a captured block end keeps for an MTP head beside the cache rows: the main model's hidden row
    before the end (qwen35's ``state.hidden``), or DeepSeek-V4's trunk streams there, one hidden row per
    hyper-connection stream."""
    streams = int(hp.stored(ExtraKeys.HYPER_CONNECTION_COUNT) or 1) if hp.arch == "deepseek4" else 1
    return streams * hp.hidden * elem


def mtp_position_bytes(hp, elem: int, kv_type: str = "f16") -> int:
    """K/V bytes of one position in the multi-token-prediction head's attention layer (block
    ``n_main_layers``), stored as ``kv_type`` like the main layers; 0 for a file without the head."""
    if not hp.nextn_predict_layers:
        return 0
    kv = hp.n_kv_heads
    return _rows_bytes(hp, kv[hp.n_main_layers] if isinstance(kv, list) else kv, elem, kv_type)


def head_tensors(g: GGUFFile) -> set[str]:
    """The names of a Qwen 3.5 / 3.6 file's multi-token-prediction block tensors (those after the main
    blocks), which the engine reads only with ``--speculative mtp``; of a deepseek4 MTP companion, what the
    engine loads of it (the block and its hyper-connection head: the embedding and LM head are the
    trunk's); empty for other files."""
    from hf2q.engine.speculative import has_mtp_head, is_mtp_companion

    hp = g.hparams
    if is_mtp_companion(g):
        return {n for n in g.tensors if n.startswith(f"blk.{hp.n_main_layers}.") or n.startswith("output_hc_")}
    heads = {f"blk.{i}." for i in range(hp.n_main_layers, hp.n_layers)} if has_mtp_head(g) else set()
    return {n for n in g.tensors if any(n.startswith(p) for p in heads)}


def rank_need(g: GGUFFile, size: int, kv_budget: int, *, float_bytes: int, scale_bytes: int,
              mtp: bool = False, draft: GGUFFile | None = None, on_cpu: bool = False) -> RankNeed:
    """What the most loaded of ``size`` ranks holds (``InputError`` when ``g`` cannot split ``size`` ways);
    the MTP head's weights only with ``mtp`` (the engine loads them only then), a deepseek4 companion
    ``draft``'s (``--model-draft``) too, each rank its share (the companion's block is cut like the trunk's)."""
    from hf2q.engine.tensor_parallel import shard_gguf

    unread = set() if mtp else head_tensors(g)
    companion = head_tensors(draft) if mtp and draft is not None else ()
    worst = 0
    for rank in range(size):
        view = shard_gguf(g, rank, size)
        held = sum(tensor_bytes(t, float_bytes, scale_bytes, on_cpu) for n, t in view.tensors.items()
                   if n not in unread)
        if companion:
            share = shard_gguf(draft, rank, size)
            held += sum(tensor_bytes(share.tensors[n], float_bytes, scale_bytes, on_cpu) for n in companion)
        worst = max(worst, held)
    # deepseek4: its one K=V head and compressors are replicated, so every rank holds the whole compact cache
    return RankNeed(size, worst, kv_budget if g.arch == "deepseek4" else -(-kv_budget // size))


def device_memory() -> int:
    """Bytes of memory of the device MLX will use (GPU memory, or system RAM for the CPU)."""
    return probe().memory


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_fits(g: GGUFFile, size: int, kv_budget: int, limit: int, *, float_bytes: int, scale_bytes: int,
               max_size: int = 8, mtp: bool = False, draft: GGUFFile | None = None, on_cpu: bool = False) -> RankNeed:
    """The need of each of ``size`` ranks, or an ``InputError`` that says what would fit."""
    need = rank_need(g, size, kv_budget, float_bytes=float_bytes, scale_bytes=scale_bytes, mtp=mtp, draft=draft,
                     on_cpu=on_cpu)
    if need.total <= limit:
        return need
    hint = ""
    for bigger in range(size + 1, max_size + 1):
        try:
            other = rank_need(g, bigger, kv_budget, float_bytes=float_bytes, scale_bytes=scale_bytes, mtp=mtp,
                              draft=draft, on_cpu=on_cpu)
        except InputError:
            continue  # the heads or blocks do not split this many ways
        if other.total <= limit:
            hint = f"; it fits at --tensor-parallel {bigger} ({_gib(other.total)} per rank)"
            break
    if not hint and need.kv > need.weights // 4:
        hint = "; lower --ctx, --slots or --kv-cache-budget"
    raise InputError(f"{g.path.name} needs {_gib(need.total)} per rank at --tensor-parallel {size} "
                     f"({_gib(need.weights)} weights + {_gib(need.kv)} KV), more than the {_gib(limit)} "
                     f"a rank may use (--memory-limit){hint}")


def check_model(path, size: int, *, ctx: int | None, slots: int, kv_budget: int | None,
                limit: int | None, device: DeviceFacts | None = None, prefill_chunk: int = 2048,
                kv_type: str = "f16", mtp: bool = False, kv_persist: bool = False, draft=None) -> RankNeed:
    """``check_fits`` for a GGUF (path or opened) with the server's settings, on ``device``
    (default: the one MLX will use, found without importing MLX — ``device_probe``).

    The KV budget defaults to the scheduler's (``slots × ctx`` tokens) plus what a slot holds whatever
    its length: a hybrid model's recurrent states, a sliding-window model's window layers (one slot's
    with a ``prefill_chunk`` transaction in flight); the limit to ``DEFAULT_FRACTION`` of the device's
    memory. ``mtp``: the MTP draft head's weights and K/V layer are counted too (a deepseek4 trunk's from its
    companion ``draft``, path or opened). ``kv_persist``: the
    block-end states a slot keeps for the persistent store until they are written (``BLOCK_ENDS_KEPT``
    more recurrent states, reuse-point copies of a deepseek4 compact cache, or window layers' rows).
    """
    from hf2q.formats.gguf_file import open_gguf

    g = path if isinstance(path, GGUFFile) else open_gguf(path)
    device = device or probe()
    elem = device.activation_bytes()
    if kv_budget is None:
        hp = g.hparams
        kv = kv_need(hp, elem, on_cpu=device.on_cpu, kv_type=kv_type, mtp=mtp)  # the host step reads every cache type
        # hybrid models: each slot's recurrent state, its rollback copy and its reuse points (docs/ENGINE.md)
        states = STATES_PER_SEQUENCE + (BLOCK_ENDS_KEPT if kv_persist else 0)
        kv_budget = slots * (kv.slot_bytes(ctx or hp.n_ctx_train) + states * hp.recurrent_state_bytes(elem)
                             + (BLOCK_ENDS_KEPT * kv.block_end_bytes() if kv_persist else 0))
        kv_budget += kv.window_bytes(prefill_chunk) - kv.window_bytes()  # the one slot prefilling at a time
    if limit is None:
        limit = int(device.memory * DEFAULT_FRACTION)
    if draft is not None and not isinstance(draft, GGUFFile):
        draft = open_gguf(draft)
    return check_fits(g, size, kv_budget, limit, float_bytes=elem, scale_bytes=device.scale_bytes(), mtp=mtp,
                      draft=draft, on_cpu=device.on_cpu)
