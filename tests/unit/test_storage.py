"""checkpoint.storage without a server: URLs become ObjectPaths (never a local folder named "s3:"),
their path algebra is pathlib's, and a URL whose library is missing is one line naming the extra.
(The store itself is tested against a real S3 server: tests/process/test_s3_checkpoints.py.)"""

import importlib
import sys
from pathlib import Path

import pytest

from ddpjob.checkpoint import storage
from ddpjob.checkpoint.storage import LOCAL, ObjectPath
from ddpjob.errors import UsageError, transient


def test_a_url_is_an_object_path_and_anything_else_a_local_path():
    assert storage.location("s3://bucket/runs/job") == ObjectPath("s3://bucket/runs/job")
    assert storage.location("runs/job") == Path("runs/job") and storage.of(Path("x")) is LOCAL


def test_object_paths_have_pathlibs_names_and_parents():
    folder = ObjectPath("s3://bucket/runs/job/")
    step = folder / "step-10.pt"
    assert str(step) == "s3://bucket/runs/job/step-10.pt" and step.name == "step-10.pt"
    assert step.parent == folder and step.with_name("step-10.pt.sum").name == "step-10.pt.sum"
    assert ObjectPath("s3://bucket").parent == ObjectPath("s3://bucket")
    assert not hasattr(step, "__fspath__")  # nothing opens it as a local file by mistake


def not_installed(monkeypatch):
    """As if s3fs were not installed: its import fails, and fsspec has not kept its class."""
    registry = importlib.import_module("fsspec.registry")  # (fsspec.registry, the attribute, is a mapping)
    monkeypatch.setitem(sys.modules, "s3fs", None)
    monkeypatch.delitem(registry._registry, "s3", raising=False)


def test_a_url_shows_no_password_in_messages_but_the_store_gets_it():
    where = ObjectPath("ftp://user:pa55word@host/ckpt") / "step-1.pt"
    assert "pa55word" not in str(where) and f"{where}" == "ftp://***@host/ckpt/step-1.pt"
    assert where.url == "ftp://user:pa55word@host/ckpt/step-1.pt"


def test_a_url_without_its_library_is_one_line_naming_the_extra(monkeypatch):
    not_installed(monkeypatch)
    monkeypatch.setattr(storage, "_STORES", {})
    for call in (storage.argument, storage.fsspec_storage):
        with pytest.raises(UsageError, match=r"^s3://b/x needs the fsspec library .*pip install 'ddpjob\[s3\]'$"):
            call("s3://b/x")


def test_a_store_is_reused_only_while_its_endpoint_and_credentials_stay_the_same(monkeypatch):
    """One process that checkpoints to one endpoint and then to another (a tool, a test session) must
    reach the second: a store kept per protocol alone kept talking to the first, long gone."""
    pytest.importorskip("s3fs")
    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1001")
    first = storage.fsspec_storage("s3://b/x")
    assert storage.fsspec_storage("s3://other/y") is first  # the same settings: one store
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1002")
    second = storage.fsspec_storage("s3://b/x")
    assert second is not first
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1001")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another key")
    assert storage.fsspec_storage("s3://b/x") not in (first, second)


def test_an_unknown_protocol_is_one_line():
    with pytest.raises(UsageError, match="unknown protocol 'nosuch'"):
        storage.argument("nosuch://b/x")


def test_only_a_servers_5xx_is_retried_not_any_500_in_a_message():
    """A failure that names step-500 (a key, a path) is not a server error: retrying it only delays
    the one line; botocore's "(503)" is."""
    assert not storage.retriable(ValueError("cannot use s3://b/run/step-500.pt: not a checkpoint"))
    assert storage.retriable(Exception("An error occurred (503) when calling the HeadObject operation: Unavailable"))


BROKEN_CONNECTIONS = {  # botocore's errors for a connection that broke mid-request or mid-body
    "ConnectionClosedError": {"endpoint_url": "http://store:8333"},
    "ResponseStreamingError": {"error": "Connection reset by peer"},
    "IncompleteReadError": {"actual_bytes": 10, "expected_bytes": 20},
    "EndpointConnectionError": {"endpoint_url": "http://store:8333"},
    "ReadTimeoutError": {"endpoint_url": "http://store:8333"},
}


@pytest.mark.parametrize("name", BROKEN_CONNECTIONS)
def test_a_connection_to_the_store_that_broke_is_retriable_not_bad_input(name):
    """What a checkpoint read from the store raises once the retries end (single_file.read and DCP
    call errors.transient): a restart retries it (exit 1), never a 'not a readable checkpoint', exit 2."""
    exceptions = pytest.importorskip("botocore.exceptions")
    exc = getattr(exceptions, name)(**BROKEN_CONNECTIONS[name])
    assert transient(exc, "s3://b/run/step-5.pt") is not None and storage.retriable(exc)


def test_every_failure_s3fs_would_retry_is_retried_by_ddpjob_which_turns_s3fs_retries_off(monkeypatch):
    """s3fs's own loop (5 tries, each with botocore's) is off, so that --save-timeout bounds a store
    operation: each error class it retried must be one FsspecStorage._retry retries."""
    s3fs = pytest.importorskip("s3fs")
    for cls in s3fs.core.S3_RETRYABLE_ERRORS:
        assert storage.retriable(cls.__new__(cls)), cls
    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1001")
    assert storage.fsspec_storage("s3://b/x").fs.retries == 1


@pytest.mark.parametrize(
    ("save_timeout", "waits"), [(3, (1.0, 1.0)), (12, (4.0, 4.0)), (30, (5.0, 10.0)), (1800, (5.0, 15.0))]
)
def test_the_s3_clients_waits_follow_the_save_timeout(monkeypatch, save_timeout, waits):
    """A store made before the manager sets --save-timeout (a probe at start-up) gets a client whose
    connect and read waits are a share of it: 3 tries of botocore's end near the deadline."""
    pytest.importorskip("s3fs")
    monkeypatch.setattr(storage, "_STORES", {})
    monkeypatch.setattr(storage, "RETRY_FOR", storage.RETRY_FOR)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1001")
    store = storage.fsspec_storage("s3://b/x")
    storage.set_retry_for(save_timeout)
    settings = store.fs.config_kwargs
    assert (settings["connect_timeout"], settings["read_timeout"]) == waits and store.retry_for == save_timeout
    assert store.fs.retries == 1
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(  # made offline: what the requests get
        "s3", region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s", config=Config(**settings)
    )
    assert client.meta.config.retries["total_max_attempts"] == storage.S3_ATTEMPTS == 3  # tries, not retries
