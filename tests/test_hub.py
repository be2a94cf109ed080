"""``--repo``: real huggingface_hub client against a local fake Hub (never the network)."""

from __future__ import annotations

import hashlib
import json

import pytest

from hf2q.errors import ConversionError, InputError
from hf2q.sources import hub
from tests.models.fake_hub import FakeHub

REPO = "test-org/tiny-llama"


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    h = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no user token or config leaks in
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield h
    h.stop()


@pytest.fixture
def published(fake_hub, tiny_checkpoint):
    src = tiny_checkpoint("llama")
    commit = fake_hub.add_repo(REPO, src, extra={"README.md": b"# card\n", "pytorch_model.bin": b"pickle!"})
    return src, commit


def test_download_writes_files_and_receipt(fake_hub, published, tmp_path):
    src, commit = published
    out = hub.resolve_repo(REPO, None, tmp_path / "cache")
    assert out == tmp_path / "cache" / "repos" / "test-org__tiny-llama"
    # only what a conversion reads, byte for byte
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / "README.md").exists() and not (out / "pytorch_model.bin").exists()
    assert not (out / ".cache").exists()
    rec = json.loads((out / hub.RECEIPT).read_text())
    assert rec["repo"] == REPO and rec["revision"] == "main" and rec["commit"] == commit
    assert rec["files"]["model.safetensors"]["sha256"] == hashlib.sha256(
        (src / "model.safetensors").read_bytes()).hexdigest()
    assert not list((tmp_path / "cache" / "repos").glob("*.tmp-*"))


def test_second_run_reuses_the_receipt_without_downloading(fake_hub, published, tmp_path):
    hub.resolve_repo(REPO, None, tmp_path)
    n = len(fake_hub.downloads())
    assert n >= 3
    hub.resolve_repo(REPO, "main", tmp_path)
    assert len(fake_hub.downloads()) == n  # only the commit lookup, no file transfer
    # a pinned commit that the receipt already holds needs no request at all
    before = len(fake_hub.requests)
    hub.resolve_repo(REPO, published[1], tmp_path)
    assert len(fake_hub.requests) == before


def test_offline_reuse_and_its_limits(fake_hub, published, tmp_path, monkeypatch):
    out = hub.resolve_repo(REPO, "main", tmp_path)
    fake_hub.stop()  # the Hub goes away: the intact cached copy is still usable
    assert hub.resolve_repo(REPO, "main", tmp_path) == out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.resolve_repo(REPO, "main", tmp_path) == out
    with pytest.raises(ConversionError, match="unreachable"):  # a revision we never fetched
        hub.resolve_repo(REPO, "v2", tmp_path)
    # a damaged cache is not trusted offline
    cfg = out / "config.json"
    cfg.write_text(cfg.read_text().replace("64", "65", 1))
    with pytest.raises(ConversionError, match="no intact cached copy"):
        hub.resolve_repo(REPO, "main", tmp_path)


def test_damaged_cache_is_fetched_again(fake_hub, published, tmp_path):
    src, _ = published
    out = hub.resolve_repo(REPO, None, tmp_path)
    (out / "model.safetensors").write_bytes(b"garbage")
    n = len(fake_hub.downloads())
    hub.resolve_repo(REPO, None, tmp_path)
    assert len(fake_hub.downloads()) > n
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_revisions_and_new_commits(fake_hub, published, tiny_checkpoint, tmp_path):
    src, _old_commit = published
    new_commit = fake_hub.add_repo(REPO, tiny_checkpoint("qwen3"))  # main moves on
    fake_hub.add_repo(REPO, src, revision="v1.0")  # a tag at the old content
    out = hub.resolve_repo(REPO, "main", tmp_path)
    assert json.loads((out / hub.RECEIPT).read_text())["commit"] == new_commit
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    out = hub.resolve_repo(REPO, "v1.0", tmp_path)
    rec = json.loads((out / hub.RECEIPT).read_text())
    assert rec["revision"] == "v1.0" and rec["commit"] != new_commit
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_unknown_repo_and_revision_are_input_errors(fake_hub, published, tmp_path):
    with pytest.raises(InputError, match="repository not found"):
        hub.resolve_repo("test-org/nope", None, tmp_path)
    with pytest.raises(InputError, match="revision 'v9' not found"):
        hub.resolve_repo(REPO, "v9", tmp_path)
    for bad in ("../etc", "a/b/c", "", "org/na me"):
        with pytest.raises(InputError, match="expected a Hub model id"):
            hub.resolve_repo(bad, None, tmp_path)
    assert not (tmp_path / "repos").exists() or not any((tmp_path / "repos").iterdir())


def test_repo_without_safetensors_is_rejected(fake_hub, tmp_path):
    folder = tmp_path / "bin-only"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    fake_hub.add_repo("test-org/bin-only", folder, extra={"pytorch_model.bin": b"x"})
    with pytest.raises(InputError, match="safetensors"):
        hub.resolve_repo("test-org/bin-only", None, tmp_path / "c")
    assert not (tmp_path / "c" / "repos" / "test-org__bin-only").exists()


def test_cli_errors_are_one_line(fake_hub, published, tmp_path, cli):
    r = cli("convert", "--repo", "test-org/missing", "-q", "q8_0", "--cache-dir", tmp_path, "-o", tmp_path / "x.gguf")
    assert r.code == 3 and "repository not found" in r.err and len(r.err.strip().splitlines()) == 1
    r = cli("convert", "--repo", REPO, "--revision", "nope", "-q", "mlx-4", "--cache-dir", tmp_path,
            "-o", tmp_path / "x")
    assert r.code == 3 and "revision 'nope' not found" in r.err and len(r.err.strip().splitlines()) == 1


def test_cli_convert_from_repo_to_mlx(fake_hub, published, tmp_path, cli):
    import mlx_lm

    out = tmp_path / "mlx"
    r = cli("convert", "--repo", REPO, "-q", "mlx-4", "--cache-dir", tmp_path / "cache", "-o", out)
    assert r.code == 0, r.err
    model, tok = mlx_lm.load(str(out))
    assert mlx_lm.generate(model, tok, "Hello", max_tokens=3)


def test_cli_convert_from_repo_to_gguf(fake_hub, published, tmp_path, cli):
    import gguf

    out = tmp_path / "m.gguf"
    r = cli("convert", "--repo", REPO, "-q", "q8_0", "--cache-dir", tmp_path / "cache", "-o", out)
    assert r.code == 0, r.err
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert len(reader.tensors) > 0
