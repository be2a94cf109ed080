"""``hf2q generate``: one prompt through the engine on this machine, no HTTP.

The prompt goes through the GGUF's chat template (unless ``--raw``), is prefilled in
chunks of ``PREFILL_CHUNK`` tokens and decoded with the shared ``Sampler``; text is
streamed to stdout as it is produced. ``--benchmark`` repeats the whole generation
``BENCH_RUNS`` times on fresh caches and reports median and p95 prefill / decode
throughput; with ``--json`` the last line is one JSON object of the medians.

``--speculative ngram`` decodes with prompt-lookup drafts (``hf2q.engine.speculative``): each
step feeds the last token plus up to ``--draft-tokens`` drafted ones to ``runner.verify`` and
keeps what the acceptance rule accepts, so the output is the one plain decoding gives (the same
bytes at temperature 0, the same distribution above it). ``--speculative mtp`` drafts with the
model's multi-token-prediction head instead (Qwen 3.5 / 3.6 files with their ``nextn`` block).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from hf2q.engine.sampling import device_capable
from hf2q.errors import InputError

log = logging.getLogger("hf2q.generate")

PREFILL_CHUNK = 2048
BENCH_RUNS = 5


def _prompt_text(args) -> str:
    if getattr(args, "prompt_file", None):
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"cannot read --prompt-file: {e.strerror}: {args.prompt_file}") from None
    if getattr(args, "prompt", None) is None:
        raise InputError("give --prompt TEXT or --prompt-file PATH")
    return args.prompt


def render_prompt(args, model_path: Path, tokenizer) -> list[int]:
    """The prompt's token ids: chat-templated unless ``--raw``."""
    from hf2q.text.chat_template import ChatTemplate

    text = _prompt_text(args)
    if getattr(args, "raw", False):
        return tokenizer.encode(text, add_special=True)
    if getattr(args, "chat_template", None):
        template = ChatTemplate(args.chat_template, bos_token=_tok_text(tokenizer, tokenizer.bos_id),
                                eos_token=_tok_text(tokenizer, tokenizer.eos_id))
    elif getattr(args, "chat_template_file", None):
        try:
            source = Path(args.chat_template_file).read_text(encoding="utf-8")
        except OSError as e:
            raise InputError(f"cannot read --chat-template-file: {e.strerror}") from None
        template = ChatTemplate(source, bos_token=_tok_text(tokenizer, tokenizer.bos_id),
                                eos_token=_tok_text(tokenizer, tokenizer.eos_id))
    else:
        try:
            template = ChatTemplate.from_gguf(model_path)
        except InputError:
            log.warning("%s has no chat template; using the prompt as is (--raw)", model_path.name)
            return tokenizer.encode(text, add_special=True)
    kwargs = {"enable_thinking": False} if getattr(args, "no_thinking", False) else {}
    rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True, **kwargs)
    bos = _tok_text(tokenizer, tokenizer.bos_id)
    already_has_bos = bool(bos) and rendered.startswith(bos)
    return tokenizer.encode(rendered, add_special=not already_has_bos)


def _tok_text(tokenizer, tid) -> str | None:
    if tid is None:
        return None
    return tokenizer.token_bytes(int(tid)).decode("utf-8", errors="replace")


def _params(args):
    from hf2q.sched.contracts import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed)


def generate_once(runner, prompt: list[int], params, on_token=None, ignore_eos: bool = False,
                  draft_tokens: int = 0, drafter=None) -> dict:
    """Prefill + decode one request; returns counts and timings (seconds).

    ``draft_tokens`` > 0 decodes speculatively with drafts of up to that many tokens — the model's MTP
    head's when ``runner.drafts`` (``runner.enable_mtp()``), else n-gram ones; the result then also
    counts ``drafted_tokens`` and ``accepted_tokens``. ``drafter`` replaces the drafter: anything
    with ``append(token)`` / ``propose(k)`` (fed the prompt first).

    ``ignore_eos`` treats end-of-generation tokens as ordinary ones, so a decode benchmark runs the
    whole ``max_tokens`` budget on the same (pipelined or host) path instead of stopping early.

    Settings the device sampler covers run pipelined (``runner.decode_async``: step *n+1* is
    queued before step *n*'s token is read); penalties and biases take the host sampler.
    """
    if len(prompt) + 1 > runner.n_ctx:
        raise InputError(f"prompt of {len(prompt)} tokens does not fit the context of {runner.n_ctx} tokens")
    seq = runner.new_sequence()
    t0 = time.perf_counter()
    for i in range(0, len(prompt), PREFILL_CHUNK):
        logits = runner.prefill(seq, prompt[i:i + PREFILL_CHUNK])
    t1 = time.perf_counter()
    generated: list[int] = []
    budget = min(params.max_tokens, runner.n_ctx - len(prompt))

    stops = frozenset() if ignore_eos else frozenset(runner.eos_token_ids)
    spec = {"drafted_tokens": 0, "accepted_tokens": 0, "forwards": 0}
    if draft_tokens > 0:
        if drafter is None and getattr(runner, "drafts", False):
            from hf2q.engine.speculative import MtpDrafter

            drafter = MtpDrafter(runner, seq)
        elif drafter is None:
            from hf2q.engine.speculative import NgramDrafter

            drafter = NgramDrafter(prompt)
        else:
            for t in prompt:
                drafter.append(t)
        reason = _decode_speculative(runner, seq, logits, params, budget, generated, on_token, stops, drafter,
                                     draft_tokens, spec)
    else:
        pipelined = device_capable(params) and getattr(runner, "pipelines_decode", False)
        decode = _decode_pipelined if pipelined else _decode_host
        reason = decode(runner, seq, logits, params, budget, generated, on_token, stops)
    t2 = time.perf_counter()
    steps = max(len(generated) - 1, 0)  # tokens decoded after the first (prefill-sampled) one
    out = {"prompt_tokens": len(prompt), "generated_tokens": len(generated), "finish_reason": reason,
           "prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps,
           "prefill_tokens_per_sec": len(prompt) / (t1 - t0) if t1 > t0 else 0.0,
           "decode_tokens_per_sec": steps / (t2 - t1) if steps and t2 > t1 else 0.0, "tokens": generated}
    if draft_tokens > 0:
        out.update(drafted_tokens=spec["drafted_tokens"], accepted_tokens=spec["accepted_tokens"],
                   decode_forwards=spec["forwards"])
    return out


def _decode_speculative(runner, seq, logits, params, budget, generated, on_token, stops, drafter, k, spec) -> str:
    """Decode with drafts: one ``runner.verify`` forward per step over the pending token and the
    draft (a plain decode step when there is none), keeping the accepted tokens."""
    from hf2q.engine.sampling import Sampler
    from hf2q.engine.speculative import accept_draft, keep_accepted

    sampler = Sampler(params)
    emitted = [sampler.sample(logits, generated)[0]]
    while True:
        for token in emitted:
            reason = _accept(stops, token, generated, budget, on_token)
            drafter.append(token)
            if reason is not None:
                return reason
        pending = emitted[-1]  # sampled, not yet fed to the model
        room = min(k, budget - len(generated) - 1, runner.n_ctx - seq.length - 1)
        draft = drafter.propose(room)
        spec["forwards"] += 1
        if not draft:
            emitted = [sampler.sample(runner.decode([seq], [pending])[0], generated)[0]]
            continue
        start = seq.length
        rows = runner.verify(seq, [pending] + draft)
        emitted = accept_draft(sampler, draft, rows, generated)
        spec["drafted_tokens"] += len(draft)
        spec["accepted_tokens"] += len(emitted) - 1
        keep_accepted(runner, seq, start, [pending] + draft[:len(emitted) - 1])


def _decode_host(runner, seq, logits, params, budget, generated, on_token, stops) -> str:
    from hf2q.engine.sampling import Sampler
    from hf2q.engine.sampling.rows import sample

    sampler = Sampler(params)
    constraint = getattr(params, "constraint", None)  # json / forced tool calls: the server's masking too
    while True:
        token = sample(sampler, constraint, logits, generated).token_id
        reason = _accept(stops, token, generated, budget, on_token)
        if reason is not None:
            return reason
        logits = runner.decode([seq], [token])[0]


def _accept(stops, token: int, generated: list[int], budget: int, on_token) -> str | None:
    """Record a sampled token; ``"stop"`` (one of ``stops``, not emitted), ``"length"`` (emitted,
    budget spent) or None."""
    generated.append(token)
    if token in stops:
        return "stop"
    if on_token is not None:
        on_token(token)
    return "length" if len(generated) >= budget else None


def _decode_pipelined(runner, seq, logits, params, budget, generated, on_token, stops) -> str:
    """Step *k+2* is queued before token *k+1* is read; a stop read late trims the extra position."""
    import mlx.core as mx

    from hf2q.engine.sampling.device import DeviceSampler, sample_rows

    samplers = [DeviceSampler(params)]
    token = int(np.array(sample_rows(mx.array(np.asarray(logits, dtype=np.float32)[None]), samplers)[0])[0])
    reason = _accept(stops, token, generated, budget, on_token)
    if reason is not None:
        return reason
    pending = runner.decode_async([seq], [token], samplers)
    while True:
        ahead = runner.decode_async([seq], pending, samplers) if len(generated) + 1 < budget else None
        reason = _accept(stops, int(pending.result()[0][0]), generated, budget, on_token)
        if reason == "stop" and ahead is not None:
            seq.trim(seq.length - 1)  # the queued step consumed the stop token
        if reason is not None:
            return reason
        pending = ahead


def check_generative_model(model_path: Path):
    """The checks `info` runs (a servable GGUF of a known family, with a tokenizer), before anything
    heavy; returns the opened file for :func:`hf2q.engine.factory.load_runner`."""
    from hf2q.engine.models import FAMILIES
    from hf2q.formats.gguf_check import open_servable
    from hf2q.formats.gguf_keys import Keys

    header = open_servable(model_path)
    if header.arch not in FAMILIES:
        raise InputError(f"{model_path.name}: unsupported architecture {header.arch or '(none)'!r} "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    if not header.get(Keys.Tokenizer.MODEL) or not header.get(Keys.Tokenizer.LIST):
        raise InputError(f"{model_path.name}: no tokenizer metadata ({Keys.Tokenizer.MODEL} / tokens)")
    return header


def run(args) -> int:
    from hf2q.engine.factory import load_runner
    from hf2q.text.tokenizer import GGUFTokenizer, IncrementalDetokenizer

    if getattr(args, "json", False) and not getattr(args, "benchmark", False):
        from hf2q.errors import UsageError

        raise UsageError("--json needs --benchmark")
    if args.model:
        model_path = Path(args.model)
    else:
        from hf2q.fetch import default_chat_model

        model_path = default_chat_model()
    header = check_generative_model(model_path)
    tokenizer = GGUFTokenizer.from_gguf(model_path)
    prompt = render_prompt(args, model_path, tokenizer)
    from hf2q.engine.speculative import check_speculative

    check_speculative(header, args)  # before the weights load
    runner = load_runner(header, ctx=getattr(args, "ctx", None), kv_cache_type=getattr(args, "kv_cache_type", "f16"))
    if runner.is_embedding_model:
        raise InputError(f"{model_path.name} is an embedding model; generate needs a chat/text model")
    params = _params(args)
    ignore_eos = getattr(args, "ignore_eos", False)
    draft_tokens = _draft_tokens(args, runner)
    if draft_tokens and args.speculative == "mtp":
        from hf2q.engine.speculative import draft_model

        runner.enable_mtp(draft_model(args))  # deepseek4: the companion file's head, as the start-up check opened it

    if not args.benchmark:
        detok = IncrementalDetokenizer(tokenizer)
        out = sys.stdout

        def emit(token: int) -> None:
            out.write(detok.push(token))
            out.flush()

        stats = generate_once(runner, prompt, params, on_token=emit, ignore_eos=ignore_eos,
                              draft_tokens=draft_tokens)
        out.write(detok.flush() + "\n")
        out.flush()
        log.info("prompt %d tokens, generated %d; prefill %.1f tok/s, decode %.1f tok/s", stats["prompt_tokens"],
                 stats["generated_tokens"], stats["prefill_tokens_per_sec"], stats["decode_tokens_per_sec"])
        if draft_tokens:
            log.info("speculative: %s", _acceptance_text(stats))
        return 0

    runs = [generate_once(runner, prompt, params, ignore_eos=ignore_eos, draft_tokens=draft_tokens)
            for _ in range(BENCH_RUNS)]
    pre = np.array([r["prefill_tokens_per_sec"] for r in runs])
    dec = np.array([r["decode_tokens_per_sec"] for r in runs])
    gen = int(np.median([r["generated_tokens"] for r in runs]))
    print(f"model: {model_path.name}  prompt: {len(prompt)} tokens  generated: {gen} tokens  runs: {BENCH_RUNS}")
    print(f"prefill: median {np.median(pre):.1f} tok/s  p95 {np.percentile(pre, 95):.1f} tok/s")
    print(f"decode:  median {np.median(dec):.1f} tok/s  p95 {np.percentile(dec, 95):.1f} tok/s")
    summary = {"prompt_tokens": len(prompt), "generated_tokens": gen,
               "prefill_tokens_per_sec": round(float(np.median(pre)), 3),
               "decode_tokens_per_sec": round(float(np.median(dec)), 3)}
    if draft_tokens:
        print(f"speculative: {_acceptance_text(runs[-1])}")
        summary.update(speculative=args.speculative, draft_tokens=draft_tokens,
                       acceptance_rate=round(_acceptance_rate(runs[-1]), 4),
                       tokens_per_forward=round(_tokens_per_forward(runs[-1]), 3))
    if args.json:
        print(json.dumps(summary))
    return 0


def _draft_tokens(args, runner) -> int:
    """The draft length ``--speculative`` asks for (0: off); a usage error where it cannot apply."""
    from hf2q.engine.speculative import draft_tokens_arg
    from hf2q.errors import UsageError

    k = draft_tokens_arg(args)
    if k and not hasattr(runner, "verify"):
        raise UsageError(f"--speculative {args.speculative} is not supported by this engine ({type(runner).__name__})")
    return k


def _acceptance_rate(stats: dict) -> float:
    return stats["accepted_tokens"] / stats["drafted_tokens"] if stats["drafted_tokens"] else 0.0


def _tokens_per_forward(stats: dict) -> float:
    return stats["decode_steps"] / stats["decode_forwards"] if stats["decode_forwards"] else 0.0


def _acceptance_text(stats: dict) -> str:
    return (f"accepted {stats['accepted_tokens']} of {stats['drafted_tokens']} drafted tokens "
            f"({100 * _acceptance_rate(stats):.1f} %), {_tokens_per_forward(stats):.2f} tokens per forward")
