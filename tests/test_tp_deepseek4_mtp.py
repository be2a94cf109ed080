"""DeepSeek-V4's MTP head at TP = 2 on CPU ranks: the companion's block cut like a trunk block (query heads,
sinks, output groups, experts and the shared expert), its drafts and the verify forwards run on every rank.

The reference is the same trunk and companion (``tests/test_deepseek4_mtp.py``) on one process.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.engine_support import random_tokens, speculative_greedy
from tests.test_tensor_parallel import GROUP_TIMEOUT_S, ROOT

CTX = 256
PROMPT = 150  # past the 128-position window: the head's attention drops rows too
K = 3
N_NEW = 10
#: fp32 draft logits at TP = 2 against one process, relative to the largest logit (summation order only)
TOL = 1e-5


def scenario(runner, companion) -> dict[str, np.ndarray]:
    """The head enabled; a long prompt in two forwards (a prefill, then a verify keeping every position's
    streams); the head's drafts and logits; then speculative greedy decoding with its drafts, every
    draft and every verify's rows kept."""
    runner.enable_mtp(companion)
    prompt = random_tokens(PROMPT, low=3, high=49152, seed=21)
    seq = runner.new_sequence()
    runner.prefill(seq, prompt[:70])
    pending = int(np.argmax(runner.verify(seq, prompt[70:])[-1]))
    tokens, logits = runner.draft_logits(seq, pending, K)
    out = {"first_draft": np.asarray(tokens), "first_logits": logits}
    new, drafts, rows_seen = speculative_greedy(runner, seq, pending, prompt, N_NEW, K)
    out["tokens"], out["drafts"] = np.asarray(new), np.asarray(drafts)
    out["verify_rows"], out["length"] = np.concatenate(rows_seen), np.asarray([seq.length])
    model = getattr(runner, "local", runner).model  # a DistributedRunner's own rank
    out["head_bytes"] = np.asarray([sum(lin.nbytes for lin in model.mtp.block.linears())])
    return out


async def served(factory, head, prompts: list[list[int]]) -> dict:
    """The prompts concurrently through the actor runtime at T=0 with the head drafting, then the first alone
    (it drafts and verifies: ``serve_prompts``), and the drafted-token count."""
    from hf2q.actors.runtime import open_runtime
    from hf2q.sched.contracts import RuntimeConfig
    from tests.test_tensor_parallel import serve_prompts

    def load():
        runner = factory()
        runner.enable_mtp(head)
        return runner

    async with open_runtime(load, RuntimeConfig(slots=2, ctx=CTX, draft_tokens=K, gpu_deadline_s=120)) as rt:
        assert await rt.wait_ready(), rt.readiness()
        tokens = await serve_prompts(rt, prompts, max_tokens=N_NEW)
        return {"tokens": tokens, "drafted": rt.snapshot().counters["drafted_tokens"]}


def test_memory_plan_counts_a_ranks_share_of_the_head():
    """At TP = 2 each rank's plan holds its share of the companion's block, not the whole of it."""
    from hf2q.engine.memory_plan import rank_need
    from hf2q.formats.gguf_file import open_gguf
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_engine_deepseek4 import deepseek4_gguf

    trunk, head = open_gguf(deepseek4_gguf()), open_gguf(companion_gguf())

    def head_bytes(size: int) -> int:
        plan = dict(float_bytes=4, scale_bytes=2)
        return (rank_need(trunk, size, 0, mtp=True, draft=head, **plan).weights
                - rank_need(trunk, size, 0, mtp=True, **plan).weights)
    one, share = head_bytes(1), head_bytes(2)
    assert 0.4 * one < share < 0.75 * one, (share, one)


DRIVER = r"""
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from tests import test_tp_deepseek4_mtp as t
from hf2q.engine import tp_launch
mode, trunk, head, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
if mode == "engine":
    runner = tp_launch.runner_factory(trunk, 2, t.CTX)()
    result = t.scenario(runner, head)
    runner.close()
    with open(out, "wb") as f:
        np.savez(f, **result)
elif mode == "missing":  # rank 0 holds the companion open; the follower finds no file at its path
    import os, shutil
    from hf2q.errors import InputError
    from hf2q.formats.gguf_file import open_gguf
    runner = tp_launch.runner_factory(trunk, 2, t.CTX)()
    copy = out + ".companion.gguf"
    shutil.copy(head, copy)
    draft = open_gguf(copy)
    os.remove(copy)
    try:
        runner.enable_mtp(draft)
        got = dict(error=None)
    except InputError as e:
        got = dict(error=str(e))
    seq = runner.new_sequence()  # the group is still in step: the same collectives ran on both ranks
    got["logits"] = runner.prefill(seq, [5, 6, 7]).tolist()
    runner.close()
    open(out, "w").write(json.dumps(got))
else:
    import os
    os.environ["HF2Q_TP_PIPELINE"] = "1"  # queue decode steps ahead, as over NCCL (GPUs)
    import trio
    got = trio.run(t.served, tp_launch.runner_factory(trunk, 2, t.CTX), head, json.loads(sys.argv[5]))
    open(out, "w").write(json.dumps(got))
"""


def run_group(tmp_path, *args: str) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT)))
    run = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=GROUP_TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_draft_and_verify_as_one_process(tmp_path):
    from hf2q.engine.runner import MlxModelRunner
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_engine_deepseek4 import deepseek4_gguf

    trunk, head = deepseek4_gguf(), companion_gguf()
    run_group(tmp_path, "engine", str(trunk), str(head), str(tmp_path / "out"))
    with np.load(tmp_path / "out") as z:
        tp = {k: z[k] for k in z.files}
    ref = scenario(MlxModelRunner.load(trunk, ctx=CTX), head)
    for key in ("first_draft", "tokens", "drafts", "length"):
        np.testing.assert_array_equal(tp[key], ref[key], err_msg=key)
    assert len(ref["drafts"]) >= 2 * K  # several draft rounds ran
    # a rank holds its share of the head's block (its heads, groups and experts), not the whole block
    one, share = int(ref["head_bytes"][0]), int(tp["head_bytes"][0])
    assert 0.4 * one < share < 0.75 * one, (share, one)
    for key in ("first_logits", "verify_rows"):
        scale = float(np.abs(ref[key]).max())
        np.testing.assert_allclose(tp[key], ref[key], rtol=0, atol=TOL * scale, err_msg=key)


@pytest.mark.slow
def test_runtime_on_two_ranks_drafts_and_serves_what_one_rank_serves(tmp_path):
    """Two concurrent T=0 requests (batched decode), then the first alone, drafting with the head and verifying
    on both ranks: the tokens one process serves without the head."""
    import json

    import trio

    from hf2q.engine.tp_launch import runner_factory
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_engine_deepseek4 import deepseek4_gguf
    from tests.test_tp_deepseek4 import served_tokens

    trunk, head = deepseek4_gguf(), companion_gguf()
    prompts = [random_tokens(PROMPT, low=3, high=49152, seed=5), random_tokens(30, low=3, high=49152, seed=6)]
    run_group(tmp_path, "runtime", str(trunk), str(head), str(tmp_path / "out"), json.dumps(prompts))
    got = json.loads((tmp_path / "out").read_text())
    want = trio.run(served_tokens, runner_factory(trunk, 1, CTX), prompts)
    assert got["drafted"] > 0  # the request alone drafted
    assert [t[:8] for t in got["tokens"]] == want, (got, want)


@pytest.mark.slow
def test_a_rank_that_cannot_load_the_head_fails_the_start_on_every_rank(tmp_path):
    """A follower whose companion path holds no file (another host's disk) makes ``enable_mtp`` raise one
    line on rank 0 naming that rank, instead of the group breaking at the first draft; the group stays in step."""
    from hf2q.engine.runner import MlxModelRunner
    from tests.test_deepseek4_mtp import companion_gguf
    from tests.test_engine_deepseek4 import deepseek4_gguf

    import json

    trunk = deepseek4_gguf()
    run_group(tmp_path, "missing", str(trunk), str(companion_gguf()), str(tmp_path / "out"))
    got = json.loads((tmp_path / "out").read_text())
    assert got["error"] is not None and "rank 1" in got["error"] and "draft head" in got["error"], got["error"]
    ref = MlxModelRunner.load(trunk, ctx=CTX)
    want = ref.prefill(ref.new_sequence(), [5, 6, 7])
    np.testing.assert_allclose(np.asarray(got["logits"]), want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
