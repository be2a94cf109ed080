"""The references ``hf2q parity`` captures from: a transformers checkpoint, stock llama.cpp, our engine.

Each produces, for one raw-text prompt, a ``Trace``: the prompt's token ids as the reference's own
tokenizer makes them, ``n`` greedy tokens, and at each of those steps the top-k next-token ids with
their log-probabilities (log-softmax over the whole vocabulary) and, where the reference exposes
them, raw logits. Log-probabilities are what every reference can give (llama-server reports no raw
logits), so they are what is always compared; logits are compared as well when both sides have them.

llama.cpp runs as ``llama-server`` (``llama-completion`` prints no probabilities): ``/tokenize`` with
the model's special tokens, then ``/completion`` on those ids, greedy, ``ignore_eos``, ``n_probs`` = k —
its probabilities before sampling are the softmax of the raw logits. The binary is looked for in
``--llama-cpp DIR``, then ``$HF2Q_LLAMA_CPP``, then the cache's ``llama.cpp-build/bin`` (where the test
oracle is built), then PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hf2q.engine.sampling import log_softmax
from hf2q.errors import ConversionError, InputError


@dataclass
class Trace:
    text: str
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    top_logits: list[list[float]] | None = None

    def as_json(self) -> dict:
        out = {"text": self.text, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
               "top_ids": self.top_ids, "top_logprobs": self.top_logprobs}
        if self.top_logits is not None:
            out["top_logits"] = self.top_logits
        return out


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, logprobs, logits)`` of the ``k`` largest logits of a row, largest first (ties: lower id)."""
    row = np.asarray(logits, dtype=np.float32)
    ids = np.lexsort((np.arange(row.size), -row))[:k]
    return ids, log_softmax(row.astype(np.float64))[ids], row[ids]


def trace_from_rows(text: str, prompt: list[int], rows: np.ndarray, k: int, with_logits: bool) -> Trace:
    """A greedy ``Trace`` from the logits rows of its ``n`` steps."""
    t = Trace(text, list(prompt), top_logits=[] if with_logits else None)
    for row in rows:
        ids, lps, lgs = top_k(row, k)
        t.tokens.append(int(ids[0]))
        t.top_ids.append([int(i) for i in ids])
        t.top_logprobs.append([round(float(v), 6) for v in lps])
        if with_logits:
            t.top_logits.append([round(float(v), 6) for v in lgs])
    return t


# ---- transformers ------------------------------------------------------------------------------------

class TransformersReference:
    """An HF checkpoint directory in transformers, float32, greedy."""

    kind = "transformers"

    def __init__(self, path: Path):
        if not (Path(path) / "config.json").is_file():
            raise InputError(f"--reference {path}: a directory without config.json (not an HF checkpoint)")
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError:
            raise InputError("a transformers reference needs torch and transformers installed") from None
        self._torch = torch
        self.path = Path(path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
            self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        except (OSError, ValueError, KeyError) as e:
            raise InputError(f"transformers cannot load {self.path}: {e}") from None

    def describe(self) -> dict:
        return {"kind": self.kind, "path": str(self.path), "dtype": "float32"}

    def trace(self, text: str, n: int, k: int) -> Trace:
        from hf2q.kernels import cpu_blas

        torch = self._torch
        prompt = [int(t) for t in self.tokenizer(text, add_special_tokens=True)["input_ids"]]
        rows, ids = [], list(prompt)
        # torch binds to the OpenBLAS loaded for MLX when this process has one; its threads on top of
        # torch's own made a SmolLM2 step ~20x slower on a shared 2-core machine
        cpu_blas.use_openblas_threads(1)
        try:
            with torch.no_grad():  # a whole forward per step: prompts are short, and no cache API to track
                for _ in range(n):
                    row = self.model(torch.tensor([ids]), use_cache=False).logits[0, -1].float().numpy()
                    rows.append(row)
                    ids.append(int(top_k(row, 1)[0][0]))
        finally:
            cpu_blas.use_openblas_threads(cpu_blas.threads())
        return trace_from_rows(text, prompt, np.stack(rows), k, with_logits=True)

    def close(self) -> None:
        pass


# ---- our engine ----------------------------------------------------------------------------------------

class EngineReference:
    """A GGUF on our own engine (a regression file: what this build answers today)."""

    kind = "hf2q"

    def __init__(self, path: Path, n_ctx: int = 2048):
        from hf2q.engine.factory import load_runner
        from hf2q.engine.generate import check_generative_model
        from hf2q.text.tokenizer import GGUFTokenizer

        self.path = Path(path)
        header = check_generative_model(self.path)
        self.tokenizer = GGUFTokenizer.from_gguf(self.path)
        self.runner = load_runner(header, ctx=n_ctx)
        if self.runner.is_embedding_model:
            raise InputError(f"{self.path.name} is an embedding model; parity needs next-token logits")

    def describe(self) -> dict:
        return {"kind": self.kind, "path": str(self.path)}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True)

    def rows(self, tokens: list[int]) -> np.ndarray:
        """Logits of every position of ``tokens`` in one forward over a fresh sequence."""
        return np.asarray(self.runner.verify(self.runner.new_sequence(), tokens), dtype=np.float32)

    def trace(self, text: str, n: int, k: int) -> Trace:
        prompt = self.encode(text)
        seq = self.runner.new_sequence()
        row = np.asarray(self.runner.prefill(seq, prompt), dtype=np.float32)
        rows = []
        for _ in range(n):
            rows.append(row)
            row = np.asarray(self.runner.decode([seq], [int(top_k(row, 1)[0][0])])[0], dtype=np.float32)
        return trace_from_rows(text, prompt, np.stack(rows), k, with_logits=True)

    def close(self) -> None:
        pass


# ---- llama.cpp ---------------------------------------------------------------------------------------

def find_llama_server(explicit: str | None) -> Path:
    from hf2q.paths import cache_root

    dirs = [d for d in (explicit, os.environ.get("HF2Q_LLAMA_CPP")) if d]
    dirs.append(str(cache_root() / "llama.cpp-build" / "bin"))
    for d in dirs:
        exe = Path(d) / "llama-server"
        if exe.is_file():
            return exe
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    if explicit:
        raise InputError(f"--llama-cpp {explicit}: no llama-server there")
    raise InputError("no llama-server found (give --llama-cpp DIR, set HF2Q_LLAMA_CPP, or put it on PATH)")


class LlamaCppReference:
    """Stock llama.cpp's ``llama-server`` on the GGUF, one CPU slot."""

    kind = "llama.cpp"

    def __init__(self, model: Path, exe: Path, n_ctx: int = 2048, threads: int = 1):
        from hf2q.engine.tp_launch import free_ports

        self.model, self.exe = Path(model), exe
        self.url = f"http://127.0.0.1:{free_ports(1)[0]}"
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = f"{exe.parent}:{env.get('LD_LIBRARY_PATH', '')}"
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        cmd = [str(exe), "-m", str(self.model), "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
               "-c", str(n_ctx), "-t", str(threads), "-ngl", "0", "--parallel", "1", "--no-webui"]
        self._log = open(os.devnull, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(300.0)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise InputError(f"llama-server exited with {self.proc.returncode} loading {self.model.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise ConversionError(f"llama-server was not ready after {timeout:.0f} s")

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ConversionError(f"llama-server {path} answered {e.code}: {e.read()[:200]!r}") from None

    def describe(self) -> dict:
        return {"kind": self.kind, "path": str(self.model), "binary": str(self.exe)}

    def trace(self, text: str, n: int, k: int) -> Trace:
        prompt = [int(t) for t in self._post("/tokenize", {"content": text, "add_special": True})["tokens"]]
        res = self._post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0.0, "top_k": 1,
                                         "n_probs": k, "ignore_eos": True, "cache_prompt": False})
        t = Trace(text, prompt)
        for step in res.get("completion_probabilities") or []:
            top = step["top_logprobs"]
            t.tokens.append(int(step["id"]))
            t.top_ids.append([int(p["id"]) for p in top])
            t.top_logprobs.append([round(float(p["logprob"]), 6) for p in top])
        if len(t.tokens) != n:
            raise ConversionError(f"llama-server gave {len(t.tokens)} of {n} tokens for {text[:40]!r}")
        return t

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
