"""A tiny nomic-embed-text-v2-moe checkpoint (``NomicBertModel`` with MoE layers), in the Hub layout.

The Hub checkpoint runs custom code, so it is built here from seeded numpy weights under the Hub's
names: ``encoder.layers.N.attn.Wqkv`` (+ bias), ``attn.out_proj``, ``norm1``/``norm2``, ``emb_ln``;
dense layers ``mlp.fc1``/``mlp.fc2`` (GELU, biased); every ``moe_every_n_layers``-th layer (N % 2 == 1)
a router ``mlp.router.layer`` and the experts fused as ``mlp.experts.mlp.w1`` / ``w2`` (both
``[experts·ff, d]``) and an ``mlp.experts.bias`` that llama.cpp drops. hidden 32 ≠ ff 48 ≠ 2·ff.

Tokenizer: an XLM-R style SentencePiece Unigram model trained here (``sentencepiece`` trainer on
hf2q's calibration text, NMT-NFKC charsmap) saved as ``sentencepiece.bpe.model`` plus the
``tokenizer.json`` transformers derives from it. llama.cpp's converter writes ``<mask>`` at id
250001, so the embedding has the real model's 250048 rows (the pieces past the trained ones are
``[PAD…]`` padding).

The config carries the Hub keys (n_embd, n_inner, rotary_emb_base, layer_norm_epsilon, …) and, with
the same values, transformers' ``NomicBertConfig`` names: llama.cpp's converter loads the config
through that class and prefers its keys. ``max_position_embeddings`` is 514: the converter subtracts
the XLM-R position offset (pad id + 1) from it, which gives the 512 trained positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.models.cache import build_once

VERSION = "v1"
SEED = 7
SHAPE = {"n_embd": 32, "n_head": 4, "n_inner": 48, "n_layer": 2, "num_experts": 4, "moe_top_k": 2,
         "moe_every_n_layers": 2, "vocab_size": 250048, "rotary_emb_base": 10000, "layer_norm_epsilon": 1e-5}
_TRANSFORMERS_KEYS = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 48, "num_hidden_layers": 2,
                      "max_position_embeddings": 514, "layer_norm_eps": 1e-5,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
SP_PIECES = 400


def nomic_moe() -> Path:
    """Path of the tiny nomic-embed-text-v2-moe-shaped checkpoint (built on first use)."""
    return build_once(f"tiny-nomic_bert_moe-{VERSION}", _build)


def moe_layers(n_layer: int, every: int) -> list[int]:
    """The blocks whose MLP is the expert mixture (llama.cpp: ``il % every == 1``)."""
    return [i for i in range(n_layer) if every > 0 and i % every == 1]


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    d, ff, e, v = SHAPE["n_embd"], SHAPE["n_inner"], SHAPE["num_experts"], SHAPE["vocab_size"]

    def mat(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def vec(n, around=0.0):
        return (around + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"embeddings.word_embeddings.weight": rng.standard_normal((v, d)).astype(np.float32),
         "embeddings.token_type_embeddings.weight": mat(1, d, scale=3.0),
         "emb_ln.weight": vec(d, 1.0), "emb_ln.bias": vec(d)}
    moe = set(moe_layers(SHAPE["n_layer"], SHAPE["moe_every_n_layers"]))
    for i in range(SHAPE["n_layer"]):
        p = f"encoder.layers.{i}."
        w[p + "attn.Wqkv.weight"], w[p + "attn.Wqkv.bias"] = mat(3 * d, d), vec(3 * d)
        w[p + "attn.out_proj.weight"], w[p + "attn.out_proj.bias"] = mat(d, d), vec(d)
        for norm in ("norm1", "norm2"):
            w[p + norm + ".weight"], w[p + norm + ".bias"] = vec(d, 1.0), vec(d)
        if i in moe:
            w[p + "mlp.router.layer.weight"] = mat(e, d, scale=3.0)
            w[p + "mlp.experts.mlp.w1"] = mat(e * ff, d)
            w[p + "mlp.experts.mlp.w2"] = (rng.standard_normal((e * ff, d)) / np.sqrt(ff)).astype(np.float32)
            w[p + "mlp.experts.bias"] = vec(d)
        else:
            w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"] = mat(ff, d), vec(ff)
            w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"] = mat(d, ff), vec(d)
    return w


def _train_sentencepiece(out: Path) -> None:
    import sentencepiece as spm

    from hf2q.quality.corpus import load_corpus

    text = load_corpus("calibration").text
    lines = [ln for ln in text.splitlines() if ln.strip()] + ["café naïve ｈｅｌｌｏ ① ﬁ 日本語 中文 한국어 Ünïcödé"]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(out / "sentencepiece.bpe"),
                                   vocab_size=SP_PIECES, model_type="unigram", character_coverage=1.0,
                                   normalization_rule_name="nmt_nfkc", num_threads=1, minloglevel=2)
    (out / "sentencepiece.bpe.vocab").unlink()


def _tokenizer_files(out: Path) -> None:
    """``tokenizer.json`` as transformers converts an XLM-R sentencepiece model, ``tokenizer_config.json``
    as it saves one (the Hub repo's five special tokens, ``<mask>`` stripping the space before it)."""
    import transformers
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import XLMRobertaConverter

    class _Slow:
        vocab_file = str(out / "sentencepiece.bpe.model")

        @staticmethod
        def convert_tokens_to_ids(token):
            return {"<s>": 0, "</s>": 2}[token]

    fast = XLMRobertaConverter(_Slow()).converted()
    fast.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<unk>")]
                            + [AddedToken("<mask>", special=True, normalized=False, lstrip=True)])
    tmp = out / "tok"
    transformers.XLMRobertaTokenizer(vocab_file=_Slow.vocab_file).save_pretrained(tmp)
    (out / "tokenizer_config.json").write_bytes((tmp / "tokenizer_config.json").read_bytes())
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    fast.save(str(out / "tokenizer.json"))


def _build(out: Path) -> None:
    from safetensors.numpy import save_file

    from tests.models.tiny import _write_sentence_transformers_files

    save_file(_weights(), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", **SHAPE, **_TRANSFORMERS_KEYS,
           "auto_map": {"AutoConfig": "nomic-ai/nomic-bert-2048--configuration_hf_nomic_bert.NomicBertConfig",
                        "AutoModel": "nomic-ai/nomic-bert-2048--modeling_hf_nomic_bert.NomicBertModel"},
           "activation_function": "gelu", "add_pooling_layer": False, "attn_pdrop": 0.0, "bos_token_id": None,
           "causal": False, "dense_seq_output": True, "embd_pdrop": 0.0, "eos_token_id": None,
           "expert_choice_router": False, "ffn_div": 1, "fused_bias_fc": True, "fused_dropout_add_ln": True,
           "initializer_range": 0.02, "max_trained_positions": 2048, "mlp_fc1_bias": True, "mlp_fc2_bias": True,
           "moe_impl": "megablocks", "moe_normalize_expert_weights": False, "moe_resid_pdrop": 0.0,
           "n_positions": 2048, "num_shared_experts": 0, "pad_token_id": 1, "pad_vocab_size_multiple": 64,
           "parallel_block": False, "parallel_block_tied_norm": False, "prenorm": False, "qkv_proj_bias": True,
           "reorder_and_upcast_attn": False, "resid_pdrop": 0.0, "rotary_emb_fraction": 1.0,
           "rotary_emb_interleaved": False, "rotary_emb_scale_base": None, "rotary_scaling_factor": None,
           "router_aux_loss_coef": 0.1, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
           "torch_dtype": "float32", "type_vocab_size": 1, "use_cache": True, "use_flash_attn": True,
           "use_rms_norm": None, "use_xentropy": True}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    _train_sentencepiece(out)
    _tokenizer_files(out)
    _write_sentence_transformers_files(out, SHAPE["n_embd"])


def nomic_moe_tokenizer_json_only() -> Path:
    """The same checkpoint without ``sentencepiece.bpe.model``: its ``tokenizer.json`` with the charsmap as a
    top-level ``Precompiled`` normaliser (the form of the Hub's XLM-R files), and a ``tokenizer_config.json``
    that leaves ``add_prefix_space`` to its default and asks for ``clean_up_tokenization_spaces``."""
    return build_once(f"tiny-nomic_bert_moe-tokjson-{VERSION}", _build_tokenizer_json_only)


def _build_tokenizer_json_only(out: Path) -> None:
    import shutil

    src = nomic_moe()
    for f in src.iterdir():
        if f.is_dir():
            shutil.copytree(f, out / f.name)
        elif f.name == "model.safetensors":
            (out / f.name).symlink_to(f)
        elif f.name != "sentencepiece.bpe.model":
            shutil.copy(f, out / f.name)
    tj = json.loads((out / "tokenizer.json").read_text())
    tj["normalizer"] = next(n for n in tj["normalizer"]["normalizers"] if n["type"] == "Precompiled")
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc.pop("add_prefix_space")
    tc["clean_up_tokenization_spaces"] = True
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2))
