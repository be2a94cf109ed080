"""Does a restored slot continue like the engine would have? Per KV payload kind, on the real engine.

For each prompt (pieces of llama.cpp's own markdown files: 2 blocks + 37 tokens) the engine
prefills it three ways — cold (one transaction), live (the 2 blocks, then the tail: what a
server that persisted them did) and restored (the live slot's 2 exported blocks written to
and read back from a store opened with ``payload_kind`` ``kv`` / ``kv-f16`` / ``kv-q8``,
imported into a fresh sequence, then the tail) — and decodes ``--tokens`` greedy tokens from
each. Prints one JSON object: block file bytes per kind, and per kind how many prompts restore
bit for bit (logits equal to the live slot's), how many give the cold run's greedy tokens, and
the largest logit difference.

    PYTHONPATH=. python bench/kvpayload_identity.py --tokens 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock

TAIL = 37
DOCS = ("README.md", "CONTRIBUTING.md", "SECURITY.md", "AGENTS.md")


def through_store(store: BlockStore, prompt: list[int], index: int, arrays: dict) -> tuple[dict, int]:
    """``arrays`` written as block ``index`` of ``prompt`` and read back (verified); and the file's bytes."""
    span = store.spans(prompt)[index]
    meta = store.write(KVBlock.from_span(span, prompt, arrays)) or store.longest_prefix(prompt)[index]
    return store.read(meta), meta.file_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.fetch import LLAMA_CPP_SDIST, SMOLLM2, fetch
    from hf2q.text.tokenizer import GGUFTokenizer

    path = str(fetch(SMOLLM2))
    runner = MlxModelRunner.load(path, ctx=2048)
    tok = GGUFTokenizer.from_gguf(path)
    root = Path(fetch(LLAMA_CPP_SDIST))

    def greedy(seq, logits):
        out = []
        for _ in range(args.tokens):
            out.append(int(np.argmax(logits)))
            logits = runner.decode([seq], [out[-1]])[0]
        return out

    kinds = ("kv", "kv-f16", "kv-q8")
    rows = {k: {"bit_exact": 0, "tokens_equal_cold": 0, "max_abs_logit_diff": 0.0} for k in kinds}
    block_bytes, n, chunking = {}, 0, 0.0
    for name in DOCS:
        ids = tok.encode((root / name).read_text("utf-8"), add_special=False)[:2 * BLOCK_TOKENS + TAIL]
        if len(ids) < 2 * BLOCK_TOKENS + TAIL:
            continue
        n += 1
        cold = runner.new_sequence()
        cold_logits = runner.prefill(cold, ids)
        cold_tokens = greedy(cold, cold_logits)
        live = runner.new_sequence()
        runner.prefill(live, ids[:2 * BLOCK_TOKENS])
        live_logits = runner.prefill(live, ids[2 * BLOCK_TOKENS:])
        chunking = max(chunking, float(np.abs(live_logits - cold_logits).max()))
        blocks = [runner.export_kv(live, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS) for i in range(2)]
        for kind in kinds:
            seq = runner.new_sequence()
            with tempfile.TemporaryDirectory() as tmp, BlockStore.open(tmp, "f" * 64, payload_kind=kind) as store:
                for i, arrays in enumerate(blocks):
                    back, block_bytes[kind] = through_store(store, ids, i, arrays)
                    runner.import_kv(seq, back, BLOCK_TOKENS)
            logits = runner.prefill(seq, ids[2 * BLOCK_TOKENS:])
            r = rows[kind]
            r["bit_exact"] += int(np.array_equal(logits, live_logits))
            r["tokens_equal_cold"] += int(greedy(seq, logits) == cold_tokens)
            r["max_abs_logit_diff"] = max(r["max_abs_logit_diff"], float(np.abs(logits - live_logits).max()))
    print(json.dumps({"engine": runner.kv_identity, "prompts": n, "tokens": args.tokens,
                      "live_vs_cold_max_abs_logit_diff": chunking, "block_file_bytes": block_bytes,
                      "payloads": rows}, indent=1))


if __name__ == "__main__":
    main()
