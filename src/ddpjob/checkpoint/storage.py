"""Where checkpoints live: a local folder, or an object store named by a URL (``s3://bucket/prefix``,
or any fsspec protocol whose library is installed: ``gs://``, ``az://``, ...).

Both sit behind one small Protocol, ``Storage``, whose operations the catalogue, the choice and the
formats use: list a folder, exists, size, open for reading, ``write`` a data object, ``commit`` a
small record (a manifest: the step that makes a checkpoint count), delete a file or a whole
folder/prefix, and where a folder is written before it is published.

- ``LocalStorage``: today's behaviour: a temporary created exclusively, fsync, rename into place,
  folders written beside their final name and swapped in (``atomic_fs``); the dir lock is taken by
  the manager (``dirlock``).
- ``FsspecStorage``: objects have no rename, so data objects are written at their final keys and the
  manifest, written last, is the commit: a conditional put (``If-None-Match: *``) on S3, an exclusive
  create (``xb``) elsewhere. Transient failures (5xx, SlowDown, timeouts, resets) are retried with
  backoff for up to ``retry_for`` seconds; a wrong key, a missing bucket or an endpoint that does not
  resolve are UsageError (``probe`` finds them at start-up).

A location is a ``Path`` (local) or an ``ObjectPath`` (a URL), which has the few pathlib methods the
catalogue needs and no ``__fspath__``, so that nothing writes a URL as a local folder by mistake.
Endpoint, region and credentials come from the standard variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ...), never from a flag.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
import posixpath
import random
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import urlsplit

from ddpjob import log, optional
from ddpjob.checkpoint import atomic_fs, checksum
from ddpjob.config import Config
from ddpjob.errors import Retriable, UsageError, first_line, is_transient
from ddpjob.redact import redact

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
PROBE = ".ddpjob-probe"  # the object the start-up probe writes and deletes under the prefix
WRITING = ".writing"  # beside a checkpoint in an object store while a save writes it (step-N.pt.writing)
RETRY_FOR = 60.0  # seconds a transient failure is retried by default (the manager passes --save-timeout)
T = TypeVar("T")


def is_url(text: str | os.PathLike[str]) -> bool:
    return isinstance(text, str) and bool(URL.match(text))


class ObjectPath:
    """A key in an object store, named by its URL; pathlib's name, parent, ``/`` and the queries the
    catalogue asks, answered by its FsspecStorage."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __str__(self) -> str:  # what messages show: a password in the URL hidden (the store gets .url)
        return redact(self.url)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return posixpath.basename(self.url.split("://", 1)[1])

    @property
    def parent(self) -> ObjectPath:
        scheme, rest = self.url.split("://", 1)
        return ObjectPath(f"{scheme}://{posixpath.dirname(rest) or rest}")

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def resolve(self) -> ObjectPath:
        return self

    @property
    def store(self) -> FsspecStorage:
        return fsspec_storage(self.url)

    def exists(self) -> bool:
        return self.store.exists(self)

    def is_dir(self) -> bool:
        return self.store.is_dir(self)

    def is_file(self) -> bool:
        return self.store.exists(self) and not self.store.is_dir(self)

    def iterdir(self) -> Iterator[ObjectPath]:
        return iter(self.store.list(self))

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=self.store.size(self))

    def read_bytes(self) -> bytes:
        with self.store.open_read(self) as f:
            return bytes(f.read())

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def unlink(self, missing_ok: bool = False) -> None:
        self.store.delete(self)


Where = Path | ObjectPath


class Storage(Protocol):
    """The operations checkpoints need from where they live."""

    def list(self, folder: Any) -> list[Any]:
        """What folder holds directly (files and folders); [] when it does not exist."""

    def exists(self, where: Any) -> bool: ...

    def is_dir(self, where: Any) -> bool: ...

    def size(self, where: Any) -> int: ...

    def open_read(self, where: Any) -> IO[bytes]:
        """A seekable binary stream."""

    def write(self, where: Any, fill: Callable[[IO[bytes]], Any]) -> None:
        """``fill(stream)`` writes a data object: whole, or not at all where the store can tell."""

    def commit(self, where: Any, data: bytes) -> None:
        """Write a small record (a manifest) durably, after the data it vouches for: the step that
        makes a checkpoint count. On an object store, only if no record is there (a second writer fails)."""

    def delete(self, where: Any) -> None:
        """Remove a file or a whole folder (prefix); nothing when it is not there."""

    def staging(self, final: Any) -> Any:
        """Where a folder is written before it is published as ``final``."""

    def publish(self, staged: Any, final: Any) -> None:
        """Make the written (and committed) folder ``final``."""

    def probe(self, folder: Any) -> None:
        """That folder can be listed and written: UsageError for what no retry clears."""

    def writing(self, final: Any) -> None:
        """Before a save writes final where it is seen (an object store): leave a record that it is
        ddpjob's save, so that the cleanup of a killed one removes ddpjob's objects and no one else's."""

    def written(self, final: Any) -> None:
        """After final's commit: remove that record."""


class LocalStorage:
    """A local or shared POSIX folder: temporaries, fsync and renames (atomic_fs)."""

    def list(self, folder: Path) -> list[Path]:
        return list(folder.iterdir()) if folder.is_dir() else []

    def exists(self, where: Path) -> bool:
        return where.exists()

    def is_dir(self, where: Path) -> bool:
        return where.is_dir()

    def size(self, where: Path) -> int:
        return where.stat().st_size

    def open_read(self, where: Path) -> IO[bytes]:
        return open(where, "rb")

    def write(self, where: Path, fill: Callable[[IO[bytes]], Any]) -> None:
        tmp = atomic_fs.temp_name(where)
        try:
            with os.fdopen(atomic_fs.create_exclusive(tmp), "wb", buffering=0) as f:
                fill(f)
                os.fsync(f.fileno())
            os.replace(tmp, where)
        finally:
            tmp.unlink(missing_ok=True)

    def commit(self, where: Path, data: bytes) -> None:
        self.write(where, lambda f: f.write(data))
        atomic_fs.fsync_dir(where.parent)

    def delete(self, where: Path) -> None:
        if where.is_dir() and not where.is_symlink():
            shutil.rmtree(where, ignore_errors=True)
        else:
            where.unlink(missing_ok=True)

    def staging(self, final: Path) -> Path:
        return final.with_name(f".{final.name}.tmp")

    def publish(self, staged: Path, final: Path) -> None:
        atomic_fs.replace_folder(staged, final)

    def probe(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)

    def writing(self, final: Path) -> None:
        """Nothing: a save writes temporaries (atomic_fs), which name themselves."""

    def written(self, final: Path) -> None:
        """Nothing (as writing)."""


LOCAL: Storage = LocalStorage()  # (typed so that mypy checks it keeps to the Protocol)


def _unavailable(exc: BaseException) -> bool:
    """An error no retry clears: credentials refused, bucket missing, a name that does not resolve."""
    if isinstance(exc, PermissionError | FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.ENOENT)


class FsspecStorage:
    """An fsspec filesystem (s3fs for ``s3://``): objects at their final keys, the manifest last."""

    def __init__(self, protocol: str, fs: Any, retry_for: float = RETRY_FOR) -> None:
        self.protocol, self.fs, self.retry_for = protocol, fs, retry_for

    def _key(self, where: ObjectPath) -> str:
        return where.url.split("://", 1)[1]

    def _url(self, key: str) -> ObjectPath:
        return ObjectPath(f"{self.protocol}://{key}")

    def _retry(self, work: Callable[[], T], what: str) -> T:
        """work(), its transient failures retried with backoff (jittered, up to 5 s apart) for retry_for s."""
        deadline, delay, told = time.monotonic() + self.retry_for, 0.2, False
        while True:
            try:
                return work()
            except Exception as exc:
                left = deadline - time.monotonic()
                if _unavailable(exc) or not retriable(exc) or left <= 0:
                    raise
                if not told:
                    log.warning(f"cannot {what} now ({first_line(exc)[:200]}); retrying for up to {self.retry_for:g} s")
                    told = True
                self.fs.invalidate_cache()
            time.sleep(min(delay * (0.5 + random.random()), left))  # the last try at the deadline, not past it
            delay = min(delay * 2, 5.0)

    def list(self, folder: ObjectPath) -> list[ObjectPath]:
        def names() -> list[str]:
            self.fs.invalidate_cache(self._key(folder))
            try:
                return [str(e) for e in self.fs.ls(self._key(folder), detail=False, refresh=True)]
            except FileNotFoundError:
                return []

        found = self._retry(names, f"list {folder}")
        return [self._url(k.rstrip("/")) for k in found if k.rstrip("/") != self._key(folder)]

    def exists(self, where: ObjectPath) -> bool:
        self.fs.invalidate_cache(self._key(where))
        return bool(self._retry(lambda: self.fs.exists(self._key(where)), f"look up {where}"))

    def is_dir(self, where: ObjectPath) -> bool:
        self.fs.invalidate_cache(self._key(where))
        return bool(self._retry(lambda: self.fs.isdir(self._key(where)), f"look up {where}"))

    def size(self, where: ObjectPath) -> int:
        return int(self._retry(lambda: self.fs.size(self._key(where)), f"read {where}"))

    def open_read(self, where: ObjectPath) -> IO[bytes]:
        data = self._retry(lambda: self.fs.cat_file(self._key(where)), f"read {where}")
        return io.BytesIO(data)

    def write(self, where: ObjectPath, fill: Callable[[IO[bytes]], Any]) -> None:
        # A stream to the object: s3fs uploads it in parts and completes the upload on close, so the
        # object appears whole or not at all; a killed writer leaves an incomplete upload (cleaned at start).
        def put() -> None:
            with self.fs.open(self._key(where), "wb") as f:
                fill(f)

        self._retry(put, f"write {where}")

    def commit(self, where: ObjectPath, data: bytes) -> None:
        def put() -> None:  # "xb": s3fs sends If-None-Match: * (a second commit gets 412: FileExistsError)
            with self.fs.open(self._key(where), "xb") as f:
                f.write(data)

        try:
            self._retry(put, f"write {where}")
        except (
            OSError
        ) as exc:  # 412 Precondition Failed: s3fs says FileExistsError only where the store names the header
            if isinstance(exc, FileExistsError) or "pre-condition" in str(exc).lower() or "precondition" in str(exc):
                raise OSError(
                    errno.EEXIST, f"{where} was committed by another writer meanwhile (conditional put refused)"
                ) from None
            raise

    def delete(self, where: ObjectPath) -> None:
        key = self._key(where)

        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                if self.fs.isdir(key):
                    self.fs.rm(key, recursive=True)
                    if self.protocol in ("s3", "s3a"):  # a store with real folders (SeaweedFS) keeps it empty
                        bucket, _, prefix = key.partition("/")
                        self.fs.call_s3("delete_object", Bucket=bucket, Key=prefix + "/")
                elif self.fs.exists(key):
                    self.fs.rm(key)
            self.fs.invalidate_cache(key)

        self._retry(remove, f"delete {where}")

    def staging(self, final: ObjectPath) -> ObjectPath:
        return final  # no rename: parts go to their final keys, and the manifest written last commits them

    def publish(self, staged: ObjectPath, final: ObjectPath) -> None:
        """Nothing to move: the manifest made it count."""

    def writing(self, final: ObjectPath) -> None:
        self.write(final.with_name(final.name + WRITING), lambda f: f.write(b"ddpjob"))

    def written(self, final: ObjectPath) -> None:
        self.delete(final.with_name(final.name + WRITING))

    def abort_uploads(self, folder: ObjectPath) -> int:
        """Abort the incomplete multipart uploads under folder (a writer killed mid-upload); their count."""
        if self.protocol not in ("s3", "s3a"):
            return 0
        bucket, _, prefix = self._key(folder).partition("/")
        found = self._retry(
            lambda: self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix.rstrip("/") + "/"),
            f"list uploads in {folder}",
        )
        uploads = found.get("Uploads", [])
        for upload in uploads:
            key, upload_id = upload["Key"], upload["UploadId"]
            self._retry(
                lambda: self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id),  # noqa: B023
                f"abort an upload in {folder}",
            )
        return len(uploads)

    def probe(self, folder: ObjectPath) -> None:
        """List the prefix, then write and delete a small object under it, once (no retries for what
        no retry clears): a wrong key, a missing bucket, an endpoint that does not resolve -> UsageError."""
        resolve_endpoint(folder)
        try:
            if self.protocol in ("s3", "s3a"):  # some stores create a missing bucket on the first put
                bucket = self._key(folder).partition("/")[0]
                try:
                    self._retry(lambda: self.fs.call_s3("head_bucket", Bucket=bucket), f"look up bucket {bucket}")
                except FileNotFoundError:
                    raise UsageError(
                        f"cannot use --checkpoint-dir {folder}: bucket {bucket} does not exist at this endpoint; "
                        "create it, or fix the bucket name or AWS_ENDPOINT_URL"
                    ) from None
            self.list(folder)
            self.write(folder / PROBE, lambda f: f.write(b"ddpjob"))
            self.delete(folder / PROBE)
        except UsageError:
            raise
        except Exception as exc:
            if _unavailable(exc) or not retriable(exc):
                why = _described(exc)
                if isinstance(exc, PermissionError):
                    why = f"the store refused the credentials or their access to the bucket ({why})"
                raise UsageError(
                    f"cannot use --checkpoint-dir {folder}: {why}; check the bucket, the credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE) and AWS_ENDPOINT_URL"
                ) from None
            raise Retriable(
                f"cannot reach {folder}: {_described(exc)}; the store may be down: a restart retries"
            ) from None


def _described(exc: BaseException) -> str:
    return first_line(exc)[:300] or type(exc).__name__


def retriable(exc: BaseException) -> bool:
    """A failure a retry may clear: the network, a 5xx or SlowDown, a timeout (botocore's errors are
    known by name, a bare 5xx by botocore's "(503)": ddpjob does not import botocore)."""
    if is_transient(exc):  # the network errors, botocore's among them (errors.TRANSIENT_NAMES)
        return True
    text = str(exc)
    return bool(
        any(word in text for word in ("SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"))
        or re.search(r"\(5[0-9][0-9]\)", text)
    )


def resolve_endpoint(folder: ObjectPath) -> None:
    """UsageError when the endpoint's host name does not resolve (a typo no retry clears)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    host = urlsplit(endpoint).hostname if endpoint and folder.url.startswith(("s3://", "s3a://")) else None
    if not host:
        return
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            raise Retriable(f"cannot resolve the endpoint {host} now ({exc.strerror}); a restart retries") from None
        raise UsageError(
            f"the object store endpoint {host} (AWS_ENDPOINT_URL) does not resolve ({exc.strerror}); fix the address"
        ) from None


_STORES: dict[tuple[str, str], FsspecStorage] = {}
_PARENTS_STORES: list[FsspecStorage] = []  # kept, never used: their finalizers would close the parent's connections


def _own_stores_after_fork() -> None:
    """A forked process (launch's workers and checks) makes its own stores: s3fs refuses an instance
    made in another process, and its connections are the parent's."""
    _PARENTS_STORES.extend(_STORES.values())
    _STORES.clear()


os.register_at_fork(after_in_child=_own_stores_after_fork)
# The environment variables that configure a store beyond its URL: endpoint, region, credentials
# and profile of S3 (botocore), GCS and Azure.
STORE_ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "AZURE_")


def store_settings() -> str:
    """A digest of the store variables now set: a store is reused only while they stay the same, so
    a process whose endpoint or key changes (a tool, a test) never talks to the previous endpoint."""
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith(STORE_ENV_PREFIXES))
    return hashlib.sha256(repr(settings).encode()).hexdigest()


def fsspec_storage(url: str) -> FsspecStorage:
    """The FsspecStorage for url's protocol and the store variables now set (one per process while
    they stay the same); UsageError, one line naming what to install, when its library is missing."""
    protocol = url.split("://", 1)[0].lower()
    key = (protocol, store_settings())
    if key not in _STORES:
        if problem := optional.url_problem(url):
            raise UsageError(f"{url} {problem}")
        # aiohttp (under s3fs) leaves a task's reset connection to asyncio's logger, as a traceback;
        # the failure itself reaches ddpjob (retried, or one line)
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        _STORES[key] = FsspecStorage(protocol, filesystem(protocol, RETRY_FOR), RETRY_FOR)
    return _STORES[key]


S3_PROTOCOLS = ("s3", "s3a")
S3_ATTEMPTS = 3  # botocore's tries of one request (throttling, 5xx, a reset), at most 1 + 2 s apart
S3_WAITS = (5.0, 15.0)  # s3fs's own connect and read timeouts: the longest a wait gets here


def s3_client_settings(retry_for: float) -> dict[str, Any]:
    """botocore's settings under FsspecStorage._retry, which retries for ``retry_for`` s: a few tries of
    its own, each connect or read waiting a share of that (at least 1 s, at most s3fs's 5 and 15 s), so
    that an operation against a store that stopped answering ends near the deadline, not minutes after."""
    share = max(retry_for / S3_ATTEMPTS, 1.0)
    connect, read = (min(share, longest) for longest in S3_WAITS)
    retries = {"total_max_attempts": S3_ATTEMPTS, "mode": "standard"}
    return {"retries": retries, "connect_timeout": connect, "read_timeout": read}


def filesystem(protocol: str, retry_for: float) -> Any:
    """A new fsspec filesystem for protocol; an S3 one with s3_client_settings, and without s3fs's own
    loop of retries (5 tries, each with botocore's): FsspecStorage._retry retries the same failures."""
    import fsspec  # a dependency of torch

    if protocol not in S3_PROTOCOLS:
        return fsspec.filesystem(protocol, skip_instance_cache=True)
    fs = fsspec.filesystem(protocol, skip_instance_cache=True, config_kwargs=s3_client_settings(retry_for))
    fs.retries = 1
    return fs


def checkpoint_dir(cfg: Config) -> Where:
    """The run's checkpoint dir: --checkpoint-dir (a folder or a URL), else RUN_DIR/checkpoints."""
    return location(cfg.checkpoint_dir) if is_url(cfg.checkpoint_dir) else cfg.checkpoint_path


def location(text: str | Path) -> Where:
    """A local path, or an ObjectPath for a URL."""
    return ObjectPath(text) if isinstance(text, str) and is_url(text) else Path(text)


def argument(text: str) -> Where:
    """A command line's path or URL; UsageError, one line, when the URL's library is not installed."""
    if is_url(text) and (problem := optional.url_problem(text)):
        raise UsageError(f"{text} {problem}")
    return location(text)


def of(where: Where) -> Storage:
    return where.store if isinstance(where, ObjectPath) else LOCAL


def local(where: Where) -> Path | None:
    """The local path, None for an object."""
    return where if isinstance(where, Path) else None


def checksum_fields(where: Where) -> dict[str, Any]:
    """What a manifest records of a file or object: its size and checksum (a file through a memory map)."""
    if isinstance(where, Path):
        return {"size": where.stat().st_size, **checksum.of_file(where)}
    with of(where).open_read(where) as f:
        data = f.read()
    return {"size": len(data), **checksum.manifest_fields(checksum.digest(data))}


def matches(where: Where, entry: Any) -> bool:
    """Whether a file or object has the checksum its manifest entry records (checksum.matches)."""
    if isinstance(where, Path):
        return checksum.matches(where, entry)
    try:
        expected = checksum.from_manifest(entry)
    except checksum.ManifestError:
        return False
    if expected is None:
        return False
    with of(where).open_read(where) as f:
        return checksum.digest(f.read(), expected.algorithm) == expected.value


def block_digests(where: Where, indices: range, block: int) -> dict[int, checksum.Value]:
    """checksum.block_digests of a file, or of an object (read once, whole)."""
    if isinstance(where, Path):
        return checksum.block_digests(where, indices, block)
    with of(where).open_read(where) as f:
        data = memoryview(f.read())
    return {i: checksum.digest(data[i * block : (i + 1) * block]) for i in indices}


def set_retry_for(seconds: float) -> None:
    """How long every store retries a transient failure (the manager passes --save-timeout)."""
    global RETRY_FOR
    RETRY_FOR = seconds
    for store in _STORES.values():
        if store.protocol in S3_PROTOCOLS and store.retry_for != seconds:  # its client's waits follow
            store.fs = filesystem(store.protocol, seconds)
        store.retry_for = seconds


def dcp_fsspec() -> ModuleType:
    """torch's fsspec storage for DCP (FsspecWriter, FsspecReader), a private module in torch 2.13:
    the one place that imports it."""
    try:
        import torch.distributed.checkpoint._fsspec_filesystem as module
    except ImportError as exc:
        raise UsageError(
            f"this torch has no fsspec storage for distributed checkpoints ({first_line(exc)[:120]}); "
            "use torch 2.12 or 2.13, or --checkpoint-format file"
        ) from None
    return module
