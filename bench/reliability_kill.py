"""Part c of the reliability suite: ``kill -9`` at random moments, and a clean SIGTERM.

- ``convert`` and ``convert --batch`` killed at a random time: whatever output exists afterwards
  is byte-identical to an uninterrupted run's (never half a GGUF), no worker outlives the killed
  parent, and a re-run succeeds, matches and leaves no temp file.
- a ``--kv-persist`` server killed under load and restarted, again and again: every block file
  present after a kill verifies (the store's own check, ``verify_file``), every one of them is
  still indexed after the restart's recovery (none quarantined or dropped), and every T=0
  answer — from restored blocks or not — equals a cold server's.
- a SIGTERM right after a long request finished: the server exits 0 with every complete block
  of that prompt on disk, and a restarted server reuses them all for the same answer.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

from reliability_common import PYTHON, ROOT, ServeProcess, Tally, child_env, run_cli

TEMP_SUFFIXES = (".tmp",)
WORDS = ("river stone lamp cloud ember harbor meadow signal copper lantern orbit thistle canyon quartz "
         "violet glacier falcon marble willow beacon summit velvet prism anchor cedar delta fjord").split()


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _temps(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.name.endswith(TEMP_SUFFIXES))


def _survivors(pgid: int, wait_s: float = 10.0) -> bool:
    """Whether any process of the killed command's group still runs after ``wait_s`` (then killed)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


# ---- convert -------------------------------------------------------------------------------------

def _convert_argv(mode: str, src: Path, out_dir: Path) -> list[str]:
    if mode == "single":
        return ["convert", str(src), "-q", "q8_0", "-o", str(out_dir / "model.gguf")]
    plan = out_dir / "plan.toml"
    plan.write_text(f'output_dir = "out"\nsources = ["{src}"]\nquants = ["q8_0", "q4_0"]\n')
    return ["convert", "--batch", str(plan), "--jobs", "2"]


def _outputs(mode: str, out_dir: Path) -> dict[str, str]:
    """Output name → sha256 of each GGUF the run has written so far."""
    root = out_dir if mode == "single" else out_dir / "out"
    return {p.name: _sha(p) for p in sorted(root.glob("*.gguf"))} if root.is_dir() else {}


def convert_campaign(work: Path, src: Path, mode: str, kills: int, rng: random.Random, tally: Tally) -> None:
    ref_dir = work / f"kill-{mode}-ref"
    shutil.rmtree(ref_dir, ignore_errors=True)
    ref_dir.mkdir(parents=True)
    r = run_cli(_convert_argv(mode, src, ref_dir), 600)
    tally.cases += 1
    if r.code != 0:
        tally.fail("wrong_exit_codes", f"{mode} reference convert exited {r.code}: {r.stderr[-300:]}")
        return
    ref, full_s = _outputs(mode, ref_dir), r.seconds
    tally.info[f"{mode}_convert_seconds"] = round(full_s, 1)
    finished_first = 0
    for i in range(kills):
        d = work / f"kill-{mode}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        argv = _convert_argv(mode, src, d)
        p = subprocess.Popen([PYTHON, "-m", "hf2q", *argv], cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(rng.uniform(0.2, full_s * 1.05))
        tally.cases += 1
        if p.poll() is not None:
            finished_first += 1
        else:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        if _survivors(p.pid):
            tally.fail("orphan_processes", f"{mode} kill {i}: a worker outlived the killed convert")
        for name, digest in _outputs(mode, d).items():
            if ref.get(name) != digest:
                tally.fail("partial_outputs", f"{mode} kill {i}: {name} differs from an uninterrupted run's")
        again = run_cli(argv, 600)
        if again.code != 0:
            tally.fail("wrong_exit_codes", f"{mode} kill {i}: re-run exited {again.code}: {again.stderr[-200:]}")
        elif _outputs(mode, d) != ref:
            tally.fail("partial_outputs", f"{mode} kill {i}: re-run output differs from the reference")
        tally.check_log(again.stderr, f"{mode} re-run {i}")
        left = _temps(d)
        if left:
            tally.fail("partial_outputs", f"{mode} kill {i}: temp files left after the re-run: {left[:3]}")
    tally.info[f"{mode}_finished_before_kill"] = finished_first


# ---- the KV-persisting server ------------------------------------------------------------------------

def kv_prompts(n: int, seed: int, words: int = 700) -> list[str]:
    """``n`` prompts over ``ceil(n / 2)`` long documents: pairs share a document's blocks, the
    documents' blocks differ, so the store holds many blocks and chains that branch."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range((n + 1) // 2)]
    return [f"Notes:\n{docs[i // 2]}\n\nQuestion {i}: which word comes up most in the notes above, and why might "
            f"{WORDS[i]} matter?" for i in range(n)]


def ask(url: str, prompt: str, max_tokens: int = 8, timeout: float = 300) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=timeout, json=_body(prompt, max_tokens))
    r.raise_for_status()
    return r.json()


def _text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"] or ""


def _cached(answer: dict) -> int:
    return answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def cold_answers(work: Path, model: Path, prompts: list[str], tally: Tally) -> list[str]:
    server = ServeProcess(["--model", str(model), "--slots", "1", "--ctx", "2048"], work / "kv-cold.log").start()
    try:
        return [_text(ask(server.url, p)) for p in prompts]
    finally:
        server.terminate()
        tally.check_log(server.log(), "cold server")


def block_files(store: Path) -> set[str]:
    d = store / "blocks"
    return {p.name for p in d.glob("*.safetensors")} if d.is_dir() else set()


def verify_blocks(store: Path, names: set[str], tally: Tally, when: str) -> set[str]:
    """The block files among ``names`` that pass the store's own verification; counts the rest."""
    from hf2q.kvstore.blockfile import BlockFileError, verify_file

    good = set()
    for name in sorted(names):
        try:
            meta = verify_file(store / "blocks" / name)
            if meta.block_hash + ".safetensors" != name:
                raise BlockFileError("name-mismatch", "file name differs from its block hash")
            good.add(name)
        except FileNotFoundError:
            continue
        except (BlockFileError, OSError) as e:
            tally.fail("corrupt_blocks", f"{when}: {name[:16]} fails verification: {e}")
    return good


def _body(prompt: str, max_tokens: int = 8) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}


def expected_blocks(model: Path, store: Path, prompts: list[str]) -> tuple[set[str], int]:
    """The block files the prompts' complete blocks must be stored as (rendered and tokenized the
    way the server does, keyed by the store's fingerprint), and how many there are. Without any
    block on disk the fingerprint is unknown: then only the count is known."""
    from hf2q.api.textbridge import GGUFChatModel
    from hf2q.api.validation import parse_chat_request
    from hf2q.kvstore.blockfile import read_meta
    from hf2q.kvstore.fingerprint import BLOCK_TOKENS, block_hashes

    chat = GGUFChatModel.from_gguf(model, model.stem)
    tokens = [list(chat.prepare(parse_chat_request(_body(p)), None).prompt_tokens) for p in prompts]
    files = sorted(block_files(store))
    if not files:
        return set(), max(len(t) // BLOCK_TOKENS for t in tokens)
    fp = read_meta(store / "blocks" / files[0]).fingerprint
    names = {h + ".safetensors" for t in tokens for h in block_hashes(fp, t)}
    return names, len(names)


def check_drained(model: Path, store: Path, prompts: list[str], tally: Tally, when: str) -> int:
    """After a clean stop: every complete block of the finished prompts is on disk and verifies."""
    names, n = expected_blocks(model, store, prompts)
    good = verify_blocks(store, block_files(store), tally, when)
    missing = n - len(names & good) if names else n
    tally.cases += 1
    if missing:
        tally.fail("lost_blocks", f"{when}: {missing} of {n} complete blocks of finished requests not on disk")
        tally.counts["lost_blocks"] += missing - 1
    return n - missing


def _load(url: str, prompts: list[str], reference: list[str], stop: threading.Event, tally: Tally,
          rng: random.Random, lock: threading.Lock, answered: threading.Semaphore) -> None:
    while not stop.is_set():
        i = rng.randrange(len(prompts))
        try:
            got = _text(ask(url, prompts[i], timeout=120))
        except httpx.HTTPStatusError as e:  # answered, but refused or failed: not the kill
            with lock:
                status = e.response.status_code
                tally.fail("server_5xx" if status >= 500 else "wrong_status", f"prompt {i}: {status} under load")
            return
        except httpx.TransportError:
            return  # the server was killed under this request
        with lock:
            tally.cases += 1
            if got != reference[i]:
                tally.fail("corrupt_blocks_used", f"prompt {i}: {got!r} != cold {reference[i]!r}")
        answered.release()


def kv_campaign(work: Path, model: Path, kills: int, rng: random.Random, tally: Tally, *, n_prompts: int,
                words: int) -> None:
    prompts = kv_prompts(n_prompts, rng.randrange(1 << 30), words)
    reference = cold_answers(work, model, prompts, tally)
    store = work / "kv-store"
    shutil.rmtree(store, ignore_errors=True)
    args = ["--model", str(model), "--slots", "2", "--ctx", "2048", "--kv-persist", str(store)]
    committed: set[str] = set()
    restored_hits = 0
    for i in range(kills + 1):
        server = ServeProcess(args, work / f"kv-serve-{i}.log").start()
        quarantined = sorted(p.name for p in (store / "quarantine").glob("*")) if (store / "quarantine").is_dir() else []
        tally.cases += 1
        lost = committed - block_files(store)
        if lost or quarantined:
            tally.fail("lost_blocks", f"restart {i}: {len(lost)} committed blocks gone, quarantined {quarantined[:3]}")
            tally.counts["lost_blocks"] += max(0, len(lost) - 1)
        if i == kills:  # the last start: every prompt once, then a clean stop
            for j, p in enumerate(prompts):
                a = ask(server.url, p)
                tally.cases += 1
                restored_hits += _cached(a) > 0
                if _text(a) != reference[j]:
                    tally.fail("corrupt_blocks_used", f"after restart, prompt {j}: {_text(a)!r} != {reference[j]!r}")
            code = server.terminate()
            if code != 0:
                tally.fail("wrong_exit_codes", f"kv server exited {code} on SIGTERM")
            tally.check_log(server.log(), f"kv server {i}")
            tally.info["kv_blocks_drained_on_sigterm"] = check_drained(model, store, prompts, tally,
                                                                       "SIGTERM after the campaign")
            break
        stop, lock, answered = threading.Event(), threading.Lock(), threading.Semaphore(0)
        clients = [threading.Thread(target=_load, args=(server.url, prompts, reference, stop, tally,
                                                        random.Random(rng.random()), lock, answered), daemon=True)
                   for _ in range(3)]
        for c in clients:
            c.start()
        # the kill lands while finished requests' blocks are being written: after a random number
        # of answers (their export starts then), at a random moment
        for _ in range(rng.randint(1, 3)):
            if not answered.acquire(timeout=180):
                tally.fail("hangs", f"kv run {i}: no answer within 180 s under load")
                break
        time.sleep(rng.uniform(0.0, 2.0))
        server.kill()
        stop.set()
        for c in clients:
            c.join(30)
        tally.info["kv_peak_rss_bytes"] = max(tally.info.get("kv_peak_rss_bytes", 0), server.peak_rss)
        committed = verify_blocks(store, block_files(store), tally, f"after kill {i}")
        tally.check_log(server.log(), f"kv server {i}")
    tally.info["kv_blocks_at_end"] = len(committed)
    tally.info["kv_prompts_restored_after_last_restart"] = restored_hits


def sigterm_case(work: Path, model: Path, tally: Tally, *, words: int, restart: bool) -> None:
    """A finished request's complete blocks must all be on disk after a clean SIGTERM (and, with
    ``restart``, reused by the next server for the same answer)."""
    from hf2q.kvstore.fingerprint import BLOCK_TOKENS

    store = work / "kv-term"
    shutil.rmtree(store, ignore_errors=True)
    args = ["--model", str(model), "--slots", "1", "--ctx", "4096", "--kv-persist", str(store)]
    prompt = kv_prompts(1, 99, words)[0]
    server = ServeProcess(args, work / "kv-term-1.log").start()
    first = ask(server.url, prompt, max_tokens=4)
    code = server.terminate()
    tally.cases += 1
    if code != 0:
        tally.fail("wrong_exit_codes", f"SIGTERM after a finished request: exit {code}")
    on_disk = check_drained(model, store, [prompt], tally, "SIGTERM after a long request")
    tally.info["sigterm_prompt_tokens"] = first["usage"]["prompt_tokens"]
    tally.info["sigterm_blocks_on_disk"] = on_disk
    tally.check_log(server.log(), "kv SIGTERM server")
    if not restart:
        return
    server = ServeProcess(args, work / "kv-term-2.log").start()
    try:
        again = ask(server.url, prompt, max_tokens=4)
    finally:
        server.terminate()
    tally.cases += 1
    tally.info["sigterm_tokens_restored"] = _cached(again)
    if _text(again) != _text(first):
        tally.fail("corrupt_blocks_used", f"SIGTERM restart: {_text(again)!r} != {_text(first)!r}")
    if _cached(again) < on_disk * BLOCK_TOKENS:
        tally.fail("lost_blocks", f"SIGTERM restart reused {_cached(again)} tokens of {on_disk * BLOCK_TOKENS} on disk")
    tally.check_log(server.log(), "kv SIGTERM restart")


def run_convert(work: Path, tally: Tally, *, src: Path, convert_kills: int, batch_kills: int, seed: int) -> None:
    rng = random.Random(seed)
    for mode, kills in (("single", convert_kills), ("batch", batch_kills)):
        t0 = time.perf_counter()
        if kills:
            convert_campaign(work, src, mode, kills, rng, tally)
        tally.info[f"{mode}_campaign_seconds"] = round(time.perf_counter() - t0, 1)


def run_kv(work: Path, model: Path, tally: Tally, *, kills: int, prompts: int, words: int, sigterm_words: int,
           restart_after_sigterm: bool, seed: int) -> None:
    rng = random.Random(seed + 1)
    t0 = time.perf_counter()
    if kills:
        kv_campaign(work, model, kills, rng, tally, n_prompts=prompts, words=words)
    tally.info["kv_campaign_seconds"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    if sigterm_words:
        sigterm_case(work, model, tally, words=sigterm_words, restart=restart_after_sigterm)
    tally.info["sigterm_seconds"] = round(time.perf_counter() - t0, 1)
