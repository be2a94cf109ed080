"""``hf2q serve --model A --model B --models-memory SIZE`` for real: SmolLM2 and Gemma3-270m (and a
tiny BERT for embeddings) in one server process whose model memory holds only one of the chat
models, queried over HTTP with httpx.

References: the same server's own T=0 answer before the model was evicted (a reload must not
change it), the memory plan's figures (``engine.memory_plan.check_model``, what ``hf2q info``
prints) for the budget, and the engine's ``embed`` on the same GGUF for the embedding model.
"""

from __future__ import annotations

import re
import time

import httpx
import numpy as np
import pytest

from tests.serve_support import hf2q_server

pytestmark = [pytest.mark.slow]

KEY = "several-models-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CTX, SLOTS = "512", "1"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def need(path) -> int:
    from hf2q.engine.memory_plan import check_model

    return check_model(path, 1, ctx=int(CTX), slots=int(SLOTS), kv_budget=None, limit=None).total


@pytest.fixture(scope="module")
def bert_gguf(tmp_path_factory, tiny_checkpoint):
    from hf2q.cli import main

    out = tmp_path_factory.mktemp("bert") / "tiny-bert-f32.gguf"
    assert main(["convert", str(tiny_checkpoint("bert")), "-q", "f32", "-o", str(out), "--no-integrity"]) == 0
    return out


@pytest.fixture(scope="module")
def budget(smollm2_gguf, gemma3_gguf) -> int:
    a, b = need(smollm2_gguf), need(gemma3_gguf)
    return max(a, b) + min(a, b) // 2  # either chat model (and the tiny BERT) fits, never both


@pytest.fixture(scope="module")
def server(smollm2_gguf, gemma3_gguf, bert_gguf, budget, tmp_path_factory):
    args = ["--model", str(smollm2_gguf), "--model", str(gemma3_gguf), "--model", str(bert_gguf),
            "--models-memory", str(budget), "--models-wait", "1", "--ctx", CTX, "--slots", SLOTS, "--api-key", KEY]
    with hf2q_server(args, tmp_path_factory.mktemp("serve")) as url, \
            httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        yield client


def ask(client, model: str, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": model, "messages": QUESTION, "max_tokens": 12,
                                                     "temperature": 0, **extra})


def metric(client, name: str, model: str) -> float:
    text = client.get("/metrics").text
    found = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    assert found, f"{name} for {model} missing from /metrics"
    return float(found.group(1))


def states(client) -> dict[str, str]:
    return {m["id"]: m["state"] for m in client.get("/v1/models").json()["data"]}


def test_alternating_models_evict_each_other_and_a_reload_answers_the_same(server, smollm2_gguf, gemma3_gguf):
    smol, gemma = smollm2_gguf.stem, gemma3_gguf.stem
    assert set(states(server)) == {smol, gemma, "tiny-bert-f32"}
    before = {m: metric(server, "hf2q_model_evictions_total", m) for m in (smol, gemma)}
    first = ask(server, smol)
    assert first.status_code == 200, first.text
    assert states(server)[smol] == "ready"
    other = ask(server, gemma)
    assert other.status_code == 200 and other.json()["model"] == gemma
    assert states(server)[smol] == "unloaded"  # evicted: both do not fit
    again = ask(server, smol)
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]  # T=0, reloaded
    assert metric(server, "hf2q_model_evictions_total", smol) == before[smol] + 1
    assert metric(server, "hf2q_model_evictions_total", gemma) == before[gemma] + 1
    text = server.get("/metrics").text
    assert f'hf2q_model_state{{model="{smol}",state="ready"}} 1.0' in text
    assert f'hf2q_model_state{{model="{gemma}",state="unloaded"}} 1.0' in text


def test_a_streaming_request_keeps_its_model_resident_and_the_other_model_gets_429(server, smollm2_gguf,
                                                                                    gemma3_gguf):
    from hf2q.text.tokenizer import GGUFTokenizer

    smol, gemma = smollm2_gguf.stem, gemma3_gguf.stem
    never_stop = {str(i): -100 for i in GGUFTokenizer.from_gguf(smollm2_gguf).eos_ids}
    body = {"model": smol, "messages": QUESTION, "max_tokens": 400, "temperature": 0, "stream": True,
            "logit_bias": never_stop}
    evictions = metric(server, "hf2q_model_evictions_total", smol)
    with server.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert any(line.startswith("data: {") for line in lines)  # generating now
        t0 = time.monotonic()
        refused = ask(server, gemma)
        waited = time.monotonic() - t0
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "models_memory_full" and refused.headers["retry-after"] == "1"
        assert 0.9 <= waited < 30  # it waited --models-wait for room first
        cards = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
        assert cards[smol]["state"] == "ready" and cards[smol]["active_requests"] == 1
        busy = server.post(f"/v1/models/{smol}/unload")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
    # the stream is closed: its model is idle, so now the other model may take its place
    done = ask(server, gemma)
    assert done.status_code == 200, done.text
    assert metric(server, "hf2q_model_evictions_total", smol) == evictions + 1


def test_load_and_unload_routes_need_the_key_and_report_the_state(server, gemma3_gguf):
    gemma = gemma3_gguf.stem
    plain = httpx.Client(base_url=str(server.base_url), timeout=60)
    for route in ("load", "unload"):
        r = plain.post(f"/v1/models/{gemma}/{route}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    unloaded = server.post(f"/v1/models/{gemma}/unload")
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
    loaded = server.post(f"/v1/models/{gemma}/load")
    assert loaded.status_code == 200 and loaded.json()["state"] == "ready"
    assert loaded.json()["max_model_len"] == int(CTX)
    missing = server.post("/v1/models/no-such-model/load")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    unknown = ask(server, "no-such-model")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_an_embedding_model_beside_the_chat_models_loads_when_named(server, bert_gguf):
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.text.tokenizer import GGUFTokenizer

    sentences = ["A man is eating food.", "A man is eating a piece of bread."]
    chat_as_embedder = server.post("/v1/embeddings", json={"model": "gemma-3-270m-q4_k_m", "input": "x"})
    assert chat_as_embedder.status_code == 404
    got = server.post("/v1/embeddings", json={"model": bert_gguf.stem, "input": sentences,
                                              "encoding_format": "float"})
    assert got.status_code == 200, got.text
    served = np.array([d["embedding"] for d in got.json()["data"]], dtype=np.float32)
    tok = GGUFTokenizer.from_gguf(bert_gguf)
    engine = MlxModelRunner.load(bert_gguf).embed([tok.encode(s) for s in sentences])
    assert served.shape == engine.shape
    for a, b in zip(served, engine):
        assert float(a @ b) / float(np.linalg.norm(a) * np.linalg.norm(b)) >= 0.9999
    assert states(server)[bert_gguf.stem] == "ready"

