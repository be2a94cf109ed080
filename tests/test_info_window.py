"""``hf2q info`` and the serve memory plan count Gemma 4's sliding layers at their window bound, not per
token, and Gemma 3's too; Gemma 3 on the CPU over an 8-bit cache (whose host decode attention addresses every
position of its sliding layers) stays per token.

Reference: transformers' config of the tiny checkpoints (layer types, KV heads and head sizes, shared-KV
layers, window) with the engine's cache layout (heads in pieces of the smallest head size, padded to the
widest layer) and the window policy (``recurrent_policy.window_positions``); and the loaded runner.
"""

from __future__ import annotations

import json

import pytest

from hf2q.engine.device_probe import DeviceFacts, probe
from hf2q.engine.memory_plan import check_model
from hf2q.engine.recurrent_policy import window_positions
from tests.engine_support import convert_f32

pytestmark = pytest.mark.slow  # converts the tiny checkpoints (~15 s each, shared with the engine tests)
_ON_CPU = probe().on_cpu  # what `info` itself asks


def _expected(src, elem: int) -> tuple[int, int, int]:
    """(per token, window bytes per slot, window) from the HF config."""
    import transformers

    c = transformers.AutoConfig.from_pretrained(src)
    c = getattr(c, "text_config", c)
    sliding = [t == "sliding_attention" for t in c.layer_types]
    shapes = [(layer.num_key_value_heads, layer.head_dim) for layer in c.per_layer_config]
    piece = min(d for _, d in shapes)
    position = max(h * d // piece for h, d in shapes) * piece * 2 * elem
    owners = [i for i, mode in enumerate(c.kv_sharing_modes) if mode != "reuse"]
    n_window = sum(sliding[i] for i in owners)
    return ((len(owners) - n_window) * position, n_window * window_positions(c.sliding_window) * position,
            c.sliding_window)


@pytest.mark.parametrize("name", ["gemma4", "gemma4_e2b"])
def test_info_counts_the_window_layers_once_per_slot(name, tiny_checkpoint, tmp_path, cli):
    from hf2q.engine.runner import MlxModelRunner

    src = tiny_checkpoint(name)
    gguf = convert_f32(src, tmp_path / "f32.gguf")
    r = cli("info", gguf, "--json", "--ctx", "4096", "--slots", "4")
    assert r.code == 0, r.err
    got = json.loads(r.out)
    per_token, window_bytes, window = _expected(src, got["kv_dtype_bytes"])
    assert (got["kv_bytes_per_token"], got["kv_window_bytes_per_slot"], got["kv_window"]) == \
        (per_token, window_bytes, window)
    assert got["kv_bytes_per_slot"] == 4096 * per_token + window_bytes
    assert got["kv_bytes_worst_case"] == 4 * got["kv_bytes_per_slot"]
    runner = MlxModelRunner.load(gguf)  # the engine allocates by the same figures (test_engine_gemma4_window)
    assert (runner.kv_bytes_per_token, runner.kv_bytes_per_slot) == (per_token, window_bytes)
    text = cli("info", gguf, "--ctx", "4096").out
    assert f"keep only their {window}-token window" in text

    device = DeviceFacts("cpu", "cpu", 1 << 40)
    need = check_model(gguf, 1, ctx=4096, slots=4, kv_budget=None, limit=None, device=device, prefill_chunk=512)
    in_flight = window_bytes // window_positions(window) * (window_positions(window, 512) - window_positions(window))
    assert need.kv == 4 * got["kv_bytes_per_slot"] + in_flight


@pytest.mark.skipif(not _ON_CPU, reason="the CPU host decode step's 8-bit attention")
def test_gemma3_on_the_cpu_is_windowed_but_over_an_8bit_cache(tiny_checkpoint, tmp_path, cli):
    """On the CPU Gemma 3's sliding layers keep their window over a float cache, as the loaded runner does; over
    an 8-bit cache the host decode step's attention addresses absolute positions, so the figure stays per token
    over all layers."""
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.formats.gguf_file import open_gguf

    gguf = convert_f32(tiny_checkpoint("gemma3"), tmp_path / "f32.gguf")
    got = json.loads(cli("info", gguf, "--json").out)
    runner = MlxModelRunner.load(gguf)
    assert got["kv_window_layers"] == len(runner.window_layers[1]) > 0 and not runner.trims_prefix
    assert (got["kv_bytes_per_token"], got["kv_window_bytes_per_slot"]) == \
        (runner.kv_bytes_per_token, runner.kv_bytes_per_slot)
    q8 = json.loads(cli("info", gguf, "--json", "--kv-cache-type", "q8").out)
    assert q8["kv_window_layers"] == 0 and q8["kv_window_bytes_per_slot"] == 0
    runner = MlxModelRunner(runner.gguf, runner.model, runner.dtype, None, "q8")
    assert runner.new_sequence().window is None and runner.trims_prefix
    assert runner.kv_bytes_per_token == q8["kv_bytes_per_token"]


def test_swa_full_keeps_every_position_and_counts_it(tiny_checkpoint, tmp_path, cli, monkeypatch):
    """``HF2Q_SWA_FULL=1``: the window layers keep every position (prefix reuse anywhere, the persistent
    store allowed), and ``info`` counts them per token again — what the engine then allocates."""
    from hf2q.engine.runner import MlxModelRunner

    src = tiny_checkpoint("gemma4")
    gguf = convert_f32(src, tmp_path / "f32.gguf")
    monkeypatch.setenv("HF2Q_SWA_FULL", "1")
    got = json.loads(cli("info", gguf, "--json").out)
    per_token, window_bytes, window = _expected(src, got["kv_dtype_bytes"])
    position = window_bytes // (2 * window_positions(window))  # the tiny dense model: 2 window layers
    assert got["kv_window_layers"] == 0 and got["kv_bytes_per_token"] == per_token + 2 * position
    runner = MlxModelRunner.load(gguf)
    seq = runner.new_sequence()
    assert seq.window is None and runner.trims_prefix and runner.kv_bytes_per_token == got["kv_bytes_per_token"]
    runner.prefill(seq, list(range(5, 405)))
    assert seq.nbytes == seq.capacity * got["kv_bytes_per_token"]
