"""``thread_compile(fn)``: ``mx.compile(fn)``, one compiled function per calling thread.

MLX keeps what ``mx.compile`` traced in a cache of the calling thread (a C++ ``thread_local``), and
each entry holds a Python object (the output structure). A compiled function used by a thread that
ends while the function lives on (a module-level one, called by the engine thread) leaves the entries
to glibc's thread-local destructors: they run after ``Thread.join()`` has returned, and take the GIL
to drop those objects. Once the main thread has begun finalizing the interpreter, taking the GIL ends
the thread by ``pthread_exit`` from inside a C++ destructor, and the process dies by SIGABRT
("terminate called without an active exception") — a rare abort of ``hf2q serve`` after a clean drain,
whose engine thread ends a moment before the process.

Here each thread gets its own ``mx.compile`` object, held in a ``threading.local``: Python drops it
with the thread's state, while the thread still holds the GIL and before ``join()`` returns, and that
erases the thread's cache entries (a compiled function erases its entries from the cache of the thread
that called it). The traced graphs are per thread in MLX anyway, so nothing is traced more often.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import mlx.core as mx


class ThreadCompiled:
    """Callable like ``mx.compile(fn, **options)``; compiles on a thread's first call."""

    def __init__(self, fn: Callable[..., Any], **options: Any):
        self._fn = fn
        self._options = options
        self._local = threading.local()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled = getattr(self._local, "compiled", None)
        if compiled is None:
            compiled = self._local.compiled = mx.compile(self._fn, **self._options)
        return compiled(*args, **kwargs)


def thread_compile(fn: Callable[..., Any], **options: Any) -> ThreadCompiled:
    """``mx.compile(fn, **options)`` kept per thread (module docstring: why the engine needs it)."""
    return ThreadCompiled(fn, **options)
