"""``--repo ORG/NAME [--revision REV]``: fetch an HF checkpoint into the hf2q cache.

The download goes through huggingface_hub's ``snapshot_download`` (so ``HF_ENDPOINT``,
``HF_TOKEN`` and mirrors work as users expect), restricted to the files a conversion reads
(config, safetensors, tokenizer, chat template). It lands in ``<cache>/repos/<org>__<name>/``
together with a receipt, ``hf2q-receipt.json``: repo, requested revision, resolved commit and
the sha256 and size of every file.

The receipt makes the cache trustworthy and usable offline: a later run for the same repo
and revision that resolves to the same commit (or cannot reach the Hub at all) reuses the
folder without downloading, but only if every file still matches its recorded sha256. A new
download is built in a temporary sibling folder and swapped in only when complete, so an
interrupted fetch never leaves a folder that looks finished.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from hf2q.atomic import atomic_write_text, replace_dir
from hf2q.errors import ConversionError, InputError
from hf2q.paths import cache_root
from hf2q.sources.integrity import sha256_file

log = logging.getLogger("hf2q.hub")

RECEIPT = "hf2q-receipt.json"
SCHEMA = "hf2q.hub.receipt/1"
ALLOW_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json",
]
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def repo_dir(repo_id: str, cache_dir: Path | str | None = None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    return root / "repos" / repo_id.replace("/", "__")


def read_receipt(folder: Path) -> dict | None:
    try:
        rec = json.loads((folder / RECEIPT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("schema") == SCHEMA else None


def receipt_intact(folder: Path, rec: dict) -> bool:
    """Every recorded file is present with its recorded size and sha256."""
    files = rec.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, meta in files.items():
        p = folder / name
        try:
            if p.stat().st_size != meta["size"] or sha256_file(p) != meta["sha256"]:
                return False
        except (OSError, KeyError, TypeError):
            return False
    return True


def _endpoint() -> str:
    # huggingface_hub reads HF_ENDPOINT once at import; read it per call so it can change
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _resolve_commit(repo_id: str, revision: str, endpoint: str) -> str:
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).repo_info(repo_id=repo_id, revision=revision)
    if not info.sha:
        raise ConversionError(f"{repo_id}: the Hub returned no commit for revision {revision!r}")
    return info.sha


def _describe(e: BaseException, repo_id: str, revision: str, endpoint: str) -> Exception:
    """A huggingface_hub / network exception → our one-line error."""
    from huggingface_hub import errors as hf_errors

    if isinstance(e, hf_errors.RevisionNotFoundError):
        return InputError(f"{repo_id}: revision {revision!r} not found on {endpoint}")
    if isinstance(e, hf_errors.GatedRepoError):
        return InputError(f"{repo_id}: gated repository; accept its terms and set HF_TOKEN")
    if isinstance(e, hf_errors.RepositoryNotFoundError):
        return InputError(f"{repo_id}: repository not found on {endpoint} (or it is private: set HF_TOKEN)")
    if isinstance(e, hf_errors.EntryNotFoundError):
        return InputError(f"{repo_id}@{revision}: a file listed by the Hub is missing")
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ConversionError(f"{repo_id}: cannot fetch from {endpoint}: {msg}")


def _is_offline_error(e: BaseException) -> bool:
    from huggingface_hub import errors as hf_errors

    if isinstance(e, (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError,
                      hf_errors.GatedRepoError)):
        return False
    if isinstance(e, hf_errors.HfHubHTTPError):
        resp = getattr(e, "response", None)
        return resp is None or getattr(resp, "status_code", 500) >= 500
    return isinstance(e, (OSError, hf_errors.OfflineModeIsEnabled)) or "connect" in type(e).__name__.lower() \
        or "timeout" in type(e).__name__.lower()


def resolve_repo(repo_id: str, revision: str | None = None, cache_dir: Path | str | None = None) -> Path:
    """Local folder holding ``repo_id`` at ``revision`` (downloading it if the receipt does not match)."""
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise InputError(f"--repo {repo_id!r}: expected a Hub model id like ORG/NAME")
    revision = revision or "main"
    dest = repo_dir(repo_id, cache_dir)
    endpoint = _endpoint()
    rec = read_receipt(dest) if dest.is_dir() else None
    same_request = rec is not None and rec.get("repo") == repo_id and rec.get("endpoint") == endpoint
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")

    # a pinned commit we already hold needs no network at all
    if same_request and _COMMIT.match(revision) and rec.get("commit") == revision and receipt_intact(dest, rec):
        return dest
    commit = None
    if not offline:
        try:
            commit = _resolve_commit(repo_id, revision, endpoint)
        except Exception as e:  # noqa: BLE001 — classified below
            if not _is_offline_error(e):
                raise _describe(e, repo_id, revision, endpoint) from None
            log.warning("cannot reach %s (%s); looking for a cached copy", endpoint, type(e).__name__)
    if commit is None:  # offline: only a receipt for this exact request will do
        if same_request and rec.get("revision") == revision and receipt_intact(dest, rec):
            log.info("using cached %s@%s (commit %s) without the Hub", repo_id, revision, rec.get("commit"))
            return dest
        raise ConversionError(f"{repo_id}@{revision}: the Hub at {endpoint} is unreachable and there is "
                              "no intact cached copy")
    if same_request and rec.get("commit") == commit and receipt_intact(dest, rec):
        if rec.get("revision") != revision:  # same bytes, asked for by another name: note it
            _write_receipt(dest, {**rec, "revision": revision})
        return dest
    return _download(repo_id, revision, commit, dest, endpoint)


def _download(repo_id: str, revision: str, commit: str, dest: Path, endpoint: str) -> Path:
    from huggingface_hub import snapshot_download

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            snapshot_download(repo_id=repo_id, revision=commit, local_dir=tmp, allow_patterns=ALLOW_PATTERNS,
                              endpoint=endpoint, cache_dir=dest.parent / ".hf-cache")
        except Exception as e:  # noqa: BLE001 — huggingface_hub raises many types
            raise _describe(e, repo_id, revision, endpoint) from None
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # huggingface_hub's local_dir bookkeeping
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        if not (tmp / "config.json").is_file() or not any(p.suffix == ".safetensors" for p in files):
            raise InputError(f"{repo_id}@{revision}: no config.json + *.safetensors in the repository "
                             "(only safetensors checkpoints can be converted)")
        rec = {
            "schema": SCHEMA, "repo": repo_id, "revision": revision, "commit": commit, "endpoint": endpoint,
            "fetched_unix": int(time.time()),
            "files": {str(p.relative_to(tmp)): {"sha256": sha256_file(p), "size": p.stat().st_size}
                      for p in files},
        }
        _write_receipt(tmp, rec)
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("fetched %s@%s (commit %s) into %s", repo_id, revision, commit, dest)
    return dest


def _write_receipt(folder: Path, rec: dict) -> None:
    atomic_write_text(folder / RECEIPT, json.dumps(rec, indent=1, sort_keys=True) + "\n")
