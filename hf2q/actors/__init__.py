"""The serving runtime as trio actors (SPEC §8). Start here: ``runtime.py`` (the public API).

``system.py`` wires the actors; ``admission.py`` queues and routes; ``slot.py`` runs one
request per slot; ``prefill.py`` is one prompt chunk; ``gpu_owner.py`` + ``engine_thread.py``
are the only engine caller; ``supervisor.py`` owns readiness and poisoning; ``handle.py`` is
a request's event stream; ``kv_writer.py`` persists KV blocks. Lifecycles: ``hf2q.statemachines``.
"""
