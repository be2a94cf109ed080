"""Serving throughput through the real runtime (actors + GPU owner, no HTTP), pipelined vs blocking decode.

    python bench/gpu_serve.py /tmp/qwen3-8b-q8_0.gguf [pipelined,blocking,unstacked]

For 1 and 4 concurrent greedy and top-p streams of 128 tokens, tokens/s after the first token, with the GPU
owner's decode pipeline on and off (``HF2Q_NO_DECODE_PIPELINE=1``), and pipelined with per-sequence K/V buffers
instead of the stacked batch (``unstacked``: ``HF2Q_NO_STACKED_DECODE=1``). The server warms the engine up before it is
ready (``hf2q.engine.runner.warm_up``); this script does the same so first-use compilation is not measured.
"""
import json, os, sys, time
sys.path.insert(0, ".")
import trio
import numpy as np

def main(path, modes=("pipelined", "blocking"), clients_list=(1, 4), max_tokens=128):
    from hf2q.sched.contracts import RuntimeConfig
    from hf2q.actors.runtime import open_runtime
    from hf2q.engine.runner import MlxModelRunner
    from hf2q.sched.contracts import GenerationRequest, SamplingParams, Token
    res = {}
    for mode in modes:
        os.environ.pop("HF2Q_NO_DECODE_PIPELINE", None)
        os.environ.pop("HF2Q_NO_STACKED_DECODE", None)
        if mode == "blocking":
            os.environ["HF2Q_NO_DECODE_PIPELINE"] = "1"
        elif mode == "unstacked":
            os.environ["HF2Q_NO_STACKED_DECODE"] = "1"
        async def run():
            out = {}
            def build():
                from hf2q.engine.runner import warm_up

                runner = MlxModelRunner.load(path, ctx=4096)
                warm_up(runner)
                return runner

            async with open_runtime(build,
                                    RuntimeConfig(slots=4, ctx=4096, gpu_deadline_s=600)) as rt:
                assert await rt.wait_ready()
                for clients in tuple(clients_list):
                    firsts, counts = [], []
                    async def one(i, params):
                        prompt = tuple(int(t) for t in np.random.default_rng(i).integers(100, 30000, 64))
                        ch = await rt.submit(GenerationRequest(f"{clients}-{i}-{time.time()}", prompt, params))
                        n = 0
                        async with ch:
                            async for e in ch:
                                if isinstance(e, Token):
                                    n += 1
                                    if n == 1:
                                        firsts.append(time.perf_counter())
                        counts.append(n)
                    for label, params in (("greedy", SamplingParams(max_tokens=max_tokens)),
                                          ("top_p", SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.9, seed=1))):
                        firsts.clear(); counts.clear()
                        async with trio.open_nursery() as nn:
                            for i in range(clients):
                                nn.start_soon(one, i, params)
                        t1 = time.perf_counter()
                        out[f"{clients}c_{label}"] = {"tok_s_after_first": round((sum(counts) - clients) / (t1 - max(firsts)), 1) if clients == 1 else round((sum(counts) - clients) / (t1 - min(firsts)), 1),
                                                      "tokens": sum(counts)}
                out["pipeline"] = dict(rt._system.gpu.pipeline.stats) if rt._system.gpu.pipeline else None
            return out
        res[mode] = trio.run(run)
        print(json.dumps({mode: res[mode]}), flush=True)
    return res

if __name__ == "__main__":
    import mlx.core as mx
    from hf2q.engine.memory_plan import device_memory
    print(json.dumps({"device_memory": device_memory(), "info": {k: str(v) for k, v in mx.device_info().items()}}), flush=True)
    main(sys.argv[1], *([tuple(sys.argv[2].split(","))] if len(sys.argv) > 2 else []))
