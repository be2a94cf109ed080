"""Which vision projector ``hf2q serve`` takes for a model (``hf2q.engine.vision.mmproj_match``).

The projector of the tiny Qwen3-VL (``hf2q convert --mmproj``) fits its text model; the MoE
variant's text GGUF is 64 wide too, a text-only SmolLM2 takes no images, and a GGUF that is no
projector is skipped when found beside the model — each named in the reason or the log line.
"""

from __future__ import annotations

import pytest

from hf2q.engine.vision.mmproj_match import choose_mmproj, misfit
from hf2q.errors import InputError
from hf2q.formats.gguf_file import open_gguf
from tests.models.qwen3vl import checkpoint, f32_gguf


@pytest.fixture(scope="module")
def beside(tmp_path_factory):
    """A directory with the text model, a GGUF that is no projector, and the projector (in name order)."""
    from hf2q.convert.mmproj import convert_mmproj

    d = tmp_path_factory.mktemp("beside")
    (d / "model.gguf").symlink_to(f32_gguf("qwen3vl"))
    (d / "mmproj-a-not-one.gguf").symlink_to(f32_gguf("qwen3vl"))
    convert_mmproj(checkpoint("qwen3vl"), d / "mmproj-tiny-f32.gguf", "f32")
    return d


def test_the_fitting_projector_beside_the_model_is_found(beside):
    path, line = choose_mmproj(open_gguf(beside / "model.gguf"), None)
    assert path == beside / "mmproj-tiny-f32.gguf"
    assert "found beside the model" in line and "mmproj-tiny-f32.gguf" in line


def test_named_projector_must_fit(beside):
    model = open_gguf(beside / "model.gguf")
    assert choose_mmproj(model, beside / "mmproj-tiny-f32.gguf")[0] == beside / "mmproj-tiny-f32.gguf"
    with pytest.raises(InputError, match="not a qwen3vl_merger projector"):
        choose_mmproj(model, beside / "mmproj-a-not-one.gguf")


def test_a_text_only_model_takes_none(beside, smollm2_gguf):
    text = open_gguf(smollm2_gguf)
    assert "takes no images" in misfit(text, open_gguf(beside / "mmproj-tiny-f32.gguf"))
    assert choose_mmproj(text, None) == (None, "")


def test_serve_refuses_a_projector_that_does_not_fit(cli, beside, smollm2_gguf):
    r = cli("serve", "--model", smollm2_gguf, "--mmproj", beside / "mmproj-tiny-f32.gguf", "--port", "0")
    assert r.code == 3, r.err
    assert "--mmproj:" in r.err and "takes no images" in r.err
    assert len(r.err.strip().splitlines()) == 1
