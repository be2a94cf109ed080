"""On a 2-GPU host: a model over one rank's memory share is refused at TP1 and served at TP2; then rank 1 dies.

    python bench/tp_fault.py /tmp/qwen3-8b-q8_0.gguf 7G      # GGUF from bench/synth_gguf.py; per-rank limit

Prints JSON: TP1's exit code and one-line error, TP2's readiness time and a chat request, then what a
streaming request, /readyz, /health and a new request see after ``kill -9`` of rank 1 (fail closed).
The model id sent is the file stem (what ``hf2q serve`` reports by default).
"""
import json, os, signal, socket, subprocess, sys, threading, time
import httpx
M = sys.argv[1]
LIMIT = sys.argv[2] if len(sys.argv) > 2 else "7G"
env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
out = {}
t0 = time.time()
r = subprocess.run([sys.executable, "-m", "hf2q", "serve", "--model", M, "--tensor-parallel", "1", "--memory-limit", LIMIT,
                    "--ctx", "4096", "--slots", "2", "--port", str(port())], capture_output=True, text=True, env=env, timeout=120)
out["tp1"] = {"exit": r.returncode, "stderr": r.stderr.strip()[-400:], "s": round(time.time() - t0, 1)}
print(json.dumps(out), flush=True)
p = port(); url = f"http://127.0.0.1:{p}"
log = open("/tmp/tp2.log", "w")
srv = subprocess.Popen([sys.executable, "-m", "hf2q", "serve", "--model", M, "--tensor-parallel", "2", "--memory-limit", LIMIT,
                        "--ctx", "4096", "--slots", "2", "--port", str(p), "--gpu-deadline", "60"], stdout=log, stderr=subprocess.STDOUT, env=env)
t0 = time.time(); ready = False
while time.time() - t0 < 200 and srv.poll() is None:
    try:
        if httpx.get(url + "/readyz", timeout=2).status_code == 200:
            ready = True; break
    except Exception: pass
    time.sleep(1)
out["tp2_ready_s"] = round(time.time() - t0, 1); out["tp2_ready"] = ready
body = {"model": os.path.splitext(os.path.basename(M))[0], "messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 64, "temperature": 0}
if ready:
    t1 = time.time(); rr = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    j = rr.json() if rr.headers.get("content-type", "").startswith("application/json") else {}
    out["tp2_request"] = {"status": rr.status_code, "usage": j.get("usage"), "s": round(time.time() - t1, 2), "err": None if rr.status_code == 200 else rr.text[:200]}
    print(json.dumps(out), flush=True)
    stream_result = {}
    def long_stream():
        b = dict(body, max_tokens=3000, stream=True)
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=b, timeout=120) as resp:
                lines = [l for l in resp.iter_lines() if l]
                stream_result.update(status=resp.status_code, n=len(lines), last=lines[-3:], ended_at=time.time())
        except Exception as e:
            stream_result.update(exc=repr(e)[:200])
    th = threading.Thread(target=long_stream); th.start(); time.sleep(3)
    pids = subprocess.run(["pgrep", "-f", "tp_launch --rank 1"], capture_output=True, text=True).stdout.split()
    out["killed"] = pids
    killed_at = time.time()
    for pid in pids: os.kill(int(pid), signal.SIGKILL)
    th.join(90)
    if "ended_at" in stream_result:  # how long the stream waited for the verdict after the kill
        stream_result["ended_s_after_kill"] = round(stream_result.pop("ended_at") - killed_at, 2)
    out["stream_after_kill"] = stream_result
    time.sleep(2)
    out["readyz_after"] = httpx.get(url + "/readyz", timeout=5).status_code
    out["health_after"] = httpx.get(url + "/health", timeout=5).status_code
    nr = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    out["new_request_after"] = {"status": nr.status_code, "body": nr.text[:200]}
srv.send_signal(signal.SIGTERM)
try: srv.wait(30)
except subprocess.TimeoutExpired: srv.kill()
out["server_exit"] = srv.returncode
out["left_over"] = subprocess.run(["pgrep", "-f", "tp_launch"], capture_output=True, text=True).stdout.split()
print(json.dumps(out), flush=True)
log.close(); print(open("/tmp/tp2.log").read()[-1500:])
