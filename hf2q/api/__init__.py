"""The OpenAI-compatible HTTP layer of ``hf2q serve`` (Quart on Hypercorn's trio worker).

No MLX here: requests become ``GenerationRequest`` records for the actor runtime, and its
events become JSON or SSE. See ``docs/API.md`` for the contract and the module map.
"""
