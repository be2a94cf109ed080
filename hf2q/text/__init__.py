"""The text layer: everything between model tokens and OpenAI-shaped messages (no MLX).

* :mod:`~hf2q.text.tokenizer` — ``GGUFTokenizer`` rebuilt from ``tokenizer.ggml.*`` on the
  ``tokenizers`` library, ``IncrementalDetokenizer`` for streaming;
  :mod:`~hf2q.text.pretokenizers` names each ``tokenizer.ggml.pre`` split rule;
  ``hf2q.formats.gguf_parse.read_metadata`` reads a GGUF's metadata without its tensors.
* :mod:`~hf2q.text.chat_template` — sandboxed Jinja chat templates, transformers-compatible.
* :mod:`~hf2q.text.reasoning` — streaming ``<think>`` splitter (``reasoning_content``).
* :mod:`~hf2q.text.toolcalls` — streaming tool-call parsers per family syntax
  (:mod:`~hf2q.text.call_formats` reads one call body; :mod:`~hf2q.text.generic_tools`
  teaches template-less models a JSON call format).
* :mod:`~hf2q.text.constrained` — llguidance token masks for ``response_format`` and forced
  ``tool_choice``.

Sampling lives in :mod:`hf2q.engine.sampling`; stop strings are :mod:`hf2q.text.stop_strings`.
"""
