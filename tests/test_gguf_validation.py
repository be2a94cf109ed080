"""Crafted GGUFs never reach a kernel: ``hf2q info``, ``serve`` and ``generate`` run the same check
(``hf2q.formats.gguf_check``) and refuse every defect with one line and exit 3.

The cases come from ``tests/tools/crafted_gguf.py``; among them is the file of issue 17 whose
``blk.0.attn_k.weight`` is 64×64 where the metadata implies 32×64, which ``info`` called ready and
which crashed ``serve``/``generate`` in the CPU matvec kernel (SIGSEGV or heap corruption). The
kernels themselves refuse impossible dimensions too (checked here through ctypes), so a defect the
file check missed would be an exception, not memory corruption.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf2q.errors import InputError
from hf2q.formats.gguf_check import open_servable
from tests.tools.crafted_gguf import CraftedGGUF, build_cases, to_bytes, valid_model

ROOT = Path(__file__).resolve().parents[1]
SIGSEGV_CASE = "attn_k_wrong_shape"
# a spread of kinds for the slow paths (a spawned `serve`, a spawned `generate`)
SERVE_SUBSET = (SIGSEGV_CASE, "rope_theta_string", "truncated_in_tensor_data", "vocab_smaller_than_embedding",
                "head_count_zero")
GENERATE_SUBSET = (SIGSEGV_CASE, "ffn_down_wrong_shape", "embedding_length_string", "overlapping_tensors")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, CraftedGGUF]:
    return {c.name: c for c in build_cases(tmp_path_factory.mktemp("crafted"))}


def _names() -> list[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return [c.name for c in build_cases(Path(d))]


def expected_line(path: Path) -> str:
    """The one-line reason of the shared check (file name dropped), as every command must say it."""
    with pytest.raises(InputError) as e:
        open_servable(path)
    return str(e.value).split(": ", 1)[-1]


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf2q: error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def test_build_cases_keeps_its_contract(tmp_path):
    t0 = time.monotonic()
    first = build_cases(tmp_path / "a")
    assert time.monotonic() - t0 < 20
    second = build_cases(tmp_path / "b")
    assert len(first) >= 40 and len({c.name for c in first}) == len(first)
    assert [c.name for c in first if c.info_exit == 0] == ["valid_control"]
    assert all(c.serve_exit == (0 if c.name == "valid_control" else 3) for c in first)
    assert all(a.path.read_bytes() == b.path.read_bytes() for a, b in zip(first, second))  # deterministic
    assert SIGSEGV_CASE in {c.name for c in first}


@pytest.mark.parametrize("name", _names())
def test_info_gives_the_expected_exit_and_one_line(name, cases, cli):
    case = cases[name]
    res = cli("info", case.path)
    assert res.code == case.info_exit, (res.out, res.err)
    assert "Traceback" not in res.out + res.err
    if case.info_exit == 0:
        assert res.out.strip().splitlines()[-1] == "Serve support: ready"
        open_servable(case.path)  # the shared check agrees
        return
    reason = expected_line(case.path)
    if res.err.strip():  # the container itself is unreadable: the one error line
        assert one_error_line(res.err).endswith(reason)
    else:
        assert res.out.strip().splitlines()[-1] == f"Serve support: rejected — {reason}"


def test_the_issue_file_is_refused_by_name(cases, cli):
    res = cli("info", cases[SIGSEGV_CASE].path)
    assert res.out.strip().splitlines()[-1] == ("Serve support: rejected — tensor blk.0.attn_k.weight has dims "
                                                "[64, 64], expected [64, 32] from the metadata")


def _hf2q(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf2q", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, check=False)


@pytest.mark.parametrize("name", SERVE_SUBSET)
def test_serve_refuses_at_start_with_the_same_line(name, cases):
    case = cases[name]
    res = _hf2q("serve", "--model", str(case.path), "--port", "0")
    assert res.returncode == case.serve_exit == 3, res.stderr
    assert one_error_line(res.stderr).endswith(expected_line(case.path))


@pytest.mark.parametrize("name", GENERATE_SUBSET)
def test_generate_refuses_with_the_same_line(name, cases):
    """A subprocess: before the check, the first of these died of SIGSEGV/SIGABRT inside the kernel."""
    case = cases[name]
    res = _hf2q("generate", "--model", str(case.path), "--prompt", "hello there", "--max-tokens", "4")
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert one_error_line(res.stderr).endswith(expected_line(case.path))


def test_valid_control_generates(cases):
    res = _hf2q("generate", "--model", str(cases["valid_control"].path), "--prompt", "hello", "--max-tokens", "4",
                "--seed", "1")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr


def test_valid_control_serves_a_chat(cases):
    from tests.test_server_command import start_server, wait_ready

    proc, url = start_server("serve", "--model", str(cases["valid_control"].path), "--port", "0", "--slots", "1")
    try:
        wait_ready(url, proc, timeout=180)
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_the_engine_build_runs_the_check_too(cases):
    """``build_model`` (every loader's path, tensor-parallel shards included) refuses the file itself."""
    import mlx.core as mx

    from hf2q.engine.models import build_model
    from hf2q.formats.gguf_file import open_gguf

    with pytest.raises(InputError, match="blk.0.attn_k.weight has dims"):
        build_model(open_gguf(cases[SIGSEGV_CASE].path), mx.float32)


def test_host_decoder_refuses_a_projection_wider_than_its_buffer(cases):
    """Defence in depth: a model built around the check (the family builder called directly) still
    cannot make the host decode step write past its buffers."""
    import mlx.core as mx

    from hf2q.engine.cpu_decode import HostDecoder
    from hf2q.engine.models import llama
    from hf2q.formats.gguf_file import open_gguf
    from hf2q.kernels.cpu_qmatvec import kernel

    if kernel() is None:
        pytest.skip("no C compiler: the host decoder does not run")
    model = llama.build(open_gguf(cases[SIGSEGV_CASE].path), mx.float32)
    with pytest.raises(ValueError, match="the qkv projection is 160 wide, its buffer 128"):
        HostDecoder(model)


# ---- the kernels' own checks (ctypes straight into the C entry points) -------------------------

def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def test_qmv_group_refuses_columns_outside_the_output_row():
    from hf2q.kernels.cpu_qmatvec import BAD_DIMS, QMatrixGroup, kernel

    lib = kernel()
    if lib is None:
        pytest.skip("no C compiler")
    rows, n = 8, 64
    packed = np.zeros((rows, n), np.uint8)
    scales = np.ones((rows, n // 32), np.float32)
    biases = np.zeros_like(scales)
    x = np.ones((1, n), np.float32)
    y = np.zeros((1, rows), np.float32)
    P, I = ctypes.c_void_p, ctypes.c_int
    args = [(P * 1)(_ptr(packed)), (P * 1)(_ptr(scales)), (P * 1)(_ptr(biases)), (I * 1)(rows), (I * 1)(8)]
    assert lib.qmv_group(1, *args, (I * 1)(0), _ptr(x), _ptr(y), n, 1, rows) == 0
    assert lib.qmv_group(1, *args, (I * 1)(1), _ptr(x), _ptr(y), n, 1, rows) == BAD_DIMS  # col + rows > ystride
    assert lib.qmv_group(1, *args, (I * 1)(0), _ptr(x), _ptr(y), n + 16, 1, rows) == BAD_DIMS  # width % 32
    assert lib.qmv_group(1, *args[:4], (I * 1)(7), (I * 1)(0), _ptr(x), _ptr(y), n, 1, rows) == BAD_DIMS
    g = QMatrixGroup([(packed, scales, biases, 8)])
    with pytest.raises(ValueError, match="refused its dims"):
        g.run(_ptr(x), _ptr(y), 0)
    with pytest.raises(ValueError, match="inconsistent quantized matrix"):
        QMatrixGroup([(packed[:, :32], scales, biases, 8)])


def test_decode_ops_refuse_impossible_dims():
    from hf2q.kernels.cpu_decode_ops import KernelDimsError, library

    ops = library()
    if ops is None:
        pytest.skip("no C compiler")
    B, H, Hkv, D, cap = 1, 2, 1, 16, 4
    qkv = np.zeros((B, (H + 2 * Hkv) * D), np.float32)
    out = np.zeros((B, H * D), np.float32)
    w = np.ones(D, np.float32)
    with pytest.raises(KernelDimsError, match="rms_norm"):
        ops.rms_norm(_ptr(qkv), D - 1, _ptr(w), _ptr(qkv), D, B, 1, D, 1e-5)  # stride shorter than the row
    with pytest.raises(KernelDimsError, match="rope"):
        ops.rope(_ptr(qkv), qkv.shape[1], _ptr(w), B, H, D, D + 1, 0)  # odd, and past the head
    with pytest.raises(KernelDimsError, match="glu"):
        ops.glu(_ptr(qkv), _ptr(out), B, 0, 0)
    with pytest.raises(KernelDimsError, match="add_rms"):
        ops.add_rms(_ptr(out), _ptr(out), out.size + 1, _ptr(w), _ptr(out), B, out.shape[1], 1e-5)
    k = np.zeros((Hkv, cap, D), np.float32)
    v = np.zeros_like(k)
    kp, vp = (ctypes.c_void_p * B)(_ptr(k)), (ctypes.c_void_p * B)(_ptr(v))
    caps, base = np.array([cap], np.int32), np.zeros(1, np.int32)
    for position in (cap, -1):  # a write at pos == capacity would land past the cache
        pos = np.array([position], np.int32)
        with pytest.raises(KernelDimsError, match="attend"):
            ops.attend_layer(_ptr(qkv), qkv.shape[1], kp, vp, _ptr(caps), _ptr(base), _ptr(pos), 0, _ptr(out), B, H,
                             Hkv, D, 1, 1, 0.25)
    pos = np.array([cap - 1], np.int32)
    assert ops.attend_layer(_ptr(qkv), qkv.shape[1], kp, vp, _ptr(caps), _ptr(base), _ptr(pos), 0, _ptr(out), B, H,
                            Hkv, D, 1, 1, 0.25) == 0


# ---- a fuzz over the header bytes --------------------------------------------------------------

_VALID = to_bytes(valid_model())
_HEADER_END = _VALID.index(b"token_embd.weight") + 2000  # key/values and the tensor directory


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, _HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, len(_VALID)))
def test_mangled_headers_are_either_servable_or_one_input_error(tmp_path, flips, cut):
    """Random byte changes in the header and a random truncation: the check either passes the file or
    raises ``InputError`` — never another exception (exit 1) — and ``info`` agrees with it."""
    from hf2q.info import inspect

    raw = bytearray(_VALID[:max(cut, 1)])
    for at, value in flips:
        if at < len(raw):
            raw[at] = value
    path = tmp_path / "mangled.gguf"
    path.write_bytes(bytes(raw))
    try:
        open_servable(path)
        servable = True
    except InputError:
        servable = False
    try:
        info = inspect(path)
    except InputError:
        assert not servable
        return
    assert (info["serve_support"] == "ready") == servable, info["reject_reason"]


def test_sanitizer_builds_are_opt_in_and_keyed_apart(monkeypatch):
    """``HF2Q_KERNEL_SANITIZE`` adds the instrumentation flags (so the cached library differs from the
    plain one) and refuses a sanitizer name it does not know."""
    from hf2q.kernels.cpu_build import KernelBuildError, compile_flags

    monkeypatch.delenv("HF2Q_KERNEL_SANITIZE", raising=False)
    plain = compile_flags()
    assert not any(f.startswith("-fsanitize") for f in plain)
    monkeypatch.setenv("HF2Q_KERNEL_SANITIZE", "address")
    assert "-fsanitize=address" in compile_flags() and compile_flags()[:len(plain)] == plain
    monkeypatch.setenv("HF2Q_KERNEL_SANITIZE", "memory")
    with pytest.raises(KernelBuildError, match="unknown sanitizer"):
        compile_flags()
