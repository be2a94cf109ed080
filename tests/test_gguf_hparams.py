"""``GGUFHparams``: the one reading of a GGUF's hyper-parameters, checked against llama.cpp's own
reading of the same file (its ``print_info`` log), and the rule that no module spells a GGUF key."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import gguf
import pytest

import hf2q
from hf2q.errors import InputError
from hf2q.formats.gguf_file import open_gguf
from hf2q.formats.gguf_hparams import GGUFHparams
from hf2q.formats.gguf_keys import ExtraKeys, Keys
from tests.tools.gguf_read import read_gguf

PACKAGE = Path(hf2q.__file__).resolve().parent


# ---- against llama.cpp -----------------------------------------------------------------------

def _copy_without(src: Path, dst: Path, drop: set[str]) -> Path:
    """``src`` with those of the ``{arch}.<suffix>`` keys in ``drop`` that it has left out (``hf2q gguf-patch
    --drop``: it copies the header byte for byte, where gguf-py's reader took ~15 s to walk a 152k-token
    vocabulary); ``src`` itself when it has none of them."""
    from hf2q.cli import main

    g = open_gguf(src)
    keys = sorted(k for k in (f"{g.hparams.arch}.{suffix}" for suffix in drop) if k in g.metadata)
    if not keys:
        return src
    assert main(["gguf-patch", str(src), "-o", str(dst), *(f"--drop={k}" for k in keys)]) == 0
    return dst


def _llama_cpp_hparams(model: Path) -> dict[str, str]:
    """llama.cpp's ``print_info`` values for ``model`` (it logs them before building a graph, so a
    file whose shapes it then rejects still reports what it read)."""
    from tests.tools import llama_cpp

    tool = llama_cpp.tool("llama-completion")
    r = subprocess.run([str(tool), "-m", str(model), "-p", "a", "-n", "1", "-t", "1", "-no-cnv", "-v"],
                       env=llama_cpp.env(), capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    found = dict(re.findall(r"print_info: (\w+)\s+= (\S+)", r.stdout + r.stderr))
    assert "n_embd_head_v" in found, (r.stdout + r.stderr)[-2000:]
    return found


@pytest.fixture(scope="module")
def tiny_qwen3_f32(tmp_path_factory, tiny_checkpoint):
    """Qwen3's layout: head size 32 with hidden 64 / 4 heads, so ``hidden / heads`` ≠ key length."""
    from hf2q.cli import main

    out = tmp_path_factory.mktemp("hparams") / "qwen3-f32.gguf"
    assert main(["convert", str(tiny_checkpoint("qwen3")), "-q", "f32", "-o", str(out), "--no-integrity"]) == 0
    return out


@pytest.mark.llamacpp
@pytest.mark.parametrize("drop", [
    set(),
    {"attention.value_length", "rope.dimension_count", "attention.head_count_kv", "rope.freq_base"},
    {"attention.key_length", "attention.value_length"},
], ids=["as-written", "optional-keys-missing", "head-sizes-missing"])
def test_defaults_are_llama_cpps(drop, tiny_qwen3_f32, llama_cpp_bin, tmp_path):
    model = _copy_without(tiny_qwen3_f32, tmp_path / "m.gguf", drop)
    ref = _llama_cpp_hparams(model)
    hp = open_gguf(model).hparams
    ours = {"n_ctx_train": hp.n_ctx_train, "n_embd": hp.hidden, "n_layer": hp.n_layers, "n_head": hp.n_heads,
            "n_head_kv": hp.n_kv_heads, "n_rot": hp.rope_dims, "n_embd_head_k": hp.key_length,
            "n_embd_head_v": hp.value_length}
    assert ours == {k: int(ref[k]) for k in ours}
    assert hp.rope_base == float(ref["freq_base_train"])
    assert hp.rms_eps == pytest.approx(float(ref["f_norm_rms_eps"]))
    if drop and "attention.key_length" not in drop:  # the default the old readers disagreed on
        assert hp.value_length == hp.hidden // hp.n_heads == 16 and hp.key_length == 32


# ---- the defaults table and kv_bytes_per_token -------------------------------------------------

def _hp(**kv) -> GGUFHparams:
    meta = {Keys.General.ARCHITECTURE: "llama"}
    meta.update({Keys.LLM.BLOCK_COUNT.format(arch="llama"): 2, Keys.LLM.EMBEDDING_LENGTH.format(arch="llama"): 64,
                 Keys.Attention.HEAD_COUNT.format(arch="llama"): 4})
    meta.update({k.format(arch="llama"): v for k, v in kv.items()})
    return GGUFHparams(meta, "t.gguf")


def test_kv_bytes_per_token_counts_every_layer_k_and_v():
    hp = _hp(**{Keys.Attention.HEAD_COUNT_KV: 2, Keys.Attention.KEY_LENGTH: 32, Keys.Attention.VALUE_LENGTH: 8})
    assert hp.kv_bytes_per_token(2) == 2 * 2 * (32 + 8) * 2
    per_layer = _hp(**{Keys.Attention.HEAD_COUNT_KV: [1, 3]})  # per-layer KV heads: summed, as llama.cpp's n_embd_k_gqa(il)
    assert per_layer.kv_bytes_per_token(4) == (1 + 3) * (16 + 16) * 4
    with pytest.raises(InputError, match="per-layer head counts"):
        per_layer.uniform_heads()
    bert = GGUFHparams({**_hp().metadata, Keys.General.ARCHITECTURE: "bert"})
    assert bert.kv_bytes_per_token(4) == 0


def test_missing_required_key_is_one_input_error_naming_it():
    hp = GGUFHparams({Keys.General.ARCHITECTURE: "llama"}, "x.gguf")
    with pytest.raises(InputError, match=r"x\.gguf: missing GGUF metadata key 'llama\.block_count'"):
        hp.n_layers
    assert hp.n_ctx_train == 4096 and hp.rope_scaling_factor == 1.0
    assert _hp(**{Keys.Rope.SCALING_FACTOR: 0.0}).rope_scaling_factor == 1.0  # 0 means none (llama.cpp)


# ---- one metadata parser -----------------------------------------------------------------------

def test_read_metadata_equals_the_full_parse(smollm2_gguf, tmp_path):
    from hf2q.formats.gguf_parse import parse, read_metadata

    meta = read_metadata(smollm2_gguf)
    assert meta == parse(smollm2_gguf)[0]
    assert meta[Keys.Tokenizer.LIST] == read_gguf(smollm2_gguf)[0][Keys.Tokenizer.LIST]  # the tests' own parser
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(smollm2_gguf).read_bytes()[:4096])
    with pytest.raises(InputError, match="corrupt GGUF metadata"):
        read_metadata(cut)


# ---- no literal key strings -------------------------------------------------------------------

def _gguf_key_names() -> tuple[set[str], set[str]]:
    exact, suffixes = set(), set()
    stack = [getattr(gguf.Keys, n) for n in vars(gguf.Keys) if not n.startswith("_")]
    while stack:
        holder = stack.pop()
        for name, value in vars(holder).items():
            if name.startswith("_"):
                continue
            if isinstance(value, type):
                stack.append(value)
            elif isinstance(value, str) and value.startswith("{arch}."):
                suffixes.add(value[len("{arch}."):])
            elif isinstance(value, str) and "{" not in value:
                exact.add(value)
    return exact, suffixes


def _literal_keys(path: Path, exact: set[str], suffixes: set[str], archs: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
            continue
        s = node.value
        head, _, tail = s.partition(".")
        if (s in exact or (s.startswith(("tokenizer.ggml.", "general.")) and " " not in s)
                or (s.startswith(".") and s[1:] in suffixes) or (head in archs and tail in suffixes)):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {s!r}")
    return found


def test_no_module_spells_a_gguf_key():
    """Keys come from ``gguf.Keys`` or ``formats.gguf_keys.ExtraKeys``, the one table of our own."""
    exact, suffixes = _gguf_key_names()
    archs = set(gguf.MODEL_ARCH_NAMES.values())
    table = PACKAGE / "formats" / "gguf_keys.py"
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != table
             for hit in _literal_keys(path, exact, suffixes, archs)]
    assert found == []
    assert _literal_keys(table, exact, suffixes, archs)  # the scan does see a spelt key


def test_extra_keys_are_only_those_gguf_lacks():
    exact, _ = _gguf_key_names()
    ours = [v for k, v in vars(ExtraKeys).items() if not k.startswith("_") and isinstance(v, str)]
    assert ours and not set(ours) & exact


def test_an_encoder_without_context_length_stops_at_its_learned_positions(tiny_checkpoint, tmp_path):
    """llama.cpp refuses a file without ``context_length``; hf2q defaults it (4096), and a BERT encoder
    never goes past the rows of its position embedding."""
    import mlx.core as mx

    from hf2q.cli import main
    from hf2q.engine.models import build_model

    full = tmp_path / "bert.gguf"
    assert main(["convert", str(tiny_checkpoint("bert")), "-q", "f32", "-o", str(full), "--no-integrity"]) == 0
    stripped = tmp_path / "bert-no-ctx.gguf"
    _copy_without(full, stripped, {"context_length"})
    g = open_gguf(stripped)
    assert g.hparams.stored(Keys.LLM.CONTEXT_LENGTH) is None and g.hparams.n_ctx_train == 4096
    rows = g.tensor("position_embd.weight").shape[0]
    assert build_model(g, mx.float32).cfg.n_ctx_train == rows == open_gguf(full).hparams.n_ctx_train
