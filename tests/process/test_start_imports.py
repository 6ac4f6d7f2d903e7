"""What a run imports before its first step: torch's distributed checkpoint (DCP) only when the run
reads or writes DCP folders. A plain DDP run with the single-file format, through a fresh start and
a resume (choosing, verifying and loading a checkpoint), reaches its first step without it; ddpjob
imported it with its checkpoint catalogue before, for every run. (DTensor, FSDP2 and sympy come
with torch._dynamo, which torch 2.13's DDP constructor imports itself, in any DDP program.)"""

import json

from helpers import ddpjob, ok, records

DCP = "torch.distributed.checkpoint"


def imported_before_step_1(tmp_path, *flags: str) -> list[str]:
    out = tmp_path / "imports.json"
    data = f"tests.plugins.import_probe:digits(out={str(out)!r})"
    # fresh: a fork of the starter would hold what the starter imported
    ok(
        ddpjob(
            ["train", "--run-dir", str(tmp_path), "--data", data, "--num-workers", "0", *flags], tmp_path, fresh=True
        )
    )
    return list(json.loads(out.read_text()))


def test_a_ddp_run_with_the_file_format_reaches_step_1_without_importing_dcp(tmp_path):
    fresh = imported_before_step_1(tmp_path, "--max-steps", "2", "--save-every", "1")
    resumed = imported_before_step_1(tmp_path, "--max-steps", "3")
    starts = [r for r in records(tmp_path) if r["event"] == "start"]
    assert starts[-1]["resumed_from"] and starts[-1]["strategy"] == "ddp"  # a load of the single file, under DDP
    assert DCP not in fresh
    assert DCP not in resumed


def test_a_run_that_resumes_a_dcp_folder_has_dcp_by_step_1(tmp_path):
    """The probe can see it: where the run needs it before its first step, it is there."""
    flags = ["--checkpoint-format", "dcp", "--save-every", "1"]
    imported_before_step_1(tmp_path, "--max-steps", "1", *flags)
    assert DCP in imported_before_step_1(tmp_path, "--max-steps", "2", *flags)
