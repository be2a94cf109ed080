"""Sampling: one chain (llama.cpp's order) with a host back-end and a device back-end.

``host.Sampler`` is the full chain in numpy — bias, constraint mask, penalties, logprobs,
top-k / top-p / min-p, temperature, a seeded draw — for one row of logits at a time.
``device.DeviceSampler`` is the same chain for the settings it covers, inside the MLX graph,
so decode steps can be pipelined (importing it imports MLX). ``device_capable`` says which
requests the device back-end can serve and ``plain_greedy`` which rows need no chain at all
(a batched argmax); ``rows`` turns a step's logits into each request's ``Sampled`` token.
Importing this package needs numpy only.
"""

from hf2q.engine.sampling.host import Sampler, log_softmax


def device_capable(params) -> bool:
    """True when ``params`` (a ``SamplingParams``) need nothing the device chain lacks."""
    return (params.repetition_penalty == 1.0 and not params.frequency_penalty and not params.presence_penalty
            and not params.logit_bias and getattr(params, "constraint", None) is None
            and not (params.logprobs and params.top_logprobs))


def plain_greedy(sampler, constraint) -> bool:
    """True when ``sampler`` would return the argmax of the raw logits: the host ``Sampler`` at
    temperature 0 with no bias, penalty, constraint or logprobs. Such rows skip its float64 pass
    over the vocabulary; their ``Sampled.logprob`` is None (nobody asked for it)."""
    if constraint is not None or type(sampler) is not Sampler:
        return False
    p = sampler.params
    return (p.temperature == 0.0 and not p.logprobs and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty)


__all__ = ["Sampler", "device_capable", "log_softmax", "plain_greedy"]
