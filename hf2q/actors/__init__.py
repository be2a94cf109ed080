"""The serving runtime as trio actors. Start here: ``runtime.py`` (the public API).

``system.py`` wires the actors; ``admission.py`` is the front door and owns the ledger and
the KV budget; ``slot.py`` runs one request's prefill and release per slot; ``prefill.py`` is
one prompt chunk; ``gpu_owner.py`` + ``engine_thread.py`` are the only engine caller and own
a running request's tokens; ``supervisor.py`` owns readiness and poisoning; ``handle.py`` is
a request's event stream; ``kv_prefix.py`` restores and persists prompt KV, ``kv_writer.py``
writes blocks to disk. Messages: ``messages.py``. Lifecycles: ``hf2q.statemachines``.
"""
