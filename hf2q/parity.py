"""``hf2q parity``: record what a reference predicts for a fixed prompt set, and check a GGUF on our
engine against that record later.

``--capture OUT`` runs the family's parity prompts (``Family.parity_prompts``) through a reference
(``hf2q.parity_refs``: an HF checkpoint in transformers, stock llama.cpp, or our engine) and writes,
per prompt, its token ids, ``--tokens`` greedy tokens and each step's top-k log-probabilities (and
logits where the reference has them) as JSON, atomically. ``--compare FILE`` feeds the recorded
prompt and greedy tokens to our engine in one forward (teacher forcing: one early disagreement does
not turn every later step into noise) and measures, over all steps:

* top-1 agreement — our argmax is the reference's (or within ``TIE_NATS`` of it in the reference's
  own distribution, where the reference itself barely prefers one token);
* top-k overlap — the share of the reference's top-k that is in ours;
* the largest log-probability difference on the reference's top-k tokens, and the largest raw-logit
  difference where the capture holds logits.

It also checks that our tokenizer turns each prompt into the recorded ids. Exit 1 beyond a tolerance,
with the first divergent step shown token by token.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hf2q.errors import EXIT_FAILURE, InputError, UsageError
from hf2q.parity_refs import EngineReference, LlamaCppReference, Trace, find_llama_server, top_k

FORMAT = "hf2q-parity"
VERSION = 1
TIE_NATS = 1e-3


# ---- the capture file ---------------------------------------------------------------------------------

def write_capture(path: Path, reference: dict, traces: list[Trace], k: int, n: int) -> None:
    from hf2q.atomic import atomic_write_text

    doc = {"format": FORMAT, "version": VERSION, "reference": reference, "top_k": k, "n_tokens": n,
           "prompts": [t.as_json() for t in traces]}
    atomic_write_text(path, json.dumps(doc, ensure_ascii=False) + "\n")


def _int_lists(v, name: str, where: str) -> list:
    if not isinstance(v, list):
        raise InputError(f"{where}: '{name}' must be a list")
    return v


def read_capture(path: Path) -> tuple[dict, list[Trace]]:
    from hf2q.smoke import read_json_file

    doc = read_json_file(path, "--compare")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise InputError(f"--compare {path}: not an hf2q parity capture (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise InputError(f"--compare {path}: capture version {doc.get('version')!r}; this hf2q reads {VERSION}")
    traces = []
    for i, p in enumerate(doc.get("prompts") or []):
        where = f"--compare {path}: prompt {i}"
        try:
            t = Trace(str(p["text"]), [int(x) for x in _int_lists(p["prompt_tokens"], "prompt_tokens", where)],
                      [int(x) for x in _int_lists(p["tokens"], "tokens", where)],
                      [[int(x) for x in r] for r in _int_lists(p["top_ids"], "top_ids", where)],
                      [[float(x) for x in r] for r in _int_lists(p["top_logprobs"], "top_logprobs", where)],
                      [[float(x) for x in r] for r in p["top_logits"]] if "top_logits" in p else None)
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{where}: malformed ({type(e).__name__}: {e})") from None
        steps = len(t.tokens)
        if not t.prompt_tokens or not steps or len(t.top_ids) != steps or len(t.top_logprobs) != steps or (
                t.top_logits is not None and len(t.top_logits) != steps):
            raise InputError(f"{where}: needs prompt tokens and one top-k row per greedy token")
        if any(len(a) != len(b) or not a for a, b in zip(t.top_ids, t.top_logprobs)):
            raise InputError(f"{where}: a step's top_ids and top_logprobs differ in length")
        traces.append(t)
    if not traces:
        raise InputError(f"--compare {path}: the capture holds no prompts")
    return doc, traces


# ---- comparing -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tolerance:
    min_top1: float
    min_topk_overlap: float
    max_logprob_diff: float
    max_logit_diff: float


@dataclass
class Step:
    prompt: int
    step: int
    top1: bool
    overlap: float
    logprob_diff: float
    logit_diff: float | None
    ours_ids: list[int]
    ours_logprobs: list[float]

    def within(self, tol: Tolerance) -> bool:
        return (self.top1 and self.logprob_diff <= tol.max_logprob_diff
                and (self.logit_diff is None or self.logit_diff <= tol.max_logit_diff))


def compare_trace(index: int, ref: Trace, rows: np.ndarray) -> list[Step]:
    """One ``Step`` per greedy token of ``ref``; ``rows`` are our logits at those positions."""
    from hf2q.engine.sampling import log_softmax

    out = []
    for s, row in enumerate(rows):
        row = np.asarray(row, dtype=np.float64)
        lp = log_softmax(row)
        ids, lps, _ = top_k(row, len(ref.top_ids[s]))
        ref_ids, ref_lp = ref.top_ids[s], ref.top_logprobs[s]
        ref_of = dict(zip(ref_ids, ref_lp))
        ours_top = int(ids[0])
        top1 = ours_top == ref_ids[0] or (ours_top in ref_of and ref_lp[0] - ref_of[ours_top] <= TIE_NATS)
        lp_diff = max(abs(float(lp[i]) - v) for i, v in zip(ref_ids, ref_lp))
        lg_diff = (max(abs(float(row[i]) - v) for i, v in zip(ref_ids, ref.top_logits[s]))
                   if ref.top_logits is not None else None)
        out.append(Step(index, s, top1, len(set(ids.tolist()) & set(ref_ids)) / len(ref_ids), lp_diff, lg_diff,
                        [int(i) for i in ids], [float(v) for v in lps]))
    return out


def summarise(steps: list[Step], tokenizer_ok: list[bool], tol: Tolerance) -> dict:
    logit = [s.logit_diff for s in steps if s.logit_diff is not None]
    summary = {
        "steps": len(steps),
        "top1_agreement": round(sum(s.top1 for s in steps) / len(steps), 4),
        "topk_overlap": round(sum(s.overlap for s in steps) / len(steps), 4),
        "max_logprob_diff": round(max(s.logprob_diff for s in steps), 6),
        "max_logit_diff": round(max(logit), 6) if logit else None,
        "tokenizer_matches": sum(tokenizer_ok), "prompts": len(tokenizer_ok),
    }
    summary["passed"] = bool(
        all(tokenizer_ok) and summary["top1_agreement"] >= tol.min_top1
        and summary["topk_overlap"] >= tol.min_topk_overlap and summary["max_logprob_diff"] <= tol.max_logprob_diff
        and (summary["max_logit_diff"] is None or summary["max_logit_diff"] <= tol.max_logit_diff))
    return summary


def compare(engine: EngineReference, traces: list[Trace], tol: Tolerance) -> tuple[dict, list[Step], list[bool]]:
    steps, tokenizer_ok = [], []
    for i, ref in enumerate(traces):
        tokenizer_ok.append(engine.encode(ref.text) == ref.prompt_tokens)
        fed = ref.prompt_tokens + ref.tokens[:-1]
        if len(fed) + 1 > engine.runner.n_ctx:
            raise InputError(f"prompt {i} needs {len(fed) + 1} positions; the context is {engine.runner.n_ctx}")
        rows = engine.rows(fed)[len(ref.prompt_tokens) - 1:]
        steps += compare_trace(i, ref, rows)
    return summarise(steps, tokenizer_ok, tol), steps, tokenizer_ok


def first_divergence(steps: list[Step], tol: Tolerance) -> Step | None:
    return next((s for s in steps if not s.within(tol)), None)


# ---- reporting ----------------------------------------------------------------------------------------------

def _piece(engine: EngineReference, tid: int) -> str:
    return repr(engine.tokenizer.decode([tid]))


def divergence_rows(engine: EngineReference, ref: Trace, step: Step) -> list[dict]:
    """The reference's top-k beside ours at one step, rank by rank."""
    s = step.step
    rows = []
    for rank in range(len(ref.top_ids[s])):
        rid = ref.top_ids[s][rank]
        oid = step.ours_ids[rank] if rank < len(step.ours_ids) else None
        rows.append({"rank": rank + 1, "reference_id": rid, "reference_token": _piece(engine, rid),
                     "reference_logprob": round(ref.top_logprobs[s][rank], 4),
                     "ours_id": oid, "ours_token": _piece(engine, oid) if oid is not None else "",
                     "ours_logprob": round(step.ours_logprobs[rank], 4) if oid is not None else None})
    return rows


def _print_rich(summary: dict, divergence: dict | None, tol: Tolerance, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=title, title_justify="left")
    for col in ("measure", "value", "tolerance"):
        t.add_column(col)
    t.add_row("tokenizer", f"{summary['tokenizer_matches']}/{summary['prompts']} prompts match", "all")
    t.add_row("top-1 agreement", f"{summary['top1_agreement']:.4f}", f"≥ {tol.min_top1}")
    t.add_row("top-k overlap", f"{summary['topk_overlap']:.4f}", f"≥ {tol.min_topk_overlap}")
    t.add_row("max logprob diff", f"{summary['max_logprob_diff']:.4f}", f"≤ {tol.max_logprob_diff}")
    t.add_row("max logit diff", "—" if summary["max_logit_diff"] is None else f"{summary['max_logit_diff']:.4f}",
              f"≤ {tol.max_logit_diff}")
    console.print(t)
    if divergence:
        d = Table(title=f"first divergence: prompt {divergence['prompt']} ({divergence['text'][:40]!r}), "
                        f"step {divergence['step']}", title_justify="left")
        for col in ("rank", "reference", "logprob", "ours", "logprob "):
            d.add_column(col)
        for r in divergence["rows"]:
            ours_lp = "" if r["ours_logprob"] is None else f"{r['ours_logprob']:.4f}"
            d.add_row(str(r["rank"]), f"{r['reference_id']} {r['reference_token']}", f"{r['reference_logprob']:.4f}",
                      f"{r['ours_id']} {r['ours_token']}", ours_lp)
        console.print(d)
    ok = summary["passed"]
    console.print("parity: pass" if ok else "parity: FAIL", style="green" if ok else "red")


# ---- the command ----------------------------------------------------------------------------------------------

def _prompts_for(model: Path | None, reference: str) -> tuple[str, ...]:
    """The family's parity prompts: from the GGUF's architecture, else the HF checkpoint's config."""
    from hf2q.smoke import gguf_family

    if model is not None:
        from hf2q.formats.gguf_check import open_servable

        fam = gguf_family(open_servable(model).arch)
    else:
        from hf2q.arch.registry import family_class
        from hf2q.sources.hf_config import architecture_name, load_config

        fam = family_class(architecture_name(load_config(Path(reference))))
    if fam is None or not fam.parity_prompts:
        raise InputError("this model's family has no parity prompts (not a causal language model)")
    return fam.parity_prompts


def _open_reference(args, model: Path | None):
    ref = args.reference
    if ref == "hf2q":
        return EngineReference(model, n_ctx=args.ctx)
    if ref == "llama.cpp":
        return LlamaCppReference(model, find_llama_server(args.llama_cpp), n_ctx=args.ctx)
    if Path(ref).is_dir():
        from hf2q.parity_refs import TransformersReference

        return TransformersReference(Path(ref))
    raise InputError(f"--reference {ref}: not llama.cpp, hf2q or an HF checkpoint directory")


def _capture(args, model: Path | None) -> int:
    if args.reference in ("hf2q", "llama.cpp") and model is None:
        raise UsageError(f"--reference {args.reference} runs MODEL: give the GGUF")
    prompts = _prompts_for(model, args.reference)
    reference = _open_reference(args, model)
    try:
        traces = [reference.trace(text, args.tokens, args.top_k) for text in prompts]
        described = reference.describe()
    finally:
        reference.close()
    write_capture(Path(args.capture), described, traces, args.top_k, args.tokens)
    info = {"capture": str(args.capture), "reference": described, "prompts": len(traces), "tokens": args.tokens,
            "top_k": args.top_k}
    print(json.dumps(info, ensure_ascii=False))
    return 0


def _compare(args, model: Path) -> int:
    doc, traces = read_capture(Path(args.compare))
    tol = Tolerance(args.min_top1, args.min_topk_overlap, args.max_logprob_diff, args.max_logit_diff)
    need = max(len(t.prompt_tokens) + len(t.tokens) for t in traces)
    engine = EngineReference(model, n_ctx=max(args.ctx, need + 1))
    summary, steps, _ = compare(engine, traces, tol)
    first = first_divergence(steps, tol)
    divergence = None
    if first is not None:
        ref = traces[first.prompt]
        divergence = {"prompt": first.prompt, "text": ref.text, "step": first.step, "top1": first.top1,
                      "logprob_diff": round(first.logprob_diff, 6),
                      "rows": divergence_rows(engine, ref, first)}
    report = {"model": str(model), "capture": str(args.compare), "reference": doc.get("reference"), **summary,
              "tolerance": tol.__dict__, "first_divergence": divergence}
    if args.json or not sys.stdout.isatty():
        print(json.dumps(report, ensure_ascii=False, indent=2))
    else:
        _print_rich(summary, divergence, tol, f"hf2q parity — {model.name} vs {doc.get('reference', {}).get('kind')}")
    return 0 if summary["passed"] else EXIT_FAILURE


def run(args) -> int:
    model = Path(args.model) if args.model else None
    if model is not None and not model.is_file():
        raise InputError(f"no such GGUF file: {model}")
    if args.capture:
        if not args.reference:
            raise UsageError("--capture needs --reference PATH|llama.cpp|hf2q")
        return _capture(args, model)
    if args.reference:
        raise UsageError("--reference is for --capture; --compare reads the reference from its file")
    if model is None:
        raise UsageError("--compare runs MODEL on our engine: give the GGUF")
    return _compare(args, model)
