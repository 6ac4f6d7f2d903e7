"""`ddpjob diagnose` on real stuck jobs (gloo, torchrun): every rank that can still act writes its
collectives and stacks to RUN_DIR/traces, and the verdict names the rank that stopped the job.

(The tests of test_diagnose.py that run in this process.)
"""

from ddpjob.tools import diagnose


def test_ranks_are_listed_compactly():
    assert diagnose.ranks_text([0, 2, 3, 4, 7, 8]) == "0, 2-4, 7, 8"


def test_a_silent_rank_is_named_even_when_no_rank_is_left_waiting(tmp_path):
    # gloo marks a collective that failed as finished: the silent rank must still be named
    folder = tmp_path / "traces"
    folder.mkdir()
    (folder / "meta_0.json").write_text('{"rank": 0, "host": "a", "step": 7, "why": "a collective failed"}')
    (folder / "meta_5.json").write_text('{"rank": 5, "host": "b", "step": 7, "why": "an earlier, larger attempt"}')
    (folder / "meta_1.json").write_text('{"rank": 1, "host": "b", "st')  # torn: counts as no trace
    out = diagnose.diagnose(tmp_path, world_size=2)
    assert out.splitlines()[0].startswith("rank(s) 1 wrote no trace"), out
    assert "5" not in out.splitlines()[0]
