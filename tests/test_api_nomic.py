"""``/v1/embeddings`` serving a Nomic-BERT GGUF beside a chat model, over real HTTP.

``hf2q serve --model SmolLM2 --embedding-model nomic.gguf`` (the tiny v1.5-layout checkpoint converted by
``hf2q convert``); the answers must equal the engine's ``embed`` on the same GGUF and token ids and
transformers' ``NomicBertModel`` (mean pooling + L2 norm), and the server must embed the text it was
given: task prefixes (``search_query: ``) are the client's to add, never added or stripped.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.models.tiny import nomic_bert
from tests.serve_support import chat_and_embedding_server

pytestmark = [pytest.mark.slow]

TEXTS = ["search_query: What is TSNE?", "search_document: TSNE is a dimensionality reduction algorithm.",
         "What is TSNE?"]


@pytest.fixture(scope="module")
def nomic_gguf(tmp_path_factory):
    from hf2q.cli import main

    out = tmp_path_factory.mktemp("nomic") / "nomic-f32.gguf"
    assert main(["convert", str(nomic_bert()), "-q", "f32", "-o", str(out), "--no-integrity"]) == 0
    return out


@pytest.fixture(scope="module")
def server(nomic_gguf, smollm2_gguf, tmp_path_factory):
    with chat_and_embedding_server(smollm2_gguf, nomic_gguf, tmp_path_factory.mktemp("serve")) as url:
        yield url


def test_served_nomic_embeddings_equal_the_engine_and_transformers(server, nomic_gguf):
    import openai
    import torch
    import transformers

    from hf2q.engine.runner import MlxModelRunner
    from hf2q.text.tokenizer import GGUFTokenizer

    r = httpx.post(server + "/v1/embeddings", json={"model": nomic_gguf.stem, "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    served = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)
    sdk = openai.OpenAI(base_url=server + "/v1", api_key="unused").embeddings.create(model=nomic_gguf.stem,
                                                                                       input=TEXTS)
    assert np.allclose([d.embedding for d in sorted(sdk.data, key=lambda d: d.index)], served, atol=1e-6)

    tok = GGUFTokenizer.from_gguf(nomic_gguf)
    ids = [tok.encode(t) for t in TEXTS]  # the text as sent, prefix and all
    assert body["usage"]["prompt_tokens"] == sum(len(t) for t in ids)
    engine = np.asarray(MlxModelRunner.load(nomic_gguf).embed(ids))
    assert served.shape == engine.shape == (3, 64)
    assert np.abs(served - engine).max() < 1e-5

    src = nomic_bert()
    hf_tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModel.from_pretrained(src, dtype=torch.float32).eval()
    for text, vec in zip(TEXTS, served):
        with torch.no_grad():
            h = model(**hf_tok(text, return_tensors="pt")).last_hidden_state[0].mean(0)
        ref = (h / h.norm()).numpy()
        assert float(vec @ ref) / float(np.linalg.norm(vec)) >= 1 - 1e-4
    # no prefix is added: the bare question is embedded as itself, not as its search_query: form
    assert float(served[0] @ served[2]) < 0.999


def test_chat_answers_beside_nomic(server):
    r = httpx.post(server + "/v1/chat/completions", timeout=120,
                   json={"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
