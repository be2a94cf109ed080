"""Compiling the C kernels of ``hf2q/kernels/csrc/`` once per machine, loading them once per process.

A :class:`KernelLibrary` names one ``csrc/*.c`` file and how to declare and start the library.
On first use it compiles the file with the system C compiler into the hf2q cache, keyed by a
hash of the sources (the file and the shared headers beside it) *and* the flags, so a cache
shared between machines of different vector ISAs never loads a library built for another; the
library is written atomically, so concurrent processes can race safely, and loaded under a
lock, so concurrent threads build it once. The flags target the widest vector ISA
/proc/cpuinfo reports; every kernel keeps a portable C path for the rest.

A build that fails is loud: one WARNING with the compiler's first lines of output (the whole
output is kept beside the cache entry), and the failure is recorded for ``hf2q doctor``. The
callers keep their slower path working, since serving without a compiler still serves.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from hf2q.kernels.cpu_info import cpu_flags

log = logging.getLogger(__name__)

#: the C sources of the host kernels (shipped as package data)
CSRC = Path(__file__).resolve().with_name("csrc")
#: lines of compiler output a warning quotes
MESSAGE_LINES = 8


class KernelBuildError(RuntimeError):
    """A kernel library could not be compiled or loaded; the message is the compiler's own
    (its first lines), ``output_path`` the file holding all of it when one was written."""

    def __init__(self, message: str, output_path: Path | None = None):
        super().__init__(message)
        self.output_path = output_path


def compile_flags() -> list[str]:
    """``-O3`` plus the widest vector ISA this CPU has: AVX-512F, else AVX2/FMA, else portable C.
    ``HF2Q_NO_AVX512=1`` / ``HF2Q_NO_AVX2=1`` step down (the library is cached per flag set)."""
    flags = ["-O3", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno", "-fassociative-math",
             "-fno-signed-zeros", "-fno-trapping-math"]
    cpu = cpu_flags() or set()
    if {"avx2", "fma", "f16c"} <= cpu and not os.environ.get("HF2Q_NO_AVX2"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if "avx512f" in cpu and not os.environ.get("HF2Q_NO_AVX512"):
            flags += ["-mavx512f"] + (["-mbmi2"] if "bmi2" in cpu else [])
    return flags + sanitize_flags()


def sanitize_flags() -> list[str]:
    """``HF2Q_KERNEL_SANITIZE=address`` (or ``undefined``, or both comma-separated) builds the kernels
    instrumented, for a test run under the sanitizer: the process needs the runtime preloaded, e.g.
    ``LD_PRELOAD=$(cc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0``. Off by default."""
    wanted = [s.strip() for s in os.environ.get("HF2Q_KERNEL_SANITIZE", "").split(",") if s.strip()]
    unknown = set(wanted) - {"address", "undefined"}
    if unknown:
        raise KernelBuildError(f"HF2Q_KERNEL_SANITIZE: unknown sanitizer(s) {', '.join(sorted(unknown))} "
                               "(address, undefined)")
    if not wanted:
        return []
    return [f"-fsanitize={','.join(wanted)}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g"]


def switched_off() -> str | None:
    """Why the host kernels are off by the user's choice (``HF2Q_NO_CPU_KERNELS``), or None."""
    return "HF2Q_NO_CPU_KERNELS is set" if os.environ.get("HF2Q_NO_CPU_KERNELS") else None


def compiler() -> str | None:
    """The C compiler to use: ``$CC`` (default ``cc``), else ``gcc``; None when neither is on PATH."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _first_lines(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    more = len(lines) - MESSAGE_LINES
    return "\n".join(lines[:MESSAGE_LINES] + ([f"... ({more} more lines)"] if more > 0 else []))


def compile_library(name: str, source: Path) -> Path:
    """Compile ``source`` (with the ``*.h`` beside it on the include path) into the hf2q cache and
    return the shared library's path; a cached build of the same sources and flags is reused.
    Raises :class:`KernelBuildError` with the compiler's message when there is none or it fails."""
    from hf2q.paths import cache_root

    cc = compiler()
    if not cc:
        raise KernelBuildError(f"no C compiler found (CC={os.environ.get('CC', 'cc')!r}, nor gcc on PATH)")
    flags = compile_flags()
    digest = hashlib.sha256()
    for path in (source, *sorted(source.parent.glob("*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags).encode())
    tag = digest.hexdigest()[:16]
    out_dir = cache_root() / "kernels"
    lib = out_dir / f"{name}-{tag}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        r = subprocess.run([cc, *flags, f"-I{source.parent}", str(source), "-o", str(tmp), "-lm"],
                           check=False, capture_output=True, text=True)
    except OSError as e:
        raise KernelBuildError(f"{cc}: {e}") from e
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        output = (r.stderr or "") + (r.stdout or "")
        err: Path | None = lib.with_suffix(".err")
        try:
            err.write_text(output)
        except OSError:
            err = None
        raise KernelBuildError(_first_lines(output) or f"{cc} exited with status {r.returncode} and said nothing",
                               err)
    os.replace(tmp, lib)
    lib.with_suffix(".err").unlink(missing_ok=True)  # an earlier failure's output no longer applies
    return lib


#: what a C entry point returns when its dims cannot describe the buffers (nothing was touched)
BAD_DIMS = -2


class KernelDimsError(ValueError):
    """A host kernel refused its dimensions before reading or writing any buffer."""


class KernelLibrary:
    """One C kernel library: compiled on first use, loaded once per process, thread-safe.

    ``declare(lib)`` sets the ctypes signatures (every load, fresh builds included), ``start(lib)``
    runs once after the first load of this process (start a pool, attach to one); ``off()`` names
    why the library is not used here (an environment switch, a missing prerequisite), or None."""

    def __init__(self, name: str, *, declare: Callable[[ctypes.CDLL], None],
                 start: Callable[[ctypes.CDLL], None] | None = None,
                 off: Callable[[], str | None] | None = None, source: Path | None = None):
        self.name = name
        self.source = source or CSRC / f"{name}.c"
        self._declare = declare
        self._start = start
        self._off = off
        self._lock = threading.RLock()
        self._done = False
        self._lib: ctypes.CDLL | None = None
        self.failure: str | None = None  # the build error of this process, once one happened
        self.off_reason: str | None = None
        LIBRARIES[name] = self

    def build(self) -> ctypes.CDLL:
        """Compile (or find in the cache) for the current flags and load, declared but not started
        and not remembered; raises :class:`KernelBuildError`. ``load`` is what serving calls."""
        path = compile_library(self.name, self.source)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise KernelBuildError(f"cannot load {path}: {e}") from e
        self._declare(lib)
        return lib

    def load(self) -> ctypes.CDLL | None:
        """The library, built on the first call; None when it is off here or its build failed
        (logged once at WARNING, and kept in :attr:`failure`)."""
        if self._done:
            return self._lib
        with self._lock:
            if self._done:
                return self._lib
            reason = self._off() if self._off else None
            if reason is None:
                try:
                    lib = self.build()
                    if self._start:
                        self._start(lib)
                    self._lib = lib
                except (KernelBuildError, OSError) as e:  # OSError: the cache is not writable
                    self.failure = str(e)
                    where = getattr(e, "output_path", None)
                    log.warning("the %s kernel did not build, so its slower fallback serves instead%s:\n%s",
                                self.name, f" (compiler output: {where})" if where else "", self.failure)
            self.off_reason = reason
            self._done = True
            return self._lib

    def status(self) -> tuple[str, str]:
        """``(status, detail)`` after trying the build: ``ok``, ``failed`` (with the compiler's
        message) or ``not applicable`` (with the reason)."""
        lib = self.load()
        if lib is not None:
            return "ok", ""
        if self.failure is not None:
            return "failed", self.failure
        return "not applicable", self.off_reason or ""

    @contextlib.contextmanager
    def replaced(self, lib: ctypes.CDLL | None) -> Iterator[None]:
        """Serve ``lib`` (e.g. a build for another vector ISA) instead of this process's own, for a while."""
        self.load()
        with self._lock:
            saved = self._lib
            self._lib = lib
        try:
            yield
        finally:
            with self._lock:
                self._lib = saved

    def reset(self) -> None:
        """Forget this process's load (tests: build again under another environment)."""
        with self._lock:
            self._done, self._lib, self.failure, self.off_reason = False, None, None, None


#: every kernel library by name, in the order their modules defined them (``hf2q doctor`` walks it)
LIBRARIES: dict[str, KernelLibrary] = {}
