"""Word-splitting rules for GPT-2-style BPE vocabularies, keyed by ``tokenizer.ggml.pre``.

A GGUF does not carry its pre-tokenizer; it names it, and every runtime keeps a table
of what each name means. The expressions below are the ones the original HF
``tokenizer.json`` files use (the same split llama.cpp reproduces by name), applied in
order: each expression splits the pieces the previous one produced and keeps both the
matches and the text between them ("isolated"), which is exactly what a sequence of
``tokenizers`` ``Split(..., behavior="isolated")`` pre-tokenizers does.
"""

from __future__ import annotations

import attrs

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    (
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
)
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    r"\p{N}+",
)


@attrs.frozen
class PreTokenizerRule:
    #: expressions applied in order, each splitting the previous pieces ("isolated")
    patterns: tuple[str, ...]
    #: a whole word that is itself a token is emitted without running merges
    ignore_merges: bool = False
    #: map bytes to the GPT-2 printable alphabet before BPE (False: raw UTF-8 pieces)
    byte_encode: bool = True
    #: replace spaces with U+2581 before splitting (SentencePiece-style BPE)
    escape_whitespace: bool = False
    #: prepend BOS by default when the GGUF does not say
    default_add_bos: bool = False


_DEFAULT = PreTokenizerRule(
    (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
)

_RULES: dict[str, PreTokenizerRule] = {}


def _register(names: str, rule: PreTokenizerRule) -> None:
    for name in names.split():
        _RULES[name] = rule


_register("default", _DEFAULT)
_register(
    "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
    PreTokenizerRule((_LLAMA3,), ignore_merges=True, default_add_bos=True),
)
_register("dbrx smaug-bpe", PreTokenizerRule((_LLAMA3,)))
_register("chatglm-bpe", PreTokenizerRule((_LLAMA3,)))
_register("glm4 glm5", PreTokenizerRule((_LLAMA3,), ignore_merges=True))
_register("deepseek-llm", PreTokenizerRule(_DEEPSEEK_LLM))
_register(
    "deepseek-coder",
    PreTokenizerRule((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+", r"\p{N}")),
)
_register("deepseek-v3 hunyuan-dense joyai-llm hy-v4", PreTokenizerRule(_DEEPSEEK3))
_register("falcon", PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")))
_register(
    "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
    PreTokenizerRule((r"\p{N}", _GPT2)),
)
_register(
    "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert mpt olmo jais "
    "trillion granite-docling exaone4 jina-v1-en jina-v2-code roberta-bpe",
    PreTokenizerRule((_GPT2,)),
)
_register("qwen2 deepseek-r1-qwen kormo f2llmv2 stablelm2 megrez hunyuan solar-open", PreTokenizerRule((_QWEN2,)))
_register("qwen35", PreTokenizerRule((_QWEN35,)))
_register("tekken", PreTokenizerRule((_TEKKEN,), ignore_merges=True, default_add_bos=True))
_register("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizerRule((_GPT4O,)))
_register("poro-chat bloom gpt3-finnish", PreTokenizerRule((r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+",)))
_register("viking", PreTokenizerRule((r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+", r"\p{N}")))
_register(
    "minicpm5",
    PreTokenizerRule(
        (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
        ignore_merges=True,
    ),
)
_register(
    "gemma4 granite-embed-multi-311m sarvam-moe",
    PreTokenizerRule((r"[^\n]+|[\n]+",), byte_encode=False, escape_whitespace=True, default_add_bos=True),
)
_register("whitespace", PreTokenizerRule((r"\S+",), byte_encode=False))


def rule_for(pre: str | None) -> PreTokenizerRule | None:
    """The rule for a ``tokenizer.ggml.pre`` name; None when the name is unknown."""
    if not pre:
        return _DEFAULT
    return _RULES.get(pre)


def known_names() -> list[str]:
    return sorted(_RULES)
