"""Distilled weight quantization: fit an affine quantization's scales and biases to its teacher.

The student starts as the plain mlx-lm quantization (round-to-nearest codes with min/max scales).
The codes stay frozen; every quantized module's per-group ``scales`` and ``biases`` are trained (as
offsets relative to the quantization step, see ``Distiller._scales_biases``) with Adam to minimise
KL(teacher ‖ student) of the next-token distributions on calibration text, the teacher being the
full-precision checkpoint. The loss is computed on the parameters rounded to the
dtype they are stored in (gradients pass straight through the rounding), so what is measured is
what is written.

Calibration text is tokenized once and split by position: the last ``HELDOUT_FRACTION`` of the
tokens is never trained on and gives the before/after KL and perplexity the report records.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from hf2q.convert.dwq_forward import Decoder, QuantLayout, logits
from hf2q.errors import InputError

log = logging.getLogger("hf2q.convert.dwq")

HELDOUT_FRACTION = 0.2
HELDOUT_MAX_TOKENS = 2048  # bounds the teacher's held-out distributions kept in memory
TARGET_CACHE_BYTES = 2 << 30  # teacher distributions for training rows are kept when they fit in this


@attrs.frozen
class DwqSettings:
    """The defaults are where DWQ measurably wins on SmolLM2 at 3 and 4 bits; docs/QUALITY.md ("DWQ") has
    the sweep they were read from, including the larger learning rates that made held-out KL worse."""

    steps: int = 32
    lr: float = 1e-4  # Adam, on offsets measured in quantization steps
    seq_len: int = 32
    seed: int = 0


@attrs.frozen
class Scores:
    """Held-out quality of one set of weights against the teacher."""

    kl_mean: float
    kl_p99: float
    perplexity: float
    top1_agreement: float

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in attrs.asdict(self).items()}


def split_tokens(tokens: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(training rows, held-out rows), each ``[n, seq_len]``; the held-out rows come from the text's tail."""
    n_held = max(seq_len, int(math.ceil(len(tokens) * HELDOUT_FRACTION)))
    n_train = (len(tokens) - n_held) // seq_len
    n_eval = min(n_held, max(seq_len, HELDOUT_MAX_TOKENS)) // seq_len
    if n_train < 1 or n_eval < 1:
        raise InputError(f"the DWQ corpus has {len(tokens)} tokens: too few for --dwq-seq-len {seq_len} "
                         f"(need at least {2 * seq_len}); "
                         "give a longer corpus or a shorter --dwq-seq-len")
    train = tokens[:n_train * seq_len].reshape(n_train, seq_len)
    start = len(tokens) - n_eval * seq_len
    return train, tokens[start:].reshape(n_eval, seq_len)


def _log_probs(mx, z):
    return z - mx.logsumexp(z, axis=-1, keepdims=True)


def _kl_per_token(mx, teacher_lp, student_logits):
    return (mx.exp(teacher_lp) * (teacher_lp - _log_probs(mx, student_logits))).sum(axis=-1)


class Distiller:
    """One DWQ run: the teacher's targets, the student's trainable scales/biases and the loop."""

    def __init__(self, dec: Decoder, teacher: Mapping[str, Any], student: Mapping[str, Any],
                 layout: QuantLayout, make_linear: Callable[[QuantLayout | None], Any]):
        import mlx.core as mx

        self.dec, self.layout = dec, layout
        self.teacher = dict(teacher)
        self._teacher_linear = make_linear(None)
        self._student_linear = make_linear(layout)
        modules = [k.removesuffix(".scales") for k in student if k.endswith(".scales")]
        self.stored_dtype = {m: student[f"{m}.scales"].dtype for m in modules}
        self.start = {m: (student[f"{m}.scales"].astype(mx.float32), student[f"{m}.biases"].astype(mx.float32))
                      for m in modules}
        self.frozen = {k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
                       for k, v in student.items() if not k.endswith((".scales", ".biases"))}  # codes stay packed
        self.params = {m: {"ds": mx.zeros_like(s0), "db": mx.zeros_like(s0)} for m, (s0, _) in self.start.items()}

    def _scales_biases(self, params) -> dict[str, Any]:
        """The trained arrays: ``s = s0·(1 + ds)``, ``b = b0 + s0·db``, rounded to their stored dtype.

        Fitting offsets measured in quantization steps makes one learning rate fit every layer and
        model, whatever the magnitude of its weights.
        """
        out = {}
        for m, p in params.items():
            s0, b0 = self.start[m]
            dt = self.stored_dtype[m]
            s, b = s0 * (1 + p["ds"]), b0 + s0 * p["db"]
            out[f"{m}.scales"] = s.astype(dt).astype(s.dtype) if dt != s.dtype else s
            out[f"{m}.biases"] = b.astype(dt).astype(b.dtype) if dt != b.dtype else b
        return out

    def teacher_log_probs(self, rows: np.ndarray):
        import mlx.core as mx

        out = []
        for r in rows:
            lp = _log_probs(mx, logits(self.dec, self.teacher, mx.array(r[None]), self._teacher_linear))
            mx.eval(lp)
            out.append(lp)
        return out

    def _student_logits(self, params, tokens):
        return logits(self.dec, {**self.frozen, **self._scales_biases(params)}, tokens, self._student_linear,
                      self.layout)

    def score(self, rows: np.ndarray, teacher_lp) -> Scores:
        import mlx.core as mx

        params = self.params
        kls, nll, agree, n_pred = [], 0.0, 0, 0
        for r, tlp in zip(rows, teacher_lp):
            z = self._student_logits(params, mx.array(r[None]))
            kl = _kl_per_token(mx, tlp, z)
            slp = _log_probs(mx, z)[0, :-1]
            tok_nll = -mx.take_along_axis(slp, mx.array(r[1:, None]), axis=-1).sum()
            same = (mx.argmax(z[0], axis=-1) == mx.argmax(tlp[0], axis=-1)).sum()
            mx.eval(kl, tok_nll, same)
            kls.append(np.asarray(kl).reshape(-1))
            nll += float(tok_nll.item())
            agree += int(same.item())
            n_pred += len(r) - 1
        kl_all = np.concatenate(kls)
        return Scores(float(kl_all.mean()), float(np.percentile(kl_all, 99)), math.exp(nll / n_pred),
                      agree / len(kl_all))

    def fit(self, train: np.ndarray, settings: DwqSettings, progress=None) -> list[float]:
        """Run ``settings.steps`` Adam steps (one training row each, in a seeded shuffled order); the losses."""
        import mlx.core as mx
        import mlx.optimizers as optim

        used = min(len(train), settings.steps)
        vocab = int(self.teacher["model.embed_tokens.weight"].shape[0])
        keep = used * train.shape[1] * vocab * 4 <= TARGET_CACHE_BYTES
        targets: dict[int, Any] = {}

        def target(i):
            if i in targets:
                return targets[i]
            lp = self.teacher_log_probs(train[i:i + 1])[0]
            if keep:
                targets[i] = lp
            return lp

        def loss_fn(params, tokens, tlp):
            return _kl_per_token(mx, tlp, self._student_logits(params, tokens)).mean()

        step_fn = mx.value_and_grad(loss_fn)
        opt = optim.Adam(learning_rate=settings.lr)
        rng = np.random.default_rng(settings.seed)
        order: list[int] = []
        losses = []
        params = self.params
        for step in range(settings.steps):
            if not order:
                order = list(rng.permutation(len(train)))
            i = order.pop()
            loss, grads = step_fn(params, mx.array(train[i][None]), target(i))
            params = opt.apply_gradients(grads, params)
            mx.eval(loss, params)
            self.params = params
            losses.append(float(loss.item()))
            if progress is not None:
                progress(step + 1, losses[-1])
        return losses

    def fitted(self) -> dict[str, Any]:
        """The trained scales and biases, in the dtype they are stored in."""
        return {k: v.astype(self.stored_dtype[k.rsplit(".", 1)[0]])
                for k, v in self._scales_biases(self.params).items()}


def teacher_perplexity(rows: np.ndarray, teacher_lp) -> float:
    nll = sum(-float(np.take_along_axis(np.asarray(lp[0, :-1]), r[1:, None], axis=-1).sum())
              for r, lp in zip(rows, teacher_lp))
    return math.exp(nll / sum(len(r) - 1 for r in rows))


def loss_summary(losses: list[float]) -> dict[str, Any]:
    """The loss curve in a few numbers: first and last tenth averaged, the minimum, and 8 evenly spaced points."""
    k = max(1, len(losses) // 10)
    picks = sorted({round(i * (len(losses) - 1) / 7) for i in range(8)}) if losses else []
    return {"first": round(float(np.mean(losses[:k])), 6) if losses else None,
            "last": round(float(np.mean(losses[-k:])), 6) if losses else None,
            "min": round(min(losses), 6) if losses else None,
            "points": [[i + 1, round(losses[i], 6)] for i in picks]}


def distill(dec: Decoder, teacher, student, layout: QuantLayout, tokens: np.ndarray, settings: DwqSettings,
            make_linear, progress=None, variants=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit ``student``'s scales/biases on ``tokens``; returns (fitted arrays, the report's ``dwq`` section).

    ``variants``: ``{name: fn(fitted) → student}``, other students built from the fit (GGUF's codes
    re-rounded against the fitted scales); each is scored on the held-out rows too, as ``heldout_NAME``.
    """
    t0 = time.perf_counter()
    train, heldout = split_tokens(tokens, settings.seq_len)
    d = Distiller(dec, teacher, student, layout, make_linear)
    held_lp = d.teacher_log_probs(heldout)
    before = d.score(heldout, held_lp)
    log.info("dwq: held-out KL %.5f before fitting (%d training rows of %d tokens)", before.kl_mean,
             len(train), settings.seq_len)
    losses = d.fit(train, settings, progress)
    after = d.score(heldout, held_lp)
    log.info("dwq: held-out KL %.5f after %d steps", after.kl_mean, settings.steps)
    fitted = d.fitted()
    extra = {}
    for name, build in (variants or {}).items():
        extra[name] = Distiller(dec, teacher, build(fitted), layout, make_linear).score(heldout, held_lp)
        log.info("dwq: held-out KL %.5f (%s)", extra[name].kl_mean, name)
    section = {
        "steps": settings.steps, "learning_rate": settings.lr, "seq_len": settings.seq_len,
        "seed": settings.seed, "optimizer": "adam", "objective": "KL(teacher || student), next token",
        "trained": "per-group scales and biases of every quantized module (codes frozen)",
        "train_tokens": int(train.size), "heldout_tokens": int(heldout.size),
        "loss": loss_summary(losses),
        "heldout_teacher_perplexity": round(teacher_perplexity(heldout, held_lp), 6),
        "heldout_before": before.as_dict(), "heldout_after": after.as_dict(),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    section.update({f"heldout_{name}": sc.as_dict() for name, sc in extra.items()})
    return fitted, section
