"""``hf2q info`` on a Qwen 3.5 GGUF states the recurrent state a slot holds.

References: the arithmetic of the HF checkpoint's own config (transformers' names: conv kernel,
linear key/value heads and dims, layer types), and the state the engine actually allocates for a
sequence (``RecurrentState.nbytes``, on this machine's KV element size).
"""

from __future__ import annotations

import json

from tests.models.qwen35_chat import qwen35_chat_gguf


def _info(cli, path, *args):
    r = cli("info", str(path), *args)
    assert r.code == 0, r.err
    return r.out


def test_info_states_the_recurrent_state_per_slot(cli):
    from tests.models.tiny import checkpoint

    cfg = json.loads((checkpoint("qwen35") / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    linear = sum(t == "linear_attention" for t in text["layer_types"])
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_dim = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    got = json.loads(_info(cli, qwen35_chat_gguf(), "--json", "--slots", "3"))
    elem = got["kv_dtype_bytes"]
    conv = linear * (text["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * elem
    ssm = linear * text["linear_num_value_heads"] * text["linear_value_head_dim"] * text["linear_key_head_dim"] * 4
    assert (got["recurrent_layers"], got["recurrent_conv_bytes_per_slot"], got["recurrent_ssm_bytes_per_slot"]) == \
        (linear, conv, ssm)
    assert got["recurrent_state_bytes_per_slot"] == conv + ssm
    line = next(x for x in _info(cli, qwen35_chat_gguf(), "--slots", "3").splitlines() if x.startswith("Recurrent:"))
    assert f"over {linear} linear-attention layers" in line and "worst case 3 slots" in line


def test_the_figure_is_what_the_engine_allocates():
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.info import inspect

    runner = MlxModelRunner.load(str(qwen35_chat_gguf()), ctx=64)
    assert inspect(qwen35_chat_gguf())["recurrent_state_bytes_per_slot"] == runner.new_sequence().recurrent.nbytes


def test_no_recurrent_line_for_other_families(cli, smollm2_gguf):
    out = _info(cli, smollm2_gguf)
    assert "Recurrent:" not in out
    assert json.loads(_info(cli, smollm2_gguf, "--json"))["recurrent_state_bytes_per_slot"] == 0
