"""What a user meets at a Nomic model's context edge on ``/v1/embeddings``, beside stock ``llama-server``.

One ``hf2q serve`` process serves both tiny checkpoints (nomic-bert v1.5, context 2,048, and nomic-bert-moe v2,
context 512) through the openai SDK; ``llama-server --embeddings`` serves the same GGUFs (its physical batch made
larger than the context, so that the context is its limit too). Both embed an input of exactly the context alike,
both refuse a request with one input past it whole (400, no truncation), and ``dimensions`` (OpenAI's matryoshka
parameter, which llama-server ignores) is the full vector's prefix, renormalised.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
import time

import httpx
import numpy as np
import pytest

from tests.models.nomic_moe import nomic_moe
from tests.models.tiny import nomic_bert
from tests.serve_support import hf2q_server
from tests.test_nomic_bert import cosines

pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]
COS_TOL = 1e-4
#: model id (the GGUF's stem) → its trained context
CONTEXTS = {"v15": 2048, "v2": 512}


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from hf2q.cli import main

    out = tmp_path_factory.mktemp("nomic-limits")
    paths = {"v15": out / "v15.gguf", "v2": out / "v2.gguf"}
    for (name, path), src in zip(paths.items(), (nomic_bert(), nomic_moe())):
        assert main(["convert", str(src), "-q", "f16", "-o", str(path), "--no-integrity"]) == 0
    return paths


@pytest.fixture(scope="module")
def ours(ggufs, tmp_path_factory):
    def ready(url):
        return all(httpx.post(url + "/v1/embeddings", json={"model": m, "input": "x"}, timeout=60).status_code == 200
                   for m in ggufs)

    args = [a for p in ggufs.values() for a in ("--model", str(p))] + ["--models-memory", "2G"]
    with hf2q_server(args, tmp_path_factory.mktemp("serve"), ready) as url:
        import openai

        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@contextlib.contextmanager
def _llama_server(path):
    from hf2q.engine.tp_launch import free_ports
    from tests.tools import llama_cpp

    port = free_ports(1)[0]
    env = {**llama_cpp.env(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(llama_cpp.tool("llama-server")), "-m", str(path), "--embeddings", "--host",
                             "127.0.0.1", "--port", str(port), "-t", "1", "-ngl", "0", "--parallel", "1",
                             "--no-webui", "-b", "4096", "-ub", "4096"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "llama-server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def theirs(ggufs, llama_cpp_bin):
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(_llama_server(path)) for name, path in ggufs.items()}


@functools.cache
def _tokenizer(path):
    from hf2q.text.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(path)


@functools.cache
def _document_ids(path) -> tuple[int, ...]:
    from hf2q.quality.corpus import load_corpus

    return tuple(_tokenizer(path).encode(load_corpus("calibration").text[:40000], add_special=False))


def _ids(path, n: int) -> list[int]:
    """``n`` real token ids of running text (a document cut at ``n`` tokens)."""
    assert len(_document_ids(path)) >= n
    return list(_document_ids(path)[:n])


def _llama_embed(url, inputs) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json={"input": inputs}, timeout=300)


def _vectors(body) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)


@pytest.mark.parametrize("model", sorted(CONTEXTS))
def test_an_input_of_exactly_the_context_embeds_as_llama_server(model, ggufs, ours, theirs):
    inputs = [_ids(ggufs[model], 6), _ids(ggufs[model], CONTEXTS[model])]
    got = ours.embeddings.create(model=model, input=inputs)
    mine = np.array([d.embedding for d in sorted(got.data, key=lambda d: d.index)], dtype=np.float32)
    r = _llama_embed(theirs[model], inputs)
    assert r.status_code == 200, r.text[:300]
    assert got.usage.prompt_tokens == r.json()["usage"]["prompt_tokens"] == 6 + CONTEXTS[model]
    assert mine.shape == _vectors(r.json()).shape
    assert np.all(cosines(mine, _vectors(r.json())) >= 1 - COS_TOL), cosines(mine, _vectors(r.json()))


@pytest.mark.parametrize("model", sorted(CONTEXTS))
def test_one_input_past_the_context_refuses_the_request_as_llama_server(model, ggufs, ours, theirs):
    import openai

    n = CONTEXTS[model]
    for inputs in ([_ids(ggufs[model], 6), _ids(ggufs[model], n + 1)], [_ids(ggufs[model], 6), _ids(ggufs[model], 2 * n)]):
        r = _llama_embed(theirs[model], inputs)
        assert r.status_code == 400 and r.json()["error"]["type"] == "exceed_context_size_error", r.text[:300]
        assert r.json()["error"]["n_ctx"] == n
        with pytest.raises(openai.BadRequestError) as e:
            ours.embeddings.create(model=model, input=inputs)
        err = e.value.body
        assert err["code"] == "context_length_exceeded" and err["param"] == "input", err
        assert f"input[1] ({len(inputs[1])} tokens)" in err["message"] and f"({n} tokens)" in err["message"], err


def test_a_long_document_as_text_is_refused_not_truncated(ours):
    """A 20 KB document sent as text: tokenized (quickly: the Unigram encoder is linear), then refused whole."""
    import openai

    from hf2q.quality.corpus import load_corpus

    doc = load_corpus("calibration").text[:20000]
    with pytest.raises(openai.BadRequestError) as e:
        ours.embeddings.create(model="v2", input=["search_document: " + doc])
    assert e.value.body["code"] == "context_length_exceeded" and "input[0]" in e.value.body["message"]


@pytest.mark.parametrize("model,dims", [("v15", 16), ("v2", 8)])
def test_dimensions_is_the_renormalised_prefix(model, dims, ggufs, ours, theirs):
    texts = ["search_query: What is TSNE?", "search_document: TSNE is a dimensionality reduction algorithm."]
    inputs = [_ids(ggufs[model], 3)] + [list(x) for x in _tokenized(ggufs[model], texts)]
    full = np.array([d.embedding for d in ours.embeddings.create(model=model, input=inputs).data], dtype=np.float32)
    short = ours.embeddings.create(model=model, input=inputs, dimensions=dims)
    cut = np.array([d.embedding for d in short.data], dtype=np.float32)
    assert cut.shape == (3, dims) and np.allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-6)
    prefix = full[:, :dims] / np.linalg.norm(full[:, :dims], axis=1, keepdims=True)
    assert np.abs(cut - prefix).max() < 1e-6
    ref = _vectors(_llama_embed(theirs[model], inputs).json())[:, :dims]
    assert np.all(cosines(cut, ref) >= 1 - COS_TOL)
    assert not np.allclose(cut, full[:, :dims], atol=1e-3)  # renormalised, not only cut


def _tokenized(path, texts):
    return [_tokenizer(path).encode(t) for t in texts]
