"""A tensor-parallel group started the multi-host way: ``hf2q serve --hostfile`` + ``hf2q tp-follower``.

The "hosts" are two processes on 127.0.0.1 (ring backend), each started by its own command as
on two machines — rank 0 never spawns the follower. References: the same GGUF served by one
rank (``hf2q serve`` without tensor parallelism, a real HTTP client) and, for the engine calls,
the single-process ``MlxModelRunner`` on MLX's graph path.
"""

from __future__ import annotations

import functools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from hf2q.engine.tp_hosts import SECRET_ENV, TPHosts, group_size, hosts_from_list, read_hostfile
from hf2q.engine.tp_launch import free_ports
from hf2q.errors import InputError, UsageError

ROOT = Path(__file__).resolve().parents[1]
CTX = 512
PY = [sys.executable, "-m", "hf2q"]


@pytest.fixture(autouse=True)
def group_secret(monkeypatch):
    """Every rank of a group across hosts needs the shared secret (the subprocesses inherit it)."""
    monkeypatch.setenv(SECRET_ENV, "tp-test-secret")


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    """``models(family, quant)`` → a GGUF hf2q converted from the tiny random checkpoint (tokenizer kept)."""
    from hf2q.cli import main

    out = tmp_path_factory.mktemp("tp-hosts")

    @functools.cache
    def convert(family: str, quant: str) -> Path:
        path = out / f"{family}-{quant}.gguf"
        assert main(["convert", str(tiny_checkpoint(family)), "--quant", quant, "-o", str(path)]) == 0
        return path
    return convert


def base_port(n: int) -> int:
    """A port ``P`` with ``P .. P+n-1`` free now (ring listeners + rank 0's control port)."""
    for _ in range(50):
        p = free_ports(1)[0]
        if p + n > 65535:
            continue
        socks = []
        try:
            for q in range(p, p + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no run of free ports")


def two_hosts(tmp_path: Path) -> tuple[Path, int]:
    """An ``mlx.launch`` hostfile of two hosts, both 127.0.0.1, and a base port for the group."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]}] * 2))
    return hostfile, base_port(3)


def follower(model: Path, hostfile: Path | str, port: int, log: Path) -> subprocess.Popen:
    """``hf2q tp-follower`` as rank 1; ``hostfile`` a path (``--hostfile``) or a comma list (``--hosts``)."""
    where = ["--hostfile", str(hostfile)] if isinstance(hostfile, Path) else ["--hosts", hostfile]
    return subprocess.Popen([*PY, "tp-follower", str(model), "--rank", "1", *where, "--tp-port", str(port)],
                            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen, sig=signal.SIGTERM, wait: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ---------------------------------------------------------------------------- the hostfile (no processes)

def test_hostfile_is_mlx_launch_format_and_bad_ones_are_one_line_errors(tmp_path):
    f = tmp_path / "h.json"
    f.write_text(json.dumps({"backend": "ring", "envs": ["A_TP_TEST=1"],
                             "hosts": [{"ssh": "a", "ips": ["10.0.0.1", "10.1.0.1"]}, {"ssh": "b"}]}))
    h = read_hostfile(f, 40000)
    assert h.addresses == ("10.0.0.1", "b") and h.backend == "ring" and h.envs == (("A_TP_TEST", "1"),)
    assert h.ring() == ["10.0.0.1:40000", "b:40001"] and h.control == ("10.0.0.1", 40002)
    assert group_size(1, h) == 2 and group_size(2, h) == 2
    with pytest.raises(UsageError, match="--tensor-parallel 4 but the hostfile lists 2 hosts"):
        group_size(4, h)
    for text, message in [("[", "not a JSON hostfile"), ('[{"ssh": "a"}]', "at least 2 hosts"),
                          ('[{"ssh": "a"}, {"ips": []}]', "host 1 has neither"),
                          ('{"backend": "mpi", "hosts": [{"ssh": "a"}, {"ssh": "b"}]}', "backend 'mpi'")]:
        f.write_text(text)
        with pytest.raises(InputError, match=message):
            read_hostfile(f)
    with pytest.raises(InputError, match="does not exist"):
        read_hostfile(tmp_path / "none.json")
    assert hosts_from_list("10.0.0.1, gpu-b", 40000) == TPHosts(("10.0.0.1", "gpu-b"), 40000)
    for text in ("a", "a,,b"):
        with pytest.raises(InputError, match="at least 2 comma-separated"):
            hosts_from_list(text)


def test_serve_refuses_a_bad_hostfile_before_loading(models, tmp_path):
    """Exit 3 (missing file) and 2 (sizes disagree), one line each, before any rank starts."""
    model = models("llama", "f32")
    hostfile, port = two_hosts(tmp_path)
    runs = [subprocess.run([*PY, "serve", "--model", str(model), "--port", str(free_ports(1)[0]), *args],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
            for args in (["--hostfile", str(tmp_path / "missing.json")],
                         ["--hostfile", str(hostfile), "--tensor-parallel", "3"])]
    assert [r.returncode for r in runs] == [3, 2], [r.stderr for r in runs]
    for r in runs:
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("hf2q: error: "), r.stderr


# ---------------------------------------------------------------------------- start-up failures

def test_a_rank_that_never_joins_or_holds_another_model_fails_in_one_line(models, tmp_path):
    """No follower: serve exits 1 naming the missing host and the command to start there; a follower
    with no rank 0 gives up likewise; a follower whose GGUF differs is refused (both exit 1)."""
    model, other = models("llama", "f32"), models("llama", "q8_0")
    hostfile, port = two_hosts(tmp_path)
    alone = subprocess.Popen([*PY, "serve", "--model", str(model), "--hostfile", str(hostfile), "--tp-port", str(port),
                              "--tp-timeout", "3", "--port", str(free_ports(1)[0]), "--operator-ui", "plain"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (tmp_path / "b").mkdir()
    hostfile2, port2 = two_hosts(tmp_path / "b")
    lonely = subprocess.run([*PY, "tp-follower", str(model), "--rank", "1", "--hostfile", str(hostfile2),
                             "--tp-port", str(port2), "--tp-timeout", "1"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    _, err = alone.communicate(timeout=120)
    assert alone.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hf2q: error: model failed to load") and "rank 1 (127.0.0.1) never joined" in last, err
    assert "hf2q tp-follower --hostfile FILE --rank 1 MODEL" in last and "3 s" in last, last
    assert lonely.returncode == 1 and lonely.stderr.strip().splitlines() == [
        f"hf2q: error: tensor-parallel rank 1: rank 0 at 127.0.0.1:{port2 + 2} did not answer within 1 s "
        f"(Connection refused); start `hf2q serve --hostfile …` there"], lonely.stderr

    hostfile, port = two_hosts(tmp_path)
    wrong = follower(other, hostfile, port, tmp_path / "wrong.log")
    server = subprocess.run([*PY, "serve", "--model", str(model), "--hostfile", str(hostfile), "--tp-port", str(port),
                             "--tp-timeout", "60", "--port", str(free_ports(1)[0]), "--operator-ui", "plain"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert stop(wrong, wait=30) == 1
    refusal = "rank 1 (127.0.0.1) opened a different model than rank 0's llama-f32.gguf (every host needs the same GGUF)"
    assert server.returncode == 1 and refusal in server.stderr.strip().splitlines()[-1], server.stderr
    assert f"rank 0 refused it: {refusal}" in (tmp_path / "wrong.log").read_text()


# ---------------------------------------------------------------------------- serving across "hosts"

PROMPTS = ["Name three colours.", "What is two plus two?", "Say hello in French."]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "not ready in time: " + log.read_text()[-3000:]
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def chat(url: str, content: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def concurrent_answers(url: str) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: chat(url, p), PROMPTS))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["message"]["content"] for r in replies]


@pytest.mark.slow
def test_two_hosts_serve_what_one_rank_serves_and_a_killed_remote_rank_fails_closed(models, tmp_path):
    """Three concurrent T=0 chat requests (decoded together, 3 slots) get the same answers from the
    two-"host" group as from one rank; then ``kill -9`` of the remote rank mid-stream ends that stream
    with ``engine_unhealthy``, ``/readyz`` turns 503, new requests get 503, SIGTERM still drains."""
    model = models("llama", "f32")
    hostfile, port = two_hosts(tmp_path)
    # the remote host's command, started first; its --hosts is the hostfile's short form
    rank1 = follower(model, "127.0.0.1,127.0.0.1", port, tmp_path / "rank1.log")
    serve_args = ["--model", str(model), "--model-name", "m", "--slots", "3", "--ctx", str(CTX), "--operator-ui", "plain"]
    tp_port, one_port = free_ports(2)
    logs = {n: tmp_path / f"serve-{n}.log" for n in ("tp", "one")}
    tp = subprocess.Popen([*PY, "serve", *serve_args, "--hostfile", str(hostfile), "--tp-port", str(port),
                           "--port", str(tp_port)], cwd=ROOT, stdout=logs["tp"].open("wb"), stderr=subprocess.STDOUT)
    one = subprocess.Popen([*PY, "serve", *serve_args, "--port", str(one_port)], cwd=ROOT,
                           stdout=logs["one"].open("wb"), stderr=subprocess.STDOUT)
    tp_url, one_url = f"http://127.0.0.1:{tp_port}", f"http://127.0.0.1:{one_port}"
    try:
        wait_ready(one_url, one, logs["one"])
        wait_ready(tp_url, tp, logs["tp"])
        want = concurrent_answers(one_url)
        stop(one)
        got = concurrent_answers(tp_url)
        assert got == want and all(want), (got, want)

        seen: dict = {"lines": []}
        started = threading.Event()

        def long_stream() -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 400,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", tp_url + "/v1/chat/completions", json=body, timeout=120) as resp:
                seen["status"] = resp.status_code
                for line in resp.iter_lines():
                    if line:
                        seen["lines"].append(line)
                    if len(seen["lines"]) >= 3:
                        started.set()
            seen["ended"] = time.monotonic()
            started.set()

        reader = threading.Thread(target=long_stream)
        reader.start()
        assert started.wait(60) and "ended" not in seen, seen
        rank1.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        reader.join(60)
        assert seen["status"] == 200 and "ended" in seen, seen
        assert seen["ended"] - killed < 5, f"the stream took {seen['ended'] - killed:.1f} s to end"
        errors = [json.loads(line[5:]) for line in seen["lines"] if line.startswith("data: {\"error\"")]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_unhealthy", seen["lines"][-3:]
        assert "rank 1 (127.0.0.1) closed its control connection" in errors[0]["error"]["message"]
        assert httpx.get(tp_url + "/readyz", timeout=5).status_code == 503
        after = chat(tp_url, PROMPTS[1])
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_unhealthy"
        assert stop(tp) == 0, logs["tp"].read_text()[-2000:]
    finally:
        for p in (tp, one, rank1):
            stop(p, signal.SIGKILL, 10)


async def test_a_rank_that_dies_while_idle_turns_readyz_503_without_a_request():
    """The runtime watches a group's ranks while nothing runs (a host can vanish at any time): once
    ``dead_peer`` names one, readiness is False and new requests are rejected 503 ``engine_unhealthy``."""
    import trio

    from hf2q.actors.runtime import open_runtime
    from hf2q.sched.contracts import AdmissionRejected, GenerationRequest, RuntimeConfig, SamplingParams
    from tests.fakes import FakeModelRunner

    fake = FakeModelRunner()
    died = threading.Event()
    fake.dead_peer = lambda: "tensor-parallel rank 1 (10.0.0.2) closed its control connection" if died.is_set() else None
    async with open_runtime(fake.factory(), RuntimeConfig(slots=1)) as rt:
        assert await rt.wait_ready() and rt.readiness()[0]
        died.set()
        with trio.fail_after(5):
            while rt.readiness()[0]:
                await trio.sleep(0.05)
        assert "rank 1 (10.0.0.2) closed its control connection" in rt.readiness()[1]
        with pytest.raises(AdmissionRejected) as e:
            await rt.submit(GenerationRequest("r", (1, 2, 3), SamplingParams(max_tokens=2)))
        assert (e.value.status, e.value.code) == (503, "engine_unhealthy")


# ---------------------------------------------------------------------------- engine calls at TP=2

DRIVER = r"""
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from hf2q.engine import tp_launch
from hf2q.engine.tp_hosts import read_hostfile
path, hostfile, port, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
runner = tp_launch.runner_factory(path, 2, {ctx}, read_hostfile(hostfile, port), 120)()
import mlx.core as mx
from tests.test_tp_multihost import batched_scenario
counts = {{"all_sum": 0, "eval": 0}}
real_sum, real_eval = mx.distributed.all_sum, mx.eval
def all_sum(*a, **k):
    counts["all_sum"] += 1
    return real_sum(*a, **k)
def evaluate(*a, **k):
    counts["eval"] += 1
    return real_eval(*a, **k)
mx.distributed.all_sum, mx.eval = all_sum, evaluate
result = batched_scenario(runner, counts)
np.savez(out, **result)
runner.close()
"""


def batched_scenario(runner, counts: dict | None = None) -> dict[str, np.ndarray]:
    """Three sequences of different lengths (longer than gemma3-tiny's 16-token window) decoding
    together; their reuse points after each call; a trim back to one of them and a re-prefill."""
    prompts = [[2, 106, 1645, 108, 3689, 563, 506, 5279, 529, 7001] * k for k in (2, 3, 1)]
    seqs = [runner.new_sequence() for _ in prompts]
    out: dict[str, np.ndarray] = {"trims_prefix": np.asarray(runner.trims_prefix)}
    first = [runner.prefill(s, p) for s, p in zip(seqs, prompts)]
    out["prefill"] = np.stack(first)
    toks = [int(lg.argmax()) for lg in first]
    steps, points, ops = [], [], []
    for _ in range(4):
        if counts is not None:
            counts.update(all_sum=0, eval=0)
        lg = runner.decode(seqs, toks)
        if counts is not None:
            ops.append([counts["all_sum"], counts["eval"]])
        steps.append(lg)
        toks = [int(x) for x in lg.argmax(-1)]
        points.append([list(s.reuse_points()) + [-1] * (8 - len(s.reuse_points())) for s in seqs])
    out["decode"], out["points"] = np.stack(steps), np.asarray(points)
    out["published"] = np.asarray([list(s.published_points) + [-1] * (8 - len(s.published_points)) for s in seqs])
    if ops:
        out["ops"] = np.asarray(ops)
    back = seqs[0].reuse_points()[-2]  # the previous forward's start: a point the window can return to
    seqs[0].trim(back)
    out["after_trim"] = runner.prefill(seqs[0], [7, 8, 9])
    out["lengths"] = np.asarray([s.length for s in seqs])
    return out


@pytest.mark.slow
def test_gemma3_windowed_reuse_points_and_one_all_reduce_per_block_at_two_ranks(models, tmp_path, monkeypatch):
    """At TP=2 (started the multi-host way) gemma3's sliding-window cache reports the same reuse points
    as one rank on the same (MLX graph) path and trims back to them; a batched decode step of three
    sequences matches one rank and costs exactly two ``all_sum``s per layer and one ``mx.eval``."""
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.formats.gguf_file import open_gguf

    model = models("gemma3", "f32")
    hostfile, port = two_hosts(tmp_path)
    rank1 = follower(model, hostfile, port, tmp_path / "rank1.log")
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(root=str(ROOT), ctx=CTX))
    try:
        run = subprocess.run([sys.executable, str(script), str(model), str(hostfile), str(port),
                              str(tmp_path / "tp.npz")], cwd=ROOT, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        # the follower leaves by itself once rank 0's control connection closes (no signal sent)
        assert rank1.wait(60) == 0, (tmp_path / "rank1.log").read_text()
    finally:
        stop(rank1, signal.SIGKILL, 5)
    with np.load(tmp_path / "tp.npz") as z:
        tp = {k: z[k] for k in z.files}
    monkeypatch.setenv("HF2Q_NO_HOST_DECODE", "1")  # one rank on the graph path, whose local layers keep the window
    ref = batched_scenario(MlxModelRunner.load(model, ctx=CTX))

    assert not tp["trims_prefix"] and not ref["trims_prefix"]
    for key in ("points", "published", "lengths"):
        np.testing.assert_array_equal(tp[key], ref[key], err_msg=key)
    for key in ("prefill", "decode", "after_trim"):
        scale = float(np.abs(ref[key]).max())
        np.testing.assert_allclose(tp[key], ref[key], rtol=0, atol=1e-4 * scale, err_msg=key)
        np.testing.assert_array_equal(tp[key].argmax(-1), ref[key].argmax(-1), err_msg=key)
    n_layers = open_gguf(model).hparams.n_layers
    # the first step stacks the three caches (one eval per layer, once); every later step: one graph, one eval
    assert tp["ops"][0][0] == 2 * n_layers
    assert [list(o) for o in tp["ops"][1:]] == [[2 * n_layers, 1]] * 3, tp["ops"]
