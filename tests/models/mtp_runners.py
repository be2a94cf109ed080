"""Runners of the tiny Qwen 3.5 files with their MTP head on or off, kept for the tests of one module
each (loading one costs seconds; the MTP tests need several)."""

from __future__ import annotations


def runner_cache():
    """``runner(path, mtp, kv_type="f16", fresh=False)``: a runner of ``path`` (its head enabled with
    ``mtp``), the same one on every call with those arguments unless ``fresh`` (a new one, not kept)."""
    kept: dict = {}

    def runner(path, mtp: bool, kv_type: str = "f16", fresh: bool = False):
        from hf2q.engine.factory import load_runner

        key = (str(path), mtp, kv_type)
        if fresh or key not in kept:
            r = load_runner(path, kv_cache_type=kv_type)
            if mtp:
                r.enable_mtp()
            if fresh:
                return r
            kept[key] = r
        return kept[key]
    return runner
