"""The pre-load memory check: predicted bytes per rank against what the engine really holds,
and the refusal (exit 3, one line, naming the tensor-parallel size that fits)."""

from __future__ import annotations

import hf2q.engine  # noqa: F401
import mlx.core as mx
import pytest

from hf2q.engine.memory_plan import check_fits, rank_need
from hf2q.engine.models import build_model
from hf2q.engine.tensor_parallel import shard_gguf
from hf2q.errors import InputError
from hf2q.formats.gguf_file import open_gguf


@pytest.fixture(scope="module")
def tiny_quant(tmp_path_factory, tiny_checkpoint):
    from hf2q.cli import main

    out_dir = tmp_path_factory.mktemp("memplan")
    made = {}

    def make(quant: str):
        if quant not in made:
            out = out_dir / f"llama-{quant}.gguf"
            assert main(["convert", str(tiny_checkpoint("llama")), "-q", quant, "-o", str(out), "--no-integrity"]) == 0
            made[quant] = out
        return made[quant]
    return make


def _held(model) -> int:
    """Bytes the built model really holds: its linear layers plus every norm vector."""
    norms = 0
    for layer in model.layers:
        for name in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm"):
            if hasattr(layer, name):
                norms += getattr(layer, name).nbytes
        for name in ("q_norm", "k_norm"):
            if hasattr(layer.attn, name):
                norms += getattr(layer.attn, name).nbytes
    return model.weights_nbytes() + norms + model.norm.nbytes


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_0", "q5_1"])
@pytest.mark.parametrize("size", [1, 2])
def test_predicted_rank_bytes_equal_what_the_engine_holds(tiny_quant, quant, size):
    g = open_gguf(tiny_quant(quant))
    need = rank_need(g, size, 0, float_bytes=4, scale_bytes=4, on_cpu=True)  # CPU: float32 activations and scales
    held = max(_held(build_model(shard_gguf(g, r, size), mx.float32)) for r in range(size))
    assert need.weights == held


def test_a_model_over_the_limit_is_refused_with_the_size_that_fits(tiny_quant):
    g = open_gguf(tiny_quant("q8_0"))
    one = rank_need(g, 1, 1 << 20, float_bytes=4, scale_bytes=4)
    two = rank_need(g, 2, 1 << 20, float_bytes=4, scale_bytes=4)
    assert two.total < one.total and two.kv == one.kv // 2
    limit = (one.total + two.total) // 2
    with pytest.raises(InputError, match=r"more than the .* it fits at --tensor-parallel 2"):
        check_fits(g, 1, 1 << 20, limit, float_bytes=4, scale_bytes=4)
    assert check_fits(g, 2, 1 << 20, limit, float_bytes=4, scale_bytes=4) == two


def test_serve_refuses_before_starting(tiny_quant, capsys):
    from hf2q.cli import main

    code = main(["serve", "--model", str(tiny_quant("q8_0")), "--memory-limit", "64K", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert len(err) == 1 and "--memory-limit" in err[0] and "Traceback" not in err[0]


def test_device_probe_agrees_with_mlx():
    """The memory plan's device facts come without MLX (``device_probe``); MLX itself says the same."""
    import psutil

    from hf2q.engine.device_probe import probe
    from hf2q.engine.runner import compute_dtype

    facts = probe()
    assert facts.kind == mx.default_device().type.name
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    assert facts.memory == int(info.get("memory_size") or info.get("total_memory") or psutil.virtual_memory().total)
    assert facts.activation_bytes() == compute_dtype("llama").size == compute_dtype("gemma3").size


def test_check_model_takes_the_device_it_is_given(tiny_quant):
    """A GPU's smaller activations and the device's own memory enter the plan: the same model fits
    a 16-bit device with twice the KV room that a 32-bit one lacks."""
    from hf2q.engine.device_probe import DeviceFacts
    from hf2q.engine.memory_plan import check_model

    g = open_gguf(tiny_quant("q8_0"))
    cpu = check_model(g, 1, ctx=256, slots=2, kv_budget=None, limit=None, device=DeviceFacts("cpu", "cpu", 1 << 40))
    gpu = check_model(g, 1, ctx=256, slots=2, kv_budget=None, limit=None, device=DeviceFacts("gpu", "cuda", 1 << 40))
    assert cpu.kv == 2 * 256 * g.hparams.kv_bytes_per_token(4) and gpu.kv == cpu.kv // 2
    with pytest.raises(InputError, match="--memory-limit"):
        check_model(g, 1, ctx=256, slots=2, kv_budget=None, limit=None, device=DeviceFacts("cpu", "cpu", cpu.total))
