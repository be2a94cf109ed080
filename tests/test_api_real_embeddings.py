"""``hf2q serve --embedding-model`` for real: a server process with SmolLM2 for chat and MiniLM
(converted to GGUF by ``hf2q convert``) for ``/v1/embeddings``, queried with the openai SDK.

References: the engine's own ``MlxModelRunner.embed`` on the same GGUF (cosine ≥ 0.9999 per
vector), transformers' MiniLM (mean pooling, L2 norm) and the model card's similarity
≈ 0.755 for the two sentences below.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.serve_support import chat_and_embedding_server

pytestmark = [pytest.mark.slow]

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread."]


@pytest.fixture(scope="module")
def minilm_gguf(tmp_path_factory, minilm_hf):
    from hf2q.cli import main

    out = tmp_path_factory.mktemp("minilm") / "minilm-f32.gguf"
    assert main(["convert", str(minilm_hf), "-q", "f32", "-o", str(out), "--no-integrity"]) == 0
    return out


@pytest.fixture(scope="module")
def server(minilm_gguf, smollm2_gguf, tmp_path_factory):
    with chat_and_embedding_server(smollm2_gguf, minilm_gguf, tmp_path_factory.mktemp("serve")) as url:
        yield url


def test_embeddings_over_http_equal_the_engine_and_transformers(server, minilm_gguf, minilm_hf):
    import openai
    import torch
    import transformers

    from hf2q.engine.runner import MlxModelRunner
    from hf2q.text.tokenizer import GGUFTokenizer

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    ids = [m.id for m in client.models.list().data]
    assert minilm_gguf.stem in ids and len(ids) == 2  # the chat model and the embedding model
    got = client.embeddings.create(model=minilm_gguf.stem, input=SENTENCES)  # the SDK asks for base64
    served = np.array([d.embedding for d in sorted(got.data, key=lambda d: d.index)], dtype=np.float32)
    as_floats = client.embeddings.create(model=minilm_gguf.stem, input=SENTENCES, encoding_format="float")
    assert np.allclose([d.embedding for d in as_floats.data], served, atol=1e-7)

    # the engine's own answer on the same GGUF and token ids
    tok = GGUFTokenizer.from_gguf(minilm_gguf)
    tokens = [tok.encode(s) for s in SENTENCES]
    assert got.usage.prompt_tokens == sum(len(t) for t in tokens)
    engine = MlxModelRunner.load(minilm_gguf).embed(tokens)
    assert served.shape == engine.shape == (2, 384)
    assert np.allclose(np.linalg.norm(served, axis=1), 1.0, atol=1e-5)
    for a, b in zip(served, engine):
        assert float(a @ b) / float(np.linalg.norm(b)) >= 0.9999

    # transformers' MiniLM: mean pooling + L2 norm (sentence-transformers' recipe)
    hf_tok = transformers.AutoTokenizer.from_pretrained(minilm_hf)
    model = transformers.AutoModel.from_pretrained(minilm_hf, dtype=torch.float32).eval()
    refs = []
    for s in SENTENCES:
        with torch.no_grad():
            h = model(**hf_tok(s, return_tensors="pt")).last_hidden_state[0].mean(0)
        refs.append((h / h.norm()).numpy())
    for a, b in zip(served, refs):
        assert float(a @ b) >= 0.9999
    sim = float(served[0] @ served[1])
    assert abs(sim - float(refs[0] @ refs[1])) < 1e-4
    assert 0.74 < sim < 0.77  # the model card's ≈ 0.755


def test_chat_still_answers_beside_the_embedding_model(server):
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):  # an unknown embedding model is a 404, not a silent answer
        client.embeddings.create(model="nope-model", input="x")
