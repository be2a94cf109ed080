"""``hf2q cache list|size|clear`` through the real command-line entry point."""

from __future__ import annotations

import hashlib

import numpy as np

from hf2q.cli import main
from hf2q.kvstore import BLOCK_TOKENS, BlockStore, KVBlock

FP_A = hashlib.sha256(b"cli-a").hexdigest()
FP_B = hashlib.sha256(b"cli-b").hexdigest()


def populate(root, fp, seed, n_blocks):
    toks = np.random.default_rng(seed).integers(0, 50000, n_blocks * BLOCK_TOKENS).tolist()
    with BlockStore.open(root, fp) as store:
        for s in store.missing_spans(toks):
            store.write(KVBlock.from_span(s, toks, {"k": np.zeros((2, BLOCK_TOKENS, 16), np.float16)}))



def test_list_size_clear_kv_store(tmp_path, capsys):
    kv = tmp_path / "kv"
    populate(kv, FP_A, 1, 3)
    populate(kv, FP_B, 2, 1)
    (kv / "blocks" / "deadbeef.safetensors").write_bytes(b"junk")  # left for recovery to judge
    assert main(["cache", "list", "--kv-path", str(kv)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:]}
    assert rows[FP_A[:16]][1] == "3" and rows[FP_B[:16]][1] == "1" and rows["(unreadable)"][1] == "1"
    assert main(["cache", "size", "--kv-path", str(kv)]) == 0
    size = int(capsys.readouterr().out.strip())
    assert size == sum(p.stat().st_size for p in (kv / "blocks").iterdir())
    assert main(["cache", "clear", "--kv-path", str(kv), "--yes"]) == 0
    assert "removed 5 files" in capsys.readouterr().out
    assert list((kv / "blocks").iterdir()) == []
    assert main(["cache", "size", "--kv-path", str(kv)]) == 0
    assert capsys.readouterr().out.strip() == "0"


def test_clear_refuses_while_a_server_has_the_store_open(tmp_path, capsys):
    kv = tmp_path / "kv"
    populate(kv, FP_A, 3, 1)
    with BlockStore.open(kv, FP_A):
        assert main(["cache", "clear", "--kv-path", str(kv), "--yes"]) == 3
        err = capsys.readouterr().err
        assert err.startswith("hf2q: error:") and "in use" in err and len(err.strip().splitlines()) == 1
    assert len(list((kv / "blocks").iterdir())) == 1


def test_clear_without_yes_on_a_pipe_is_a_usage_error(tmp_path, capsys, monkeypatch):
    kv = tmp_path / "kv"
    populate(kv, FP_A, 4, 1)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["cache", "clear", "--kv-path", str(kv)]) == 2
    assert "--yes" in capsys.readouterr().err
    assert len(list((kv / "blocks").iterdir())) == 1


def test_missing_kv_path_is_an_input_error(tmp_path, capsys):
    assert main(["cache", "list", "--kv-path", str(tmp_path / "nope")]) == 3
    assert "no KV store" in capsys.readouterr().err


def test_model_cache_list_size_clear(tmp_path, capsys, monkeypatch):
    root = tmp_path / "cache"
    (root / "pypi-models" / "m1").mkdir(parents=True)
    (root / "pypi-models" / "m1" / "w.gguf").write_bytes(b"x" * 5000)
    (root / "hub").mkdir()
    (root / "hub" / "a.bin").write_bytes(b"y" * 300)
    monkeypatch.setenv("HF2Q_CACHE", str(root))
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "pypi-models/m1" in out and "hub/a.bin" in out
    assert main(["cache", "size"]) == 0
    assert int(capsys.readouterr().out) == 5300
    assert main(["cache", "size", "--cache-dir", str(root / "hub")]) == 0
    assert int(capsys.readouterr().out) == 300
    assert main(["cache", "clear", "--yes"]) == 0
    assert list(root.iterdir()) == []
