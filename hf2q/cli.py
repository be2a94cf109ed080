"""The one command-line parser for every ``hf2q`` command.

Each sub-command names the module function that runs it (``module:function``); the
function takes the parsed ``argparse.Namespace`` and returns an exit code. Modules are
imported only when their command runs, so ``hf2q convert`` never imports the server
and ``hf2q serve`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from hf2q import __version__
from hf2q.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, Hf2qError


def parse_size(text: str) -> int:
    """``512M``, ``4GiB``, ``1.5G``, ``1000000`` → bytes (binary multiples)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if s and s[-1] in mult:
            return int(float(s[:-1]) * mult[s[-1]])
        return int(s)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M, 8G)") from None


def _int_at_least(lo: int, refusal: str):
    """An argparse type: an integer ``>= lo``, else one line saying ``refusal``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{refusal}: {text!r}")
        return v
    return parse


_positive_int = _int_at_least(1, "must be positive")
_nonnegative_int = _int_at_least(0, "must not be negative")


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return v


def _positive_size(text: str) -> int:
    v = parse_size(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size: {text!r}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (README: exit codes)
        self.exit(EXIT_USAGE, f"hf2q: error: {message}\n")


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="convert a HuggingFace model to GGUF or an mlx-lm directory")
    p.set_defaults(handler="hf2q.convert.command:run")
    p.add_argument("src", nargs="?", help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--quant", "-q", help="quantization: f32 f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q2_k_s q3_k_s q3_k_m q3_k_l "
                   "q4_k_s q4_k_m q5_k_s q5_k_m q6_k, dynamic-q2|q3|q4, apex-quality|balanced|compact, apex-i-*; with --format mlx: mlx-2 … mlx-8, "
                   "mlx-mixed-2-6|3-4|3-6|4-6, dwq-3|dwq-4 (distilled); GGUF distilled: dwq-q4_1|dwq-q5_1")
    p.add_argument("-o", "--output", help="output GGUF path or mlx directory")
    p.add_argument("--format", choices=["gguf", "mlx"], default=None, help="output format (default gguf)")
    p.add_argument("--repo", help="Hub model id to fetch into the cache instead of SRC")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument("--dry-run", action="store_true", help="print the tensor → type → bytes plan and exit")
    p.add_argument("--imatrix", help="importance matrix (llama.cpp .imatrix / .gguf)")
    p.add_argument("--imatrix-corpus", metavar="FILE|NAME",
                   help="compute the importance matrix first, over this text file or shipped corpus (calibration)")
    p.add_argument("--imatrix-out", metavar="PATH", help="with --imatrix-corpus: keep the computed matrix here")
    p.add_argument("--imatrix-n-ctx", type=_int_at_least(16, "must be at least 16"), default=None, metavar="N",
                   help="with --imatrix-corpus: tokens per chunk (default 512)")
    p.add_argument("--imatrix-chunks", type=_positive_int, default=None, metavar="N",
                   help="with --imatrix-corpus: use only the first N chunks (llama-imatrix --chunks)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--no-mtp", action="store_true", help="leave out the multi-token-prediction head (Qwen 3.5)")
    m.add_argument("--mtp", action="store_true",
                   help="write only the multi-token-prediction head, as a speculative draft model (Qwen 3.5)")
    p.add_argument("--mmproj", action="store_true",
                   help="also write the vision tower as llama.cpp's mmproj GGUF (Qwen3-VL; F16 unless --quant is "
                   "f32, bf16 or q8_0)")
    p.add_argument("--mmproj-output", metavar="PATH", help="with --mmproj: its path (default beside the output: "
                   "mmproj-NAME-TYPE.gguf)")
    p.add_argument("--threads", type=_positive_int, default=None, help="worker threads (default: all cores)")
    p.add_argument("--json-report", help="write the conversion report here (default: OUTPUT.report.json)")
    p.add_argument("--no-integrity", action="store_true", help="skip sha256 hashing of inputs")
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=None, help="mlx group size (64)")
    p.add_argument("--dwq-corpus", help="DWQ calibration text: a file or a shipped corpus name (calibration)")
    p.add_argument("--dwq-steps", type=int, default=None, help="DWQ optimizer steps, one training row each (32)")
    p.add_argument("--dwq-lr", type=float, default=None, help="DWQ Adam learning rate (1e-4)")
    p.add_argument("--dwq-seq-len", type=int, default=None, help="DWQ tokens per training row (32)")
    p.add_argument("--batch", help="TOML/JSON plan of sources × quants × formats")
    p.add_argument("--jobs", type=_positive_int, default=1, help="parallel conversions in --batch mode")
    p.add_argument("--keep-going", action="store_true", help="in --batch mode, continue after a failure")
    p.add_argument("--cache-dir", help="model cache for --repo (default ~/.cache/hf2q)")
    p.add_argument("--quality", action="store_true",
                   help="after a GGUF conversion, score it against the source (hf2q quality) into the report")
    p.add_argument("--quality-corpus", metavar="FILE|NAME", default=None,
                   help="text for --quality (default: the shipped calibration corpus)")
    p.add_argument("--quality-n-ctx", type=_int_at_least(4, "must be at least 4"), default=512, metavar="N",
                   help="tokens per chunk for --quality (default 512)")


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="static preflight of a GGUF: family, quant mix, KV bytes, serve support")
    p.set_defaults(handler="hf2q.info:run")
    p.add_argument("model", help="path to a .gguf file")
    p.add_argument("--ctx", type=_positive_int, default=None, help="per-slot context (default: from GGUF)")
    p.add_argument("--slots", type=_positive_int, default=4)
    p.add_argument("--kv-cache-budget", type=parse_size, default=None, help="shared KV budget, e.g. 8G")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_kv_cache_type(p)


def _add_sampling(p) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="run one prompt locally (no HTTP)")
    p.set_defaults(handler="hf2q.engine.generate:run")
    p.add_argument("--model", help="GGUF path (default: the built-in default model)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-file", help="read the prompt from this file")
    _add_sampling(p)
    t = p.add_mutually_exclusive_group()
    t.add_argument("--chat-template", help="override the GGUF's chat template (inline Jinja)")
    t.add_argument("--chat-template-file", help="override the GGUF's chat template (file)")
    p.add_argument("--no-thinking", action="store_true", help="render the template with enable_thinking=false")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--ctx", type=_positive_int, default=None, help="context length (default: from GGUF)")
    p.add_argument("--benchmark", action="store_true", help="5 runs; report median and p95 tok/s")
    p.add_argument("--json", action="store_true", help="with --benchmark: last line is one JSON object")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past end-of-generation tokens up to --max-tokens (for benchmarks)")
    _add_speculative(p)
    _add_kv_cache_type(p)


def _add_kv_cache_type(p) -> None:
    from hf2q.engine.kv_layout import KV_CACHE_TYPES

    p.add_argument("--kv-cache-type", choices=KV_CACHE_TYPES, default="f16",
                   help="how the live KV cache stores K/V: f16 (the compute dtype), q8 (8-bit with a scale per "
                        "64 values, about half the bytes), q8-rotated (the same after a Hadamard rotation of "
                        "each head: less error); docs/ENGINE.md")


def _add_speculative(p) -> None:
    p.add_argument("--speculative", choices=["ngram", "mtp", "off"], default="off",
                   help="verify several drafted tokens per forward; ngram: drafts from earlier context (prompt "
                        "lookup); mtp: from the model's multi-token-prediction head (Qwen 3.5 / 3.6; DeepSeek-V4 "
                        "with --model-draft)")
    p.add_argument("--model-draft", default=None, metavar="FILE",
                   help="with --speculative mtp on DeepSeek-V4: its MTP head, the GGUF `hf2q convert --mtp` writes "
                        "(llama.cpp's --mtp file)")
    p.add_argument("--draft-tokens", type=_positive_int, default=None, metavar="K",
                   help="with --speculative: most tokens drafted per forward (default 6 for ngram, 3 for mtp)")


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="talk to a model in the terminal (loaded here, or a running server with --url)")
    p.set_defaults(handler="hf2q.chat:run")
    p.add_argument("--model", help="GGUF to load in this process (default: the built-in default model)")
    p.add_argument("--url", help="a running server's API base, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default=os.environ.get("HF2Q_API_KEY"), help="Bearer key for --url (or HF2Q_API_KEY)")
    p.add_argument("--system", help="system message (change it later with /system TEXT)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    p.add_argument("--max-tokens", type=_positive_int, default=None, help="tokens per reply (default: the room left)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-thinking", action="store_true", help="render the template with enable_thinking=false")
    p.add_argument("--tools", metavar="FILE", help="JSON array of OpenAI-style tool definitions to offer the model")
    p.add_argument("--tool-choice", metavar="auto|required|none|NAME", help="with --tools: whether (or which) a "
                   "call is forced (default: the model decides)")
    p.add_argument("--ctx", type=_positive_int, default=None, help="in-process context length (default: from GGUF)")
    _add_kv_cache_type(p)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.set_defaults(handler="hf2q.api.several:run_serve")  # one model: hf2q.api.command:run
    p.add_argument("--model", action="append", help="GGUF path (default: the built-in default model); repeat it "
                   "to serve several models, loaded on demand within --models-memory (docs/API.md)")
    p.add_argument("--models-memory", type=_positive_size, default=None,
                   help="memory the resident models may use together (weights + KV), e.g. 2G (default: the "
                        "--memory-limit); the least recently used idle model is evicted to load another")
    p.add_argument("--models-wait", type=_positive_seconds, default=10.0,
                   help="seconds a request waits for room in --models-memory before 429 (several models)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--slots", type=_positive_int, default=4)
    p.add_argument("--ctx", type=_positive_int, default=None, help="per-slot context (default: from GGUF)")
    p.add_argument("--kv-cache-budget", type=_positive_size, default=None, help="shared KV budget, e.g. 8G")
    p.add_argument("--queue-capacity", type=_nonnegative_int, default=32,
                   help="requests that may wait for a slot (0: none wait)")
    p.add_argument("--api-key", default=os.environ.get("HF2Q_API_KEY"), help="Bearer key (or HF2Q_API_KEY)")
    p.add_argument("--cors-origin", action="append", default=[], help="allowed CORS origin (repeatable)")
    p.add_argument("--embedding-model", help="GGUF of an embedding model (e.g. MiniLM) for /v1/embeddings")
    p.add_argument("--kv-persist", help="directory of the persistent prefix KV cache")
    p.add_argument("--kv-persist-budget", type=parse_size, default=None, help="disk budget, e.g. 20G")
    p.add_argument("--kv-persist-payload", choices=["kv", "kv-f16", "kv-q8"], default="kv",
                   help="how blocks are stored: kv (as the engine holds them; restores bit-exact), kv-f16 (half "
                        "the disk of a float32 CPU cache; restores within float16 rounding), kv-q8 (8-bit rows)")
    p.add_argument("--operator-ui", choices=["auto", "dashboard", "plain"], default="auto")
    p.add_argument("--prefill-chunk", type=_positive_int, default=None,
                   help="tokens per prefill transaction (default: the model family's, 4096 for Gemma 4, else 2048)")
    p.add_argument("--gpu-deadline", type=_positive_seconds, default=120.0,
                   help="seconds before a GPU step is declared hung")
    p.add_argument("--max-request-bytes", type=_positive_size, default=64 << 20)
    p.add_argument("--tensor-parallel", type=_positive_int, default=1, help="ranks (mx.distributed)")
    _add_tp_hosts(p)  # a group across machines: mlx.launch's hostfile, one rank per host
    p.add_argument("--memory-limit", type=parse_size, default=None,
                   help="memory one rank may use for weights + KV, e.g. 40G (default: 90%% of the device)")
    p.add_argument("--model-name", default=None, help="id reported by /v1/models (default: file stem)")
    p.add_argument("--mmproj", metavar="FILE", help="vision projector GGUF for image input (Qwen3-VL; default: an "
                   "mmproj-*.gguf beside the model whose projector fits it; docs/API.md, Images)")
    _add_speculative(p)  # a request decoding alone verifies drafts; concurrent requests decode batched
    _add_kv_cache_type(p)


def _add_tp_hosts(p, required: bool = False) -> None:
    where = p.add_mutually_exclusive_group(required=required)
    where.add_argument("--hostfile", help="mlx.launch hostfile (JSON): host r is rank r; rank 0 runs `hf2q serve`, "
                                          "the others `hf2q tp-follower` (docs/TENSOR_PARALLEL.md)")
    where.add_argument("--hosts", help="the same as a comma list of host names or IPs, rank 0 first")
    p.add_argument("--tp-port", type=_positive_int, default=32323,
                   help="base port with --hostfile: ring P+rank, NCCL P, rank 0's control P+N")
    p.add_argument("--tp-timeout", type=_positive_seconds, default=600.0,
                   help="seconds for every rank to join and load (--hostfile)")


def _add_tp_follower(sub) -> None:
    p = sub.add_parser("tp-follower", help="one tensor-parallel rank on another machine, for `hf2q serve --hostfile`")
    p.set_defaults(handler="hf2q.engine.tp_launch:follower_command")
    _add_tp_hosts(p, required=True)
    p.add_argument("--rank", type=_positive_int, required=True, help="this host's index in the hostfile (1..N-1)")
    p.add_argument("model", help="this host's copy of the GGUF rank 0 serves")


def _add_diagrams(sub) -> None:
    p = sub.add_parser("diagrams", help="export every declared state machine")
    p.set_defaults(handler="hf2q.statemachines.export:run")
    p.add_argument("--format", choices=["mermaid", "dot", "svg"], default="mermaid")
    p.add_argument("-o", "--output", help="directory to write one file per machine (default: stdout)")
    p.add_argument("--machine", help="only this machine")


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="environment checks")
    p.set_defaults(handler="hf2q.doctor:run")
    p.add_argument("--json", action="store_true")


def _add_cache(sub) -> None:
    p = sub.add_parser("cache", help="manage the model cache and the persistent KV store")
    p.set_defaults(handler="hf2q.kvstore.command:run")
    p.add_argument("action", choices=["list", "size", "clear"])
    p.add_argument("--kv-path", help="persistent KV store directory (else: the model cache)")
    p.add_argument("--cache-dir", help="model cache (default ~/.cache/hf2q)")
    p.add_argument("--yes", action="store_true", help="do not ask before clearing")


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"not true or false: {text!r}")
    return low == "true"


def _add_gguf_patch(sub) -> None:
    p = sub.add_parser("gguf-patch", help="change a GGUF's metadata (chat template, BOS/EOS, any scalar key) "
                       "without touching its tensors")
    p.set_defaults(handler="hf2q.gguf_patch:run")
    p.add_argument("file", nargs="?", help="the .gguf to patch (rewritten in place unless -o)")
    p.add_argument("-o", "--output", help="write the patched copy here instead")
    tpl = p.add_mutually_exclusive_group()
    tpl.add_argument("--chat-template", metavar="FILE", help="set the chat template from this Jinja file")
    tpl.add_argument("--chat-template-name", metavar="NAME",
                     help="set one of the official templates llama.cpp ships, e.g. Qwen-Qwen3-0.6B")
    tpl.add_argument("--list-chat-templates", action="store_true", help="print the official template names and exit")
    p.add_argument("--set", action="append", metavar="KEY[:TYPE]=VALUE",
                   help="set a scalar key (repeatable); an existing key keeps its type, a new one takes TYPE "
                        "(u8 i8 u16 i16 u32 i32 u64 i64 f32 f64 bool str) or a guess from VALUE")
    p.add_argument("--drop", action="append", metavar="KEY", help="remove a key (repeatable)")
    p.add_argument("--add-bos", type=_bool, metavar="true|false", help="whether the tokenizer prepends BOS")
    p.add_argument("--add-eos", type=_bool, metavar="true|false", help="whether the tokenizer appends EOS")
    p.add_argument("--bos-id", type=_nonnegative_int, metavar="N", help="BOS token id")
    p.add_argument("--eos-id", type=_nonnegative_int, metavar="N", help="EOS token id")
    p.add_argument("--dry-run", action="store_true", help="print the changes (key: old → new); write nothing")


def _add_imatrix(sub) -> None:
    p = sub.add_parser("imatrix", help="compute an importance matrix (llama.cpp .imatrix.gguf) by running a model "
                       "over calibration text")
    p.set_defaults(handler="hf2q.quality.imatrix_command:run")
    p.add_argument("model", help="a GGUF file, or an HF checkpoint directory (converted to a temporary F16 GGUF)")
    p.add_argument("--corpus", default="calibration", metavar="FILE|NAME",
                   help="calibration text: a UTF-8 file or a shipped corpus name (default: calibration)")
    p.add_argument("-o", "--output", required=True, help="where to write the .imatrix.gguf")
    p.add_argument("--n-ctx", type=_int_at_least(16, "must be at least 16"), default=512,
                   help="tokens per chunk; each chunk starts a fresh context (default 512)")
    p.add_argument("--chunks", type=_positive_int, default=None, help="use only the first N chunks")
    p.add_argument("--threads", type=_positive_int, default=None, help="converter threads for an HF checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON summary object")


def _add_quality(sub) -> None:
    p = sub.add_parser("quality",
                       help="perplexity, KL divergence and top-1 agreement of a conversion against its source")
    p.set_defaults(handler="hf2q.quality.quality_command:run")
    p.add_argument("converted", metavar="CONVERTED", help="the converted model: a GGUF or an mlx-lm directory")
    p.add_argument("--reference", required=True, metavar="SOURCE",
                   help="the reference: an HF checkpoint directory (run as a temporary F16 GGUF) or a GGUF")
    p.add_argument("--corpus", metavar="FILE|NAME", default=None,
                   help="evaluation text: a UTF-8 file or a shipped corpus name (default: calibration)")
    p.add_argument("--n-ctx", type=_int_at_least(4, "must be at least 4"), default=512,
                   help="tokens per chunk; the second half of each is scored (default 512)")
    p.add_argument("--chunks", type=_positive_int, default=None, help="score at most this many chunks (default all)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON")


def _add_smoke_parity(sub) -> None:
    p = sub.add_parser("smoke", help="a chat model's end-gate prompts (a fact, a tool call, JSON, long recall), "
                       "each with its pass rule; exit 1 on a failure")
    p.set_defaults(handler="hf2q.smoke:run")
    p.add_argument("model", nargs="?", help="GGUF path (default: the built-in default model)")
    p.add_argument("--prompts", metavar="FILE", help="a JSON array of smoke cases instead of the family's "
                   "(docs/SMOKE.md describes the shape)")
    p.add_argument("--ctx", type=_positive_int, default=None, metavar="N", help="context length (default: from GGUF)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default off a terminal)")
    p = sub.add_parser("parity", help="capture a reference's top-k logits and greedy tokens, or compare a GGUF "
                       "on this engine against a capture")
    p.set_defaults(handler="hf2q.parity:run")
    p.add_argument("model", nargs="?", help="the GGUF (compared, or run by --reference llama.cpp|hf2q)")
    p.add_argument("--reference", metavar="PATH|llama.cpp|hf2q",
                   help="with --capture: an HF checkpoint directory (transformers, float32), stock llama.cpp "
                        "(llama-server) on MODEL, or this engine on MODEL")
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--capture", metavar="OUT", help="write the reference's capture here (JSON)")
    m.add_argument("--compare", metavar="FILE", help="compare MODEL against this capture; exit 1 beyond tolerance")
    p.add_argument("--tokens", type=_positive_int, default=16, metavar="N",
                   help="greedy tokens per prompt (default 16)")
    p.add_argument("--top-k", type=_positive_int, default=10, metavar="K", help="top-k recorded per step (default 10)")
    p.add_argument("--ctx", type=_positive_int, default=2048, metavar="N", help="context length (default 2048)")
    p.add_argument("--llama-cpp", metavar="DIR", help="directory holding llama-server (else $HF2Q_LLAMA_CPP, "
                   "the cache's llama.cpp-build/bin, PATH)")
    p.add_argument("--min-top1", type=float, default=0.9, metavar="FRACTION",
                   help="least top-1 agreement (default 0.9)")
    p.add_argument("--min-topk-overlap", type=float, default=0.8, metavar="FRACTION",
                   help="least mean top-k overlap (default 0.8)")
    p.add_argument("--max-logprob-diff", type=float, default=1.0, metavar="NATS",
                   help="largest log-probability difference on the reference's top-k (default 1.0)")
    p.add_argument("--max-logit-diff", type=float, default=1.0, metavar="X",
                   help="largest raw-logit difference, where the capture has logits (default 1.0)")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default off a terminal)")


def _add_completions(sub) -> None:
    p = sub.add_parser("completions", help="print a shell completion script")
    p.set_defaults(handler="hf2q.completions:run")
    p.add_argument("shell", choices=["bash", "zsh", "fish"])


DESCRIPTION = ("Convert HuggingFace models to quantized GGUF files or mlx-lm directories,\n"
               "and serve GGUFs through an OpenAI-compatible HTTP API.")
EPILOG = """\
examples:
  hf2q convert ./model --quant q4_k_m -o model-q4_k_m.gguf
  hf2q serve --model model-q4_k_m.gguf --slots 4
  hf2q serve                      (the built-in default model)
  hf2q chat --url http://127.0.0.1:8080/v1

exit codes: 0 ok, 1 runtime failure, 2 usage, 3 bad input, 130 interrupted.
Run 'hf2q COMMAND --help' for a command's options; the README and docs/ hold the rest."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hf2q", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hf2q {__version__}")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug + tracebacks")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--log-level", choices=["debug", "info", "warn", "error"], default=None)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in (_add_convert, _add_info, _add_generate, _add_chat, _add_serve, _add_diagrams, _add_doctor, _add_cache,
                _add_gguf_patch, _add_imatrix, _add_quality, _add_smoke_parity, _add_completions, _add_tp_follower):
        add(sub)
    return p


def _resolve(handler: str):
    module, _, func = handler.partition(":")
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    from hf2q.logs import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level, args.verbose)
    log = logging.getLogger("hf2q")
    try:
        return int(_resolve(args.handler)(args) or 0)
    except Hf2qError as e:
        if args.verbose >= 2:
            log.exception("failed")
        print(f"hf2q: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("hf2q: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_FAILURE
    except Exception as e:  # noqa: BLE001 — the one place that turns bugs into one line
        if args.verbose >= 2:
            log.exception("internal error")
        print(f"hf2q: error: internal error: {type(e).__name__}: {e} (rerun with -vv for a traceback)",
              file=sys.stderr)
        return EXIT_FAILURE
