"""``hf2q info MODEL.gguf``: a static preflight of one GGUF.

Reads only the header and metadata (tensor data stays memory-mapped and untouched), so
it answers in well under a second for any size. It reports what the engine would do
with the file — family, quant mix, bytes, context, tokenizer and chat template, the KV
cache a slot needs — and ends with ``Serve support: ready`` or
``Serve support: rejected — <reason>`` (exit 3). ``--json`` prints one object instead.
"""

from __future__ import annotations

import json
from typing import Any

import gguf

from hf2q.errors import EXIT_INPUT, EXIT_OK, InputError
from hf2q.formats.gguf_check import problem, unserved
from hf2q.formats.gguf_file import open_gguf
from hf2q.formats.gguf_hparams import ENCODER_ARCHS
from hf2q.formats.gguf_keys import Keys

EMBEDDING_ARCHS = ENCODER_ARCHS
#: llama.cpp's architecture name of a projector (mmproj) file
MMPROJ_ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ]


def kv_dtype_bytes() -> int:
    """Bytes per KV element in the engine on this machine (float32 on CPU, float16 on GPU)."""
    from hf2q.engine.device_probe import probe

    return probe().activation_bytes()


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def inspect(path, ctx: int | None = None, slots: int = 4, kv_budget: int | None = None,
            kv_type: str = "f16") -> dict[str, Any]:
    """Everything ``info`` prints, as a dict (``serve_support`` + ``reject_reason``)."""
    from hf2q.engine.models import FAMILIES

    g = open_gguf(path)
    arch = g.arch
    reasons: list[str] = []
    if arch not in FAMILIES:
        reasons.append(unserved(arch))
    else:
        defect = problem(g)  # the same check serve, generate and the engine's loader run
        if defect:
            reasons.append(defect)
    hp = g.hparams
    tokens = g.get(Keys.Tokenizer.LIST)
    tok_model = g.get(Keys.Tokenizer.MODEL)
    has_tokenizer = isinstance(tokens, list) and bool(tokens) and bool(tok_model)
    if not has_tokenizer and not reasons:
        reasons.append(f"no tokenizer metadata ({Keys.Tokenizer.MODEL} / tokens)")
    template = g.get(Keys.Tokenizer.CHAT_TEMPLATE)
    n_ctx_train = _number(lambda: hp.n_ctx_train)
    ctx = int(ctx or n_ctx_train or 0)
    kind = "embedding" if arch in EMBEDDING_ARCHS else "mmproj" if arch == MMPROJ_ARCH else "chat"
    if kind == "mmproj":  # llama.cpp's vision projector: the second file of a vision-language pair
        from hf2q.arch.qwen3vl_mmproj import projector_summary
        reasons = ["a vision projector (mmproj) for its text model, not a model to serve alone"]
    from hf2q.engine.speculative import is_mtp_companion

    if kind == "chat" and is_mtp_companion(g):  # deepseek4's MTP head alone (llama.cpp's --mtp export)
        kind, reasons = "mtp", ["a multi-token-prediction head for its trunk (serve the trunk with --speculative "
                                "mtp --model-draft FILE), not a model to serve alone"]
    elem = kv_dtype_bytes()
    per_token, kv = 0, None
    if not reasons:  # sizes only from hyper-parameters the check passed (a block_count of 10^9 is not one)
        from hf2q.engine.device_probe import probe
        from hf2q.engine.kv_layout import check_kv_type
        from hf2q.engine.memory_plan import kv_need

        try:
            if kind == "chat":
                check_kv_type(kv_type, (hp.key_length, hp.value_length), arch)
            # an 8-bit cache runs the MLX graph, which keeps gemma3's local layers to their window
            kv = kv_need(hp, elem, on_cpu=probe().on_cpu, kv_type=kv_type)
            per_token = kv.per_token
        except InputError as e:
            reasons.append(str(e).split(": ", 1)[-1])
    window_bytes = kv.window_bytes() if kv is not None else 0
    per_slot = kv.slot_bytes(ctx) if kv is not None else 0
    worst = per_slot * slots
    if kind == "chat" and ctx > n_ctx_train > 0:
        reasons.append(f"--ctx {ctx} exceeds the model's trained context {n_ctx_train}")
    if kv_budget is not None and kind == "chat" and kv_budget < per_slot:
        reasons.append(f"--kv-cache-budget {_human(kv_budget)} cannot hold one slot at --ctx {ctx} "
                       f"({_human(per_slot)})")
    return {
        "path": str(g.path), "architecture": arch, "family": arch, "kind": kind,
        "name": g.get(Keys.General.NAME), "file_type": g.get(Keys.General.FILE_TYPE),
        "tensor_count": len(g.tensors), "tensor_bytes": g.tensor_bytes, "file_bytes": g.file_bytes,
        "quant_mix": g.type_counts(),
        "parameters": sum(t.n_elements for t in g.tensors.values()),
        "context_length": n_ctx_train, "ctx": ctx, "slots": slots,
        "layers": hp.stored(Keys.LLM.BLOCK_COUNT), "embedding_length": hp.stored(Keys.LLM.EMBEDDING_LENGTH),
        "tokenizer": tok_model if has_tokenizer else None, "vocab_size": len(tokens) if tokens else 0,
        "chat_template": bool(template),
        "projector": projector_summary(g.metadata) if kind == "mmproj" else None,
        "kv_dtype_bytes": elem, "kv_cache_type": kv_type, "kv_bytes_per_token": per_token, "kv_bytes_per_slot": per_slot,
        "kv_bytes_worst_case": worst, "kv_cache_budget": kv_budget,
        "kv_window": kv.window if kv is not None else None,
        "kv_window_layers": kv.window_layers if kv is not None else 0, "kv_window_bytes_per_slot": window_bytes,
        **recurrent_state(None if reasons else hp, elem),
        **mtp_head(g if kind == "mtp" or (kind == "chat" and not reasons) else None, elem, kv_type, ctx),
        **compact_cache(hp if not reasons and arch == "deepseek4" else None, elem),
        "serve_support": "rejected" if reasons else "ready",
        "reject_reason": "; ".join(reasons) if reasons else None,
    }


def recurrent_state(hp, elem: int = 4) -> dict[str, int]:
    """The fixed state one slot holds for a hybrid model's linear-attention layers (qwen35,
    qwen35moe), beside its KV: per layer the conv window ``(conv kernel − 1) × conv channels``
    in the engine's activation type (``elem`` bytes, as the KV) and the delta-rule matrix
    ``value heads × value dim × key dim`` in float32. Zeros for other families."""
    from hf2q.engine.recurrent_policy import CHECKPOINTS_KEPT

    conv, ssm = hp.recurrent_state_parts(elem) if hp is not None else (0, 0)
    if not conv + ssm:
        return {"recurrent_layers": 0, "recurrent_conv_bytes_per_slot": 0, "recurrent_ssm_bytes_per_slot": 0,
                "recurrent_state_bytes_per_slot": 0, "recurrent_reuse_points_per_slot": 0}
    return {"recurrent_layers": sum(hp.recurrent_layers), "recurrent_conv_bytes_per_slot": conv,
            "recurrent_ssm_bytes_per_slot": ssm, "recurrent_state_bytes_per_slot": conv + ssm,
            "recurrent_reuse_points_per_slot": CHECKPOINTS_KEPT}


def mtp_head(g, elem: int, kv_type: str, ctx: int) -> dict[str, int]:
    """What ``--speculative mtp`` adds to a Qwen 3.5 / 3.6 file's plan (``memory_plan``): the head's
    weights as loaded, and its attention layer's K/V per token and per slot at ``ctx``. Zeros for a file
    the head cannot draft for (none, or another family's MTP block)."""
    from hf2q.engine.device_probe import probe
    from hf2q.engine.memory_plan import head_tensors, mtp_position_bytes, tensor_bytes

    names = head_tensors(g) if g is not None else set()
    if not names:
        return {"mtp_weight_bytes": 0, "mtp_kv_bytes_per_token": 0, "mtp_kv_bytes_per_slot": 0}
    device = probe()
    weights = sum(tensor_bytes(g.tensors[n], elem, device.scale_bytes(), device.on_cpu) for n in names)
    if g.arch == "deepseek4":  # a companion: its block is one more window layer of the trunk's compact cache
        from hf2q.engine.models.deepseek4_layout import compact_need

        window = compact_need(g.hparams, elem, mtp=True).bounded() - compact_need(g.hparams, elem).bounded()
        return {"mtp_weight_bytes": weights, "mtp_kv_bytes_per_token": 0, "mtp_kv_bytes_per_slot": window}
    per_token = mtp_position_bytes(g.hparams, elem, kv_type)
    return {"mtp_weight_bytes": weights, "mtp_kv_bytes_per_token": per_token, "mtp_kv_bytes_per_slot": per_token * ctx}


def _mtp_line(info: dict) -> str:
    return (f"MTP head:       with --speculative mtp: weights {_human(info['mtp_weight_bytes'])}, KV "
            f"{_human(info['mtp_kv_bytes_per_token'])}/token more (per slot {_human(info['mtp_kv_bytes_per_slot'])}; "
            f"worst case {info['slots']} slots {_human(info['mtp_kv_bytes_per_slot'] * info['slots'])}), "
            "not in the lines above")


def compact_cache(hp, elem: int = 4) -> dict[str, int]:
    """The bounded part of a deepseek4 slot's compact cache (``engine/models/deepseek4_layout.py``):
    the live rows (every layer's window and unfinished blocks), and the copies of them its reuse
    points keep. Zeros for other families."""
    if hp is None:
        return {"kv_compact_fixed_bytes_per_slot": 0, "kv_compact_copies_per_slot": 0, "kv_compact_copy_bytes": 0}
    from hf2q.engine.models.deepseek4_layout import compact_need

    need = compact_need(hp, elem)
    return {"kv_compact_fixed_bytes_per_slot": need.fixed(), "kv_compact_copies_per_slot": need.COPIES,
            "kv_compact_copy_bytes": need.point_copy()}


def _kv_storage(info: dict) -> str:
    if info["kv_cache_type"] == "f16":
        return f"{info['kv_dtype_bytes'] * 8}-bit"
    return f"{info['kv_cache_type']}: 8-bit + a {info['kv_dtype_bytes'] * 8}-bit scale per group"


def _recurrent_line(info: dict) -> str:
    return (f"Recurrent:      {_human(info['recurrent_state_bytes_per_slot'])} per slot over "
            f"{info['recurrent_layers']} linear-attention layers (conv {_human(info['recurrent_conv_bytes_per_slot'])}"
            f" + SSM {_human(info['recurrent_ssm_bytes_per_slot'])}); worst case {info['slots']} slots "
            f"{_human(info['recurrent_state_bytes_per_slot'] * info['slots'])}; prefix-reuse points up to "
            f"{info['recurrent_reuse_points_per_slot']} more per slot "
            f"({_human(info['recurrent_state_bytes_per_slot'] * info['recurrent_reuse_points_per_slot'])})")


def _number(read) -> int:
    """An integer hyper-parameter for the report, 0 when the file's value is not one (the check
    has then named the key as the reason)."""
    try:
        v = read()
    except (ArithmeticError, TypeError, ValueError, InputError):
        return 0
    return v if isinstance(v, int) else 0


def _tokenizer_line(info: dict) -> str:
    if not info["tokenizer"]:
        return "missing"
    return f"{info['tokenizer']} ({info['vocab_size']} tokens)"


def run(args) -> int:
    info = inspect(args.model, ctx=args.ctx, slots=args.slots, kv_budget=args.kv_cache_budget,
                   kv_type=getattr(args, "kv_cache_type", "f16"))
    ready = info["serve_support"] == "ready"
    if args.json:
        print(json.dumps(info))
        return EXIT_OK if ready else EXIT_INPUT
    mix = ", ".join(f"{k}×{v}" for k, v in info["quant_mix"].items())
    lines = [
        f"File:           {info['path']}",
        f"Family:         {info['family']} ({info['kind']}){'  — ' + info['name'] if info['name'] else ''}",
        f"Parameters:     {info['parameters'] / 1e6:.1f} M",
        f"Tensors:        {info['tensor_count']} ({_human(info['tensor_bytes'])}; file {_human(info['file_bytes'])})",
        f"Quant mix:      {mix}",
        f"Context:        trained {info['context_length']}, --ctx {info['ctx']}",
        f"Tokenizer:      {_tokenizer_line(info)}",
        f"Chat template:  {'present' if info['chat_template'] else 'absent'}",
    ]
    if info["projector"]:  # a projector has no context, vocabulary or template of its own
        lines[-3:] = [f"Projector:      {info['projector']}"]
    if info["kind"] == "chat":
        budget = f", budget {_human(info['kv_cache_budget'])}" if info["kv_cache_budget"] else ""
        lines += [
            f"KV cache:       {_human(info['kv_bytes_per_token'])}/token ({_kv_storage(info)}); "
            f"per slot {_human(info['kv_bytes_per_slot'])}; worst case {info['slots']} slots "
            f"{_human(info['kv_bytes_worst_case'])}{budget}",
        ]
        if info["kv_window_layers"]:
            lines.append(f"KV window:      {info['kv_window_layers']} sliding layers keep only their "
                         f"{info['kv_window']}-token window: {_human(info['kv_window_bytes_per_slot'])} per slot "
                         f"whatever the context (included above)")
        if info["kv_compact_fixed_bytes_per_slot"]:
            lines.append(f"KV compact:     windows and unfinished blocks {_human(info['kv_compact_fixed_bytes_per_slot'])}"
                         f" per slot, plus up to {info['kv_compact_copies_per_slot']} reuse-point copies of "
                         f"{_human(info['kv_compact_copy_bytes'])}: {_human(info['kv_window_bytes_per_slot'])} per slot "
                         f"whatever the context (included above)")
        if info["recurrent_layers"]:
            lines.append(_recurrent_line(info))
        if info["mtp_weight_bytes"]:
            lines.append(_mtp_line(info))
    elif info["kind"] == "mtp":
        lines.append(_mtp_line(info))
    print("\n".join(lines))
    if ready:
        print("Serve support: ready")
        return EXIT_OK
    print(f"Serve support: rejected — {info['reject_reason']}")
    return EXIT_INPUT
