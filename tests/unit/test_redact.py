"""Secrets in URIs are hidden wherever they are shown (redact.py): the user info of a URI (a password
with a raw '@' included) and the values of the token-like query parameters the docs name; in the
output of `ddpjob config` and in error lines."""

import re
from pathlib import Path

import pytest

from ddpjob import cli
from ddpjob.redact import HIDDEN, redact

SECRET = "Secret9"
DOCS = Path(__file__).parents[2] / "docs/trackers.md"


@pytest.mark.parametrize(
    "uri, shown",
    [
        (f"http://alice:{SECRET}@host:5000/x", "http://***@host:5000/x"),
        (f"http://alice:Pw@{SECRET}@host", "http://***@host"),  # a raw '@' in the password
        (f"postgresql://u:{SECRET}@db/mlflow", "postgresql://***@db/mlflow"),
        ("http://host/a@b", "http://host/a@b"),  # an '@' in the path is no user info
    ],
)
def test_user_info_is_hidden_up_to_the_last_at_before_the_host(uri, shown):
    assert redact(uri) == shown
    assert redact(f"connect to {uri} and {uri}") == f"connect to {shown} and {shown}"


def documented_query_names() -> list[str]:
    """The query parameter names docs/trackers.md says are hidden (`name` in its Secrets section)."""
    section = DOCS.read_text().split("## Secrets", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`([A-Za-z_-]+)`", section.split("query parameters", 1)[1].split(")", 1)[0])


def test_docs_name_the_hidden_query_parameters():
    assert {"sig", "X-Amz-Signature", "token", "key", "secret", "password", "access_token"} <= set(
        documented_query_names()
    )


@pytest.mark.parametrize("name", documented_query_names())
def test_each_documented_query_parameter_is_hidden(name):
    uri = f"https://h/x?a=1&{name}={SECRET}&b=2"
    assert redact(uri) == f"https://h/x?a=1&{name}={HIDDEN}&b=2"
    assert redact(f'm:f(url="https://h/x?{name}={SECRET}")') == f'm:f(url="https://h/x?{name}={HIDDEN}")'


def test_config_output_and_error_lines_hide_the_secret(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # train makes its run dir where it runs: not in the checkout
    uri = f"http://alice:Pw@{SECRET}@host:5000"
    assert cli.main(["config", "--tracker-uri", uri]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and "DDPJOB_TRACKER_URI=http://***@host:5000" in out
    spec = f'nomodule:f(url="https://h/x?X-Amz-Signature={SECRET}")'
    assert cli.main(["train", "--device", "cpu", "--data", spec]) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and err.startswith("ddpjob: error: ") and "X-Amz-Signature=***" in err
