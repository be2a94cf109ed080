"""A client that stops a reply itself (a stop string, a finished tool call: the API closes its event channel)
and sends the next turn at once gets the slot that holds the conversation, not a cold idle one — even while that
slot's step is still running and its ``Released`` has not arrived."""

from __future__ import annotations

from hf2q.actors.runtime import open_runtime
from hf2q.sched.contracts import GenerationRequest, RuntimeConfig, SamplingParams, Token
from tests.fakes import FakeModelRunner
from tests.test_runtime import collect


async def test_the_next_turn_after_a_client_stop_waits_for_the_conversations_slot():
    fake = FakeModelRunner(step_latency_s=0.3)  # the running step outlasts the client's next request
    async with open_runtime(fake.factory(), RuntimeConfig(slots=2, prefill_chunk=128)) as rt:
        assert await rt.wait_ready()
        turn1 = [10 + (i % 80) for i in range(120)]
        events = await rt.submit(GenerationRequest("a", tuple(turn1), SamplingParams(max_tokens=200)))
        admitted, got = None, []
        async for ev in events:
            admitted = admitted or ev
            if isinstance(ev, Token):
                got.append(ev.token_id)
                if len(got) == 2:
                    break
        await events.aclose()  # what the API does when its decoder stops the reply
        turn2 = turn1 + got + [7, 8, 9]
        ev = await collect(await rt.submit(GenerationRequest("b", tuple(turn2), SamplingParams(max_tokens=2))))
        assert ev[0].slot == admitted.slot
        assert ev[0].cached_tokens >= len(turn1)
