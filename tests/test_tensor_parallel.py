"""Tensor parallelism over ``mx.distributed`` (ring backend, ranks on 127.0.0.1).

The reference is always the same GGUF run by the plain single-process ``MlxModelRunner``:
a tensor-parallel group must produce the same greedy tokens and (up to float summation
order) the same logits for every engine call the runtime makes — chunked prefill, batched
decode of sequences of different lengths, trim + re-prefill (prefix reuse), KV export and
import. Weight slicing is checked against ``gguf``'s own dequantizer.

Each group runs in a child process (``mx.distributed.init`` is once per process): the
child runs :func:`scenario` on ``tp_launch.runner_factory(path, N)`` and saves what it
saw; the test runs the same scenario on one rank in-process and compares.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import quants

from hf2q.engine.tensor_parallel import head_plan, shard_gguf
from hf2q.engine.tp_shards import slice_tensor
from hf2q.errors import InputError
from hf2q.formats.gguf_file import open_gguf

ROOT = Path(__file__).resolve().parents[1]
CTX = 256
GROUP_TIMEOUT_S = 240  # a whole child run (start-up of N ranks on a busy 2-core machine + the scenario)


# ---------------------------------------------------------------------------- models

TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type")


def without_tokenizer_arrays(src: Path, dst: Path) -> Path:
    """A copy of ``src`` minus the vocabulary string arrays (tensors and other metadata byte-identical).

    Tensor parallelism never touches the tokenizer, but ``gguf.GGUFReader`` needs ~20 s on a
    busy 2-core machine to parse Qwen3's 151k tokens + merges, once per rank and once more
    for the reference; the tests that compare numbers use this lean copy.
    """
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.get_field("general.architecture").contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in TOKENIZER_ARRAYS:
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # data keeps its (byte) shape
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_checkpoint):
    """``tiny_gguf(family, quant)`` → a GGUF converted by hf2q from the tiny random checkpoint (lean copy)."""
    from hf2q.cli import main

    out_dir = tmp_path_factory.mktemp("tp-models")
    made: dict[tuple[str, str], Path] = {}

    def make(family: str, quant: str) -> Path:
        if (family, quant) not in made:
            full = out_dir / f"{family}-{quant}.full.gguf"
            assert main(["convert", str(tiny_checkpoint(family)), "--quant", quant, "-o", str(full)]) == 0
            made[family, quant] = without_tokenizer_arrays(full, out_dir / f"{family}-{quant}.gguf")
        return made[family, quant]
    return make


# ---------------------------------------------------------------------------- the scenario

def scenario(runner, prompt: list[int], n_decode: int = 6) -> dict[str, np.ndarray]:
    """Every call the serving runtime makes, in a fixed order; returns logits and greedy tokens."""
    out: dict[str, np.ndarray] = {}
    a = runner.new_sequence()
    runner.prefill(a, prompt[:5])
    out["prefill_a"] = runner.prefill(a, prompt[5:])  # chunked prefill
    toks = [int(out["prefill_a"].argmax())]
    steps = []
    for _ in range(n_decode):
        lg = runner.decode([a], [toks[-1]])[0]
        steps.append(lg)
        toks.append(int(lg.argmax()))
    out["decode_a"] = np.stack(steps)
    out["tokens_a"] = np.asarray(toks)
    b = runner.new_sequence()
    out["prefill_b"] = runner.prefill(b, prompt[2:5])
    tb, ta = int(out["prefill_b"].argmax()), toks[-1]
    batched = []
    for _ in range(3):  # sequences of different lengths in one batched step
        lg = runner.decode([a, b], [ta, tb])
        batched.append(lg)
        ta, tb = int(lg[0].argmax()), int(lg[1].argmax())
    out["decode_ab"] = np.stack(batched)
    a.trim(4)  # prefix reuse: keep 4 positions, recompute the rest
    out["after_trim"] = runner.prefill(a, prompt[4:7])
    kv = runner.export_kv(b, 0, b.length)
    out["kv_k0"] = kv["k.0"]
    c = runner.new_sequence()
    runner.import_kv(c, kv, b.length)
    out["decode_imported"] = runner.decode([c], [7])[0]
    del a  # released on the followers with the next command
    out["decode_after_release"] = runner.decode([b], [9])[0]
    out["lengths"] = np.asarray([b.length, c.length])
    return out


DRIVER = r"""
import json, os, signal, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from tests.test_tensor_parallel import scenario
from hf2q.engine import tp_launch
path, size, outdir, prompt, then = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
t0 = time.monotonic()
runner = tp_launch.runner_factory(path, size, {ctx})()
t1 = time.monotonic()
np.savez(os.path.join(outdir, "result.npz"), **scenario(runner, prompt))
info = {{"start_s": t1 - t0, "scenario_s": time.monotonic() - t1, "pids": runner.followers.pids,
        "kv_bytes_per_token": runner.kv_bytes_per_token}}
if then == "kill":  # a follower dies: the next call must raise, and so must every later one
    seq = runner.new_sequence()
    os.kill(runner.followers.pids[0], signal.SIGKILL)
    errors = []
    for _ in range(2):
        t = time.monotonic()
        try:
            runner.decode([seq], [1])
            errors.append(None)
        except Exception as e:
            errors.append([type(e).__name__, str(e), time.monotonic() - t])
    info["errors"] = errors
json.dump(info, open(os.path.join(outdir, "info.json"), "w"))
if then == "vanish":  # rank 0 disappears without a word: followers must exit on their own
    os._exit(0)
runner.close()
"""


def run_group(path: Path, size: int, prompt: list[int], tmp_path: Path, then: str = "close") -> tuple[dict, dict]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    proc = subprocess.run([sys.executable, str(script), str(path), str(size), str(tmp_path), json.dumps(prompt),
                           then], check=False, cwd=ROOT, capture_output=True, text=True, timeout=GROUP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "info.json").read_text())
    with np.load(tmp_path / "result.npz") as z:
        return {k: z[k] for k in z.files}, info


def reference(path: Path, prompt: list[int]) -> dict[str, np.ndarray]:
    from hf2q.engine.runner import MlxModelRunner

    return scenario(MlxModelRunner.load(path, ctx=CTX), prompt)


def assert_same_run(tp: dict, ref: dict, rtol: float) -> None:
    for key, want in ref.items():
        if key.startswith(("tokens", "lengths")):
            np.testing.assert_array_equal(tp[key], want, err_msg=key)
        else:
            scale = float(np.abs(want).max())
            np.testing.assert_allclose(tp[key], want, rtol=0, atol=rtol * scale, err_msg=key)
    # greedy choices at every position where the reference has a clear winner
    for key in ("prefill_a", "decode_a", "decode_ab", "after_trim", "decode_imported"):
        r, t = ref[key].reshape(-1, ref[key].shape[-1]), tp[key].reshape(-1, tp[key].shape[-1])
        top2 = np.sort(r, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) > 1e-3 * np.abs(r).max()
        np.testing.assert_array_equal(t.argmax(-1)[clear], r.argmax(-1)[clear], err_msg=key)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


# ---------------------------------------------------------------------------- slicing (no processes)

def test_head_plans_cover_every_head_once():
    for n_heads, n_kv, size in [(4, 2, 2), (32, 8, 4), (16, 8, 8), (9, 3, 3), (4, 1, 2), (8, 2, 4)]:
        plans = [head_plan(n_heads, n_kv, size, r) for r in range(size)]
        q = [h for p in plans for h in range(p.q_start, p.q_start + p.q_count)]
        assert q == list(range(n_heads))
        group = n_heads // n_kv
        for p in plans:  # every query head's KV head is on the same rank
            for h in range(p.q_start, p.q_start + p.q_count):
                assert p.kv_start <= h // group < p.kv_start + p.kv_count
        assert sorted({p.kv_start for p in plans}) == list(range(0, n_kv, max(1, n_kv // size)))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_a_gathered_block_keeps_every_layers_heads_when_layers_differ(monkeypatch, size):
    """Gemma 4 31B's shape (sliding layers 16 KV heads, global ones 4), the global layer first: the export split
    (``rank_plan``) must dedupe by the fewest replicas, or at 8 ranks the sliding layer's rows of every other rank
    are dropped; each rank then finds its own heads of every layer in the kept ranks."""
    from types import SimpleNamespace

    from hf2q.engine import tensor_parallel as tp

    layers = [(4, 512, 512), (16, 256, 256)]
    monkeypatch.setattr(tp, "attention_geometry", lambda g: (32, layers))
    g = SimpleNamespace(path=Path("gemma4-31b.gguf"))
    plans = [tp.rank_plan(g, size, r) for r in range(size)]
    replicas = plans[0].kv_replicas
    kept = list(range(size))[::replicas]  # gather_kv's dedup of the all-gathered ranks
    for n_kv, _, _ in layers:
        held = [head_plan(32, n_kv, size, r) for r in range(size)]
        heads = {h for r in kept for h in range(held[r].kv_start, held[r].kv_start + held[r].kv_count)}
        assert heads == set(range(n_kv))
        for r in range(size):  # head_slice: rank r restores from the kept rank of its group
            src = held[kept[r // replicas]]
            assert (src.kv_start, src.kv_count) == (held[r].kv_start, held[r].kv_count)


def test_unsplittable_head_counts_are_input_errors():
    with pytest.raises(InputError, match="9 attention heads do not split over 2"):
        head_plan(9, 3, 2, 0)
    with pytest.raises(InputError, match="4 KV heads do not split over 6"):
        head_plan(24, 4, 6, 0)


@pytest.mark.parametrize("quant", ["q4_0", "q8_0", "f32"])
def test_shards_reassemble_the_weights(tiny_gguf, quant):
    """Row and block-aligned column slices of every sharded tensor dequantize (gguf-py) to the full tensor."""
    g = open_gguf(tiny_gguf("llama", quant))
    shards = [shard_gguf(g, r, 2) for r in range(2)]
    axes = {"attn_q": 0, "attn_k": 0, "attn_v": 0, "ffn_gate": 0, "ffn_up": 0, "attn_output": 1, "ffn_down": 1}
    checked = 0
    for name, t in g.tensors.items():
        kind = name.split(".")[2] if name.startswith("blk.") else None
        full = quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)
        parts = [quants.dequantize(np.ascontiguousarray(s.tensors[name].data), t.qtype)
                 .reshape(s.tensors[name].shape) for s in shards]
        if kind in axes:
            assert parts[0].shape[axes[kind]] == t.shape[axes[kind]] // 2
            np.testing.assert_array_equal(np.concatenate(parts, axis=axes[kind]), full, err_msg=name)
            checked += 1
        else:  # replicated: norms, embeddings
            for p in parts:
                np.testing.assert_array_equal(p, full, err_msg=name)
    assert checked == 7 * 2
    meta = shards[1].metadata
    assert meta["llama.attention.head_count"] == 2 and meta["llama.attention.head_count_kv"] == 1


def test_column_cut_inside_a_quant_block_is_refused(tiny_gguf):
    t = open_gguf(tiny_gguf("llama", "q4_0")).tensors["blk.0.ffn_down.weight"]
    with pytest.raises(InputError, match="not aligned to the 32-element Q4_0 blocks"):
        slice_tensor(t, -1, 0, 48)


# ---------------------------------------------------------------------------- real groups

@pytest.mark.slow
def test_two_ranks_match_one_rank_llama_then_followers_outlive_nobody(tiny_gguf, tmp_path):
    path = tiny_gguf("llama", "f32")
    prompt = [1, 504, 3094, 1210, 282, 253, 3467, 30, 1205, 314]
    tp, info = run_group(path, 2, prompt, tmp_path, then="vanish")
    ref = reference(path, prompt)
    assert_same_run(tp, ref, rtol=1e-5)
    spec = open_gguf(path)
    head_dim = int(spec.get(".attention.key_length"))
    assert info["kv_bytes_per_token"] == 2 * 1 * head_dim * 2 * 4  # 2 layers × 1 of 2 KV heads × K,V × f32
    deadline = time.monotonic() + 15
    while not all(gone(p) for p in info["pids"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(p) for p in info["pids"]), "a follower outlived rank 0"


@pytest.mark.slow
def test_two_ranks_match_one_rank_quantized_qwen3_moe_and_a_dead_rank_fails_closed(tiny_gguf, tmp_path):
    """Qwen3 attention (q/k norms, head_dim × heads ≠ hidden) and 4 experts split 2 + 2, all Q4_0/Q8_0."""
    path = tiny_gguf("qwen3_moe", "q4_0")
    g = open_gguf(path)
    assert g.tensors["blk.0.ffn_down_exps.weight"].qtype.name == "Q4_0"
    assert [s.tensors["blk.0.ffn_up_exps.weight"].shape[0] for s in (shard_gguf(g, 0, 2), shard_gguf(g, 1, 2))] == [2, 2]
    prompt = [151644, 872, 198, 9707, 11, 1246, 525, 498, 30, 151645]
    tp, info = run_group(path, 2, prompt, tmp_path, then="kill")
    ref = reference(path, prompt)
    assert_same_run(tp, ref, rtol=1e-4)
    first, second = info["errors"]
    assert first is not None and second is not None, "a call after a rank died did not raise"
    assert first[0] == "GroupBroken" and second[0] == "GroupBroken"
    assert first[2] < 10, f"took {first[2]:.1f} s to notice the dead rank"
    assert "rank 1" in first[1] or "peer was lost" in first[1]


@pytest.mark.slow
def test_gemma3_single_kv_head_is_replicated_over_two_ranks(tiny_gguf, tmp_path, monkeypatch):
    """Gemma 3 (4 heads, 1 KV head → the KV head on both ranks), sliding-window layers, Q8_0.

    The prompt is longer than the tiny model's window (16) so the local-attention mask matters;
    the exported KV has the model's single head (replicas gathered once). Every position is kept
    (``HF2Q_SWA_FULL=1``) because the scenario exports KV, which a windowed cache refuses; the
    windowed cache at TP is tests/test_tp_multihost.py's.
    """
    monkeypatch.setenv("HF2Q_SWA_FULL", "1")
    path = tiny_gguf("gemma3", "q8_0")
    prompt = [2, 106, 1645, 108, 3689, 563, 506, 5279, 529, 7001, 236881, 107] * 3
    tp, info = run_group(path, 2, prompt, tmp_path)
    ref = reference(path, prompt)
    assert tp["kv_k0"].shape[0] == 1
    assert_same_run(tp, ref, rtol=1e-4)
    head_dim = int(open_gguf(path).get(".attention.key_length"))
    assert info["kv_bytes_per_token"] == 3 * 1 * head_dim * 2 * 4  # replicated: same as one rank


@pytest.mark.slow
def test_smollm2_q4_1_at_three_ranks_matches_one_rank(smollm2_gguf, tmp_path):
    """The real SmolLM2-135M Q4_1 (9 heads / 3 KV → 3 ranks), a real chat prompt, greedy T=0.

    Two ranks cannot split 9 heads: that is refused up front, before any process starts.
    """
    from hf2q.engine.tp_launch import plan_split
    from hf2q.text.tokenizer import GGUFTokenizer

    g = open_gguf(smollm2_gguf)
    with pytest.raises(InputError, match="9 attention heads do not split over 2 ranks"):
        plan_split(g, 2)
    assert [p.q_count for p in plan_split(g, 3)] == [3, 3, 3]

    prompt = GGUFTokenizer.from_gguf(smollm2_gguf).encode("<|im_start|>user\nWhat is the capital of France?")
    assert len(prompt) >= 8
    tp, _ = run_group(smollm2_gguf, 3, prompt, tmp_path)
    ref = reference(smollm2_gguf, prompt)
    assert_same_run(tp, ref, rtol=1e-3)


# ---------------------------------------------------------------------------- through the serving runtime

async def serve_prompts(rt, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    """Run ``prompts`` concurrently through the actor runtime at T=0, then the first again (slot reuse)."""
    import trio

    from hf2q.sched.contracts import AdmissionRejected
    from hf2q.sched.contracts import Failed, GenerationRequest, SamplingParams, Token

    async def one(i: int, prompt: list[int], out: list) -> None:
        try:
            events = await rt.submit(GenerationRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=max_tokens)))
        except AdmissionRejected as e:
            out[i] = [f"rejected {e.status} {e.code}"]
            return
        toks = []
        async with events:
            async for ev in events:
                if isinstance(ev, Token):
                    toks.append(ev.token_id)
                elif isinstance(ev, Failed):
                    toks.append(f"failed {ev.status} {ev.code}")
        out[i] = toks

    results: list = [None] * (len(prompts) + 1)
    async with trio.open_nursery() as nursery:
        for i, p in enumerate(prompts):
            nursery.start_soon(one, i, p, results)
    await one(len(prompts), prompts[0], results)
    return results


def runtime_config():
    from hf2q.sched.contracts import RuntimeConfig

    return RuntimeConfig(slots=2, ctx=CTX, prefill_chunk=4, gpu_deadline_s=60)


RUNTIME_DRIVER = r"""
import json, os, signal, sys
sys.path.insert(0, {root!r})
import trio
from tests.test_tensor_parallel import runtime_config, serve_prompts
from hf2q.actors.runtime import open_runtime
from hf2q.engine import tp_launch

def followers():
    out = []
    for pid in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{{pid}}/cmdline", "rb").read()
        except OSError:
            continue
        if pid.isdigit() and int(stat[1]) == os.getpid() and b"hf2q.engine.tp_launch" in cmd:
            out.append(int(pid))
    return out

async def main(path, size, prompts):
    async with open_runtime(tp_launch.runner_factory(path, size, {ctx}), runtime_config()) as rt:
        assert await rt.wait_ready(), rt.readiness()
        tokens = await serve_prompts(rt, prompts)
        pids = followers()
        os.kill(pids[0], signal.SIGKILL)  # a rank dies: the engine must fail closed
        after = await serve_prompts(rt, prompts[:1], max_tokens=2)
        ready, detail = rt.readiness()
        print(json.dumps({{"tokens": tokens, "after": after, "ready": ready, "detail": detail, "pids": pids}}))

trio.run(main, sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
"""


@pytest.mark.slow
async def test_runtime_on_two_ranks_serves_what_one_rank_serves_and_fails_closed(tiny_gguf, tmp_path):
    """The GPU-owner thread builds rank 0 (``runner_factory``); slots, chunked prefill, batched decode, reuse."""
    import trio

    from hf2q.actors.runtime import open_runtime
    from hf2q.engine.tp_launch import runner_factory

    path = tiny_gguf("llama", "q8_0")
    prompts = [[1, 504, 3094, 1210, 282, 253, 3467, 30, 1205], [1, 2129, 314, 5, 1140, 2616]]
    script = tmp_path / "runtime_driver.py"
    script.write_text(RUNTIME_DRIVER.format(root=str(ROOT), ctx=CTX))
    with trio.fail_after(GROUP_TIMEOUT_S):
        proc = await trio.run_process([sys.executable, str(script), str(path), "2", json.dumps(prompts)], cwd=ROOT,
                                      capture_stdout=True, capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    got = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    async with open_runtime(runner_factory(path, 1, CTX), runtime_config()) as rt:
        assert await rt.wait_ready()
        want = await serve_prompts(rt, prompts)
    assert got["tokens"] == want and all(len(t) == 8 for t in want)
    # fail closed: the request in flight when the rank died fails (or, if the idle peer watch saw the death
    # before it was admitted, is rejected), and the next is rejected
    assert got["after"][0] in (["failed 503 engine_unhealthy"], ["rejected 503 engine_unhealthy"]), got["after"]
    assert got["after"][1] == ["rejected 503 engine_unhealthy"], got["after"]
    assert got["ready"] is False and "tensor-parallel" in got["detail"], got["detail"]


def test_dead_peer_names_the_rank_and_stops_the_survivors_once():
    """``dead_peer`` (polled by the runtime while a step hangs in a collective) fails the group closed."""
    from types import SimpleNamespace

    from hf2q.engine.distributed_runner import DistributedRunner, GroupBroken

    local = SimpleNamespace(vocab_size=10, n_ctx_train=8, n_ctx=8, eos_token_ids=frozenset(), is_embedding_model=False,
                            kv_bytes_per_token=4, gguf=None, arch="llama", dtype=None, stats={}, kv_identity="x",
                            new_sequence=lambda: None)
    dead = {"rank": None}
    stopped = []

    def check_alive():
        if dead["rank"] is not None:
            raise GroupBroken(f"tensor-parallel rank {dead['rank']} exited with status -9")

    r = DistributedRunner(local, [], [None], None, check_alive=check_alive, on_fault=lambda: stopped.append(1))
    assert r.dead_peer() is None and not stopped
    dead["rank"] = 2
    assert r.dead_peer() == "tensor-parallel rank 2 exited with status -9"
    assert r.dead_peer() is not None and stopped == [1]  # survivors stopped once
    with pytest.raises(GroupBroken, match="rank 2 exited"):
        r.new_sequence()  # every later call is refused
