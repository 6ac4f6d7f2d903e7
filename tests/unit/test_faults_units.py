"""Fault injection with real processes and real signals: preemption, worker crashes, crashes
mid-save, storage faults, missing nodes, dead peers. Nothing is lost and nothing hangs.

(The tests of test_faults.py that run in this process.)
"""

import pytest


@pytest.mark.parametrize(
    ("message", "peer"),
    [
        ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms", True),
        ("Application timeout caused pair closure", True),  # a cut link, seen by gloo
        ("[../pair.cc:537] Read error [127.0.0.1]:1975: Connection reset by peer. This is typically", True),
        ("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)", False),  # a bug, not a peer
    ],
)
def test_collective_failures_are_told_from_other_errors(message, peer):
    from ddpjob.train.process import backend_message, is_peer_failure

    assert is_peer_failure(RuntimeError(message)) == peer
    assert not backend_message(RuntimeError(message)).startswith("[")
