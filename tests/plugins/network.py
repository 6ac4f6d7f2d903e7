"""Data and model factories that fail as a download fails: each network error of the libraries a
factory uses (urllib, requests, huggingface_hub), real ones where they can be had on a loopback."""

import socket
import urllib.error
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dns_again():
    """urllib on a name server that does not answer: URLError(gaierror(EAI_AGAIN))."""
    raise urllib.error.URLError(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))


def http(code=503):
    raise urllib.error.HTTPError("http://example.invalid/data", code, "status", None, None)


def refused():
    """A real urlopen of a port no one listens on: URLError(ConnectionRefusedError)."""
    urllib.request.urlopen(f"http://127.0.0.1:{free_port()}/data.bin", timeout=5)


def requests_refused():
    import requests

    requests.get(f"http://127.0.0.1:{free_port()}/data.bin", timeout=5)


def requests_http(code=503):
    import requests

    response = requests.Response()
    response.status_code = code
    raise requests.HTTPError(f"{code} Server Error", response=response)


def named(name="ReadTimeout"):
    """An error of a library this test does not install, known by its class name only."""
    raise type(name, (Exception,), {})("the read timed out")


def wrapped():
    """A library's own error raised from the network error (its __cause__)."""
    try:
        dns_again()
    except OSError as exc:
        raise RuntimeError("could not download the dataset") from exc


def in_handling():
    """An error raised while handling a network error (its __context__)."""
    try:
        refused()
    except OSError:
        raise ValueError("no data")  # noqa: B904 (the point: only __context__ links them)


def missing():
    raise FileNotFoundError("no shard-*.pt files in data/")
