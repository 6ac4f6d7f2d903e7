"""Bad input of every kind: one line naming the problem and the fix, exit code 2, nothing written.

Each case runs the real CLI entry point (`ddpjob.cli.main`) in-process with its env and files."""

import json
import os
import pickle
import re

import pytest
import torch

from ddpjob import cli
from ddpjob.checkpoint.formats import hf_safetensors, single_file
from ddpjob.plugins import digits_mlp

DIST = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
ANYJOB = "plugins.anyjob"  # tests/ is on sys.path (conftest.py)
ELASTIC = ["launch", "--nnodes", "1:3", "--rdzv-endpoint", "127.0.0.1:29999", "--nproc-per-node", "1"]


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def make_files(d):
    (d / "text.pt").write_text("this is not a checkpoint")
    (d / "evil.pt").write_bytes(pickle.dumps({"model": Evil()}, protocol=2))
    torch.save({"0.weight": torch.zeros(10, 10), "0.bias": torch.zeros(10)}, d / "other_model.pt")
    torch.save({"step": 3}, d / "no_weights.pt")
    make_sharded_sets(d)
    single_file.save({"model": digits_mlp().state_dict()}, d / "cut.pt")
    (d / "cut.pt").write_bytes((d / "cut.pt").read_bytes()[:-50])
    (d / "a_file").write_text("x")
    (d / "bin_only").mkdir()
    torch.save(digits_mlp().state_dict(), d / "bin_only/pytorch_model.bin")


def make_sharded_sets(d):
    """Hugging Face sharded sets of the default model (3 shards), each broken in one way."""
    weights = digits_mlp().state_dict()
    for name in ("hf", "no_shard", "key_in_no_shard", "mixed_shards"):
        hf_safetensors.write(weights, d / name, "40KB")
    (d / "no_shard/model-00002-of-00003.safetensors").unlink()
    for name, edit in (("key_in_no_shard", {"0.bias": None}), ("mixed_shards", {"0.bias": "model-00002-of-00003"})):
        index = d / name / hf_safetensors.INDEX
        found = json.loads(index.read_text())
        for key, shard in edit.items():
            found["weight_map"].pop(key)
            if shard:
                found["weight_map"][key] = f"{shard}.safetensors"
        index.write_text(json.dumps(found))
    hf_safetensors.write(digits_mlp(hidden=64).state_dict(), d / "other_shapes", "40KB")
    hf_safetensors.write(weights, d / "cut.safetensors")
    hf_safetensors.write({**weights, "0.weight": weights["0.weight"].to(torch.int32)}, d / "int32.safetensors")
    (d / "cut.safetensors").write_bytes((d / "cut.safetensors").read_bytes()[:-50])


CASES = [
    # (name, argv, env, words in the message)
    ("rank not a number", ["train"], {**DIST, "RANK": "abc"}, ["RANK='abc'", "not an integer"]),
    ("rank outside world", ["train"], {**DIST, "RANK": "5"}, ["RANK=5", "outside", "0..1"]),
    ("no master address", ["train"], {"RANK": "0", "WORLD_SIZE": "2"}, ["MASTER_ADDR", "export"]),
    ("port out of range", ["train"], {**DIST, "MASTER_PORT": "99999"}, ["MASTER_PORT=99999", "1..65535"]),
    ("local rank too big", ["train"], {**DIST, "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, ["LOCAL_RANK=3"]),
    (
        "slurm procid too big",
        ["train"],
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"},
        ["SLURM_PROCID=2"],
    ),
    ("env setting not a number", ["train"], {"DDPJOB_EPOCHS": "ten"}, ["DDPJOB_EPOCHS='ten'", "not an integer"]),
    ("unknown env setting", ["train"], {"DDPJOB_EPOCS": "3"}, ["unknown setting DDPJOB_EPOCS", ".env.example"]),
    ("unknown flag", ["train", "--frobnicate", "1"], {}, ["unrecognized arguments: --frobnicate"]),
    ("unknown command", ["trian"], {}, ["unknown command 'trian'", "train"]),
    ("zero batch size", ["train", "--batch-size", "0"], {}, ["--batch-size", "from 1"]),
    ("zero learning rate", ["train", "--lr", "0"], {}, ["--lr", "above 0"]),
    ("unknown strategy", ["train", "--strategy", "fsdp"], {}, ["'fsdp'", "ddp, fsdp2, dp, none"]),
    ("unknown device", ["train", "--device", "tpu"], {}, ["'tpu'", "auto, cpu, cuda"]),
    (
        "model spec without callable",
        ["train", "--model", "mymodel"],
        {},
        ["--model='mymodel'", "package.module:callable"],
    ),
    ("model module missing", ["train", "--model", "no.such.mod:f"], {}, ["cannot import 'no.such.mod'"]),
    ("model callable missing", ["train", "--model", "ddpjob.plugins:nothing"], {}, ["no callable 'nothing'"]),
    ("model returns no module", ["train", "--model", "ddpjob.plugins:digits"], {}, ["not an nn.Module"]),
    (
        "plugin arguments not literals",
        ["train", "--data", "ddpjob.plugins:synthetic(samples=n)"],
        {},
        ["arguments must be literals"],
    ),
    ("dp under a world of 2", ["train", "--strategy", "dp"], DIST, ["--strategy dp runs one process", "2"]),
    ("cuda without a GPU", ["train", "--device", "cuda"], {}, ["no CUDA device", "--device cpu"]),
    ("bf16 on cpu", ["train", "--precision", "bf16", "--device", "cpu"], {}, ["bf16 needs CUDA"]),
    ("batch larger than the data", ["train", "--batch-size", "5000", "--strategy", "none"], {}, ["exceeds", "lower"]),
    ("env file missing", ["train", "--env-file", "nope.env"], {}, ["--env-file nope.env", "no such file"]),
    ("resume path missing", ["train", "--resume", "nope.pt"], {}, ["--resume='nope.pt'", "does not exist"]),
    ("init from a text file", ["train", "--init-from", "text.pt"], {}, ["not a readable PyTorch checkpoint"]),
    (
        "init from a pickle with code",
        ["train", "--init-from", "evil.pt"],
        {},
        ["refused by torch.load(weights_only=True)", "posix.system"],
    ),
    (
        "init from another model",
        ["train", "--init-from", "other_model.pt"],
        {},
        ["does not fit the model", "missing key"],
    ),
    ("init from a file without weights", ["train", "--init-from", "no_weights.pt"], {}, ["no model state dict"]),
    (
        "init from a sharded set missing a shard",
        ["train", "--init-from", "no_shard"],
        {},
        ["shard model-00002-of-00003.safetensors", "does not exist", "copy the complete set (3 shard files)"],
    ),
    (
        "init from a sharded set with a key in no shard",
        ["train", "--init-from", "key_in_no_shard"],
        {},
        ["key_in_no_shard does not fit the model", "missing key 0.bias"],
    ),
    (
        "init from a sharded set whose index names the wrong shard",
        ["train", "--init-from", "mixed_shards/model.safetensors.index.json"],
        {},
        ["maps 0.bias", "to model-00002-of-00003.safetensors, which does not hold it", "re-convert"],
    ),
    (
        "init from a sharded set of another shape",
        ["train", "--init-from", "other_shapes"],
        {},
        ["other_shapes does not fit the model", "shape mismatch for 0.weight: checkpoint (64, 64) vs model (128, 64)"],
    ),
    (
        "init from a truncated safetensors file",
        ["train", "--init-from", "cut.safetensors"],
        {},
        ["cut.safetensors is not a readable safetensors file"],
    ),
    ("resume from safetensors weights", ["train", "--resume", "hf"], {}, ["--resume hf", "with --init-from"]),
    (
        "init from integer weights for float parameters",
        ["train", "--init-from", "int32.safetensors"],
        {},
        ["int32.safetensors does not fit the model", "dtype mismatch for 0.weight: checkpoint int32 vs model float32"],
    ),
    (
        "init from a folder of pytorch_model.bin",
        ["train", "--init-from", "bin_only"],
        {},
        ["--init-from bin_only holds pytorch_model.bin: no safetensors weights", "(bin_only/pytorch_model.bin)"],
    ),
    (  # checked before the source is read: text.pt is unreadable
        "shard size that is no size",
        ["ckpt", "convert", "text.pt", "out", "--to", "safetensors", "--max-shard-size", "2XB"],
        {},
        ["--max-shard-size '2XB'", "such as 2GB"],
    ),
    (
        "shards into a folder holding an earlier set",
        ["ckpt", "convert", "other_model.pt", "hf", "--to", "safetensors", "--max-shard-size", "1KB"],
        {},
        ["hf is not empty (it holds model-00001-of-00003.safetensors", "choose an empty folder or remove it"],
    ),
    (
        "shards into a file",
        ["ckpt", "convert", "other_model.pt", "a_file", "--to", "safetensors", "--max-shard-size", "1KB"],
        {},
        ["a_file is a file; --max-shard-size writes a folder"],
    ),
    (
        "one safetensors file onto a folder",
        ["ckpt", "convert", "other_model.pt", "bin_only", "--to", "safetensors"],
        {},
        ["bin_only is a folder; --to safetensors writes one file", "--max-shard-size"],
    ),
    (
        "sharded set converted into its own folder",
        ["ckpt", "convert", "hf/model.safetensors.index.json", "hf", "--to", "safetensors", "--max-shard-size", "1GB"],
        {},
        ["hf is (or holds) the input", "elsewhere"],
    ),
    (
        "shard size for a torch file",
        ["ckpt", "convert", "other_model.pt", "out.pt", "--max-shard-size", "2GB"],
        {},
        ["--max-shard-size shards safetensors only", "--to safetensors"],
    ),
    ("resume from a truncated checkpoint", ["train", "--resume", "cut.pt"], {}, ["integrity check", "truncated"]),
    (
        "checkpoint dir is a file",
        ["train", "--checkpoint-dir", "a_file"],
        {},
        ["--checkpoint-dir='a_file'", "is a file"],
    ),
    ("indexed job without service", ["launch"], {"JOB_COMPLETION_INDEX": "0", "JOB_NAME": "j"}, ["JOB_SERVICE"]),
    ("several nodes, no endpoint", ["launch", "--nnodes", "2"], {}, ["rendezvous endpoint", "--rdzv-endpoint"]),
    ("node range backwards", ["launch", "--nnodes", "3:2"], {}, ["--nnodes='3:2'", "MIN:MAX"]),
    (
        "global batch not whole micro-batches",
        ["train", "--global-batch-size", "100", "--batch-size", "16"],
        {},
        ["--global-batch-size 100", "multiple of --batch-size 16"],
    ),
    (
        "global batch that does not split over the processes",
        ["train", "--global-batch-size", "48", "--batch-size", "16"],
        DIST,
        ["--global-batch-size 48", "on 2 processes", "multiple of 32"],
    ),
    (
        "global batch that does not split at a size of the elastic range",
        [*ELASTIC, "--max-restarts", "3", "--global-batch-size", "64", "--batch-size", "16"],
        {},
        ["--global-batch-size 64", "on 3 processes", "multiple of 48"],
    ),
    ("elastic job that a lost node would end", ELASTIC, {}, ["--nnodes 1:3 with --max-restarts 0", "--max-restarts N"]),
    (
        "loss that is not a scalar",
        ["train", "--model", f"{ANYJOB}:regressor", "--data", f"{ANYJOB}:nested", "--loss", f"{ANYJOB}:per_sample"],
        {},
        ["the loss from --loss", "not a scalar", ".mean()"],
    ),
    (
        "model that returns no loss on a batch without labels",
        ["train", "--model", f"{ANYJOB}:tiny_lm", "--data", f"{ANYJOB}:tokens(key='targets')"],
        {},
        ["model returned no loss and the batch has no labels", "--loss MODULE:CALLABLE"],
    ),
    (
        "optimizer factory that returns no optimizer",
        ["train", "--optimizer", f"{ANYJOB}:not_an_optimizer"],
        {},
        ["returned a list, not a torch.optim.Optimizer"],
    ),
    ("unknown optimizer", ["train", "--optimizer", "lamb"], {}, ["--optimizer='lamb'", "adamw, adam, sgd"]),
    ("betas not two numbers", ["train", "--betas", "0.9"], {}, ["--betas='0.9'", "B1,B2"]),
    (
        "nesterov without momentum",
        ["train", "--optimizer", "sgd", "--nesterov"],
        {},
        ["--nesterov needs", "--momentum"],
    ),
    ("compile neither on nor off", ["train", "--compile", "maybe"], {}, ["--compile='maybe'", "true or false"]),
    # values that were tracebacks and exit 1 (timeouts and LRs past their bounds, a folder as a file, ...)
    ("endless collective timeout", ["train", "--collective-timeout", "inf"], {}, ["--collective-timeout='inf'", "to "]),
    ("endless save timeout", ["train", "--save-timeout", "inf"], {}, ["--save-timeout='inf'", "to "]),
    ("huge fs timeout", ["train", "--fs-timeout", "1e30"], {}, ["--fs-timeout='1e+30'", "to 31622400"]),
    ("nan learning rate", ["train", "--lr", "nan"], {}, ["--lr='nan'", "finite"]),
    ("nan learning rate from the env", ["train"], {"DDPJOB_LR": "nan"}, ["DDPJOB_LR='nan'", "finite"]),
    ("metrics file is a folder", ["train", "--metrics", "bin_only"], {}, ["--metrics='bin_only' is a folder"]),
    (
        "model factory keyword typo",
        ["train", "--model", "ddpjob.plugins:digits_mlp(hiden=32)"],
        {},
        ["digits_mlp(hiden=32)", "'hiden'", "takes hidden, dropout"],
    ),
    (
        "data factory keyword typo",
        ["train", "--data", "ddpjob.plugins:digits(val_fractio=0.1)"],
        {},
        ["digits(val_fractio=0.1)", "'val_fractio'", "takes val_fraction"],
    ),
    (
        "data factory that raises",
        ["train", "--data", "plugins.shards:sharded"],
        {},
        ["the factory 'plugins.shards:sharded' failed", "FileNotFoundError: no shard-*.pt files"],
    ),
    (
        "endpoint port not a number",
        ["launch", "--dry-run", "--rdzv-endpoint", "host:abc"],
        {},
        ["--rdzv-endpoint='host:abc'", "port from 1 to 65535"],
    ),
    (
        "endpoint port too big",
        ["launch", "--dry-run", "--rdzv-endpoint", "127.0.0.1:99999"],
        {},
        ["--rdzv-endpoint='127.0.0.1:99999'", "port from 1 to 65535"],
    ),
    (
        "kubeflow master port not a number",
        ["launch", "--dry-run"],
        {"PET_NNODES": "2", "PET_NODE_RANK": "0", "MASTER_ADDR": "head", "MASTER_PORT": "abc"},
        ["rendezvous endpoint 'head:abc'", "MASTER_PORT"],
    ),
    ("world size not a number", ["train"], {"WORLD_SIZE": "abc"}, ["WORLD_SIZE='abc'", "not an integer"]),
    ("world size without a rank", ["train"], {"WORLD_SIZE": "2"}, ["WORLD_SIZE=2 is set but RANK is not", "alone"]),
    (
        "checkpoint dir with an unknown URL protocol",
        ["train", "--checkpoint-dir", "nosuch://bucket/ckpt"],
        {},
        ["--checkpoint-dir='nosuch://bucket/ckpt'", "unknown protocol 'nosuch'", "use s3://"],
    ),
    (
        "metrics file in object storage",
        ["train", "--metrics", "s3://bucket/metrics.jsonl"],
        {},
        ["--metrics='s3://bucket/metrics.jsonl'", "only --checkpoint-dir, --resume and --init-from take", "local"],
    ),
    (
        "endpoint with a scheme",
        ["launch", "--dry-run", "--rdzv-endpoint", "tcp://127.0.0.1:29555"],
        {},
        ["--rdzv-endpoint='tcp://127.0.0.1:29555'", "HOST"],
    ),
    (
        "endpoint host that is no host name",
        ["launch", "--dry-run", "--rdzv-endpoint", "host!:29500"],
        {},
        ["--rdzv-endpoint='host!:29500'", "HOST"],
    ),
    (
        "optimizer module missing at launch",
        ["launch", "--dry-run", "--optimizer", "no.such.opt:make"],
        {},
        ["cannot import 'no.such.opt'"],
    ),
    (
        "schedule callable missing at launch",
        ["launch", "--dry-run", "--schedule", "ddpjob.plugins:no_schedule"],
        {},
        ["no callable 'no_schedule'"],
    ),
    (
        "loss keyword typo at launch",
        ["launch", "--dry-run", "--loss", f"{ANYJOB}:cross_entropy_marked(wieght=2)"],
        {},
        ["cross_entropy_marked(wieght=2)", "'wieght'"],
    ),
]


def run_case(argv, env, directory, monkeypatch, capsys):
    """cli.main(argv) in `directory` (holding make_files' files) with exactly `env` for the job:
    (exit code, stderr, the files before, the files after)."""
    for key in [k for k in os.environ if k.startswith(("DDPJOB_", "SLURM_", "PET_")) or k in DIST or k == "LOCAL_RANK"]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(directory)
    make_files(directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    capsys.readouterr()
    code = cli.main(argv)
    after = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    return code, capsys.readouterr().err, before, after


def error_lines(err):
    return [re.sub(r"^\[node \d+ rank \d+\] ", "", line) for line in err.strip().splitlines()]  # distributed


@pytest.mark.parametrize("name, argv, env, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_exit_2(name, argv, env, words, tmp_path, monkeypatch, capsys):
    code, err, before, after = run_case(argv, env, tmp_path, monkeypatch, capsys)

    assert code == 2, err
    assert "Traceback" not in err
    lines = error_lines(err)
    assert lines[0].startswith("ddpjob: error: ")
    if "does not fit" not in err:  # a mismatch lists one problem per line
        assert len(lines) == 1, err
    for word in words:
        assert word in err
    assert after == before  # nothing overwritten


def test_each_bad_input_is_caught_by_a_check_of_its_own(tmp_path, monkeypatch, capsys):
    """Twenty or more kinds of bad input, and each one is stopped by a different check: its own
    message, naming what it is about. A check that stops catching its input lets that input through
    to a later, more generic error (or none), and two rows then share a message, or one fails."""
    messages = {}
    for name, argv, env, words in CASES:
        with monkeypatch.context() as patch:
            (tmp_path / name).mkdir()
            code, err, _, _ = run_case(argv, env, tmp_path / name, patch, capsys)
        first = error_lines(err)[0] if err.strip() else ""
        assert code == 2 and words[0] in first, f"{name}: exit {code}: {err[-500:]}"
        messages[name] = first
    assert len(CASES) >= 20
    shared = {m: [n for n in messages if messages[n] == m] for m in set(messages.values())}
    assert len(shared) == len(CASES), {m: n for m, n in shared.items() if len(n) > 1}


# ---- a factory's network error is transient: retriable (exit 1), not bad input ------------------
NET = "plugins.network"
TRANSIENT = [
    f"{NET}:dns_again",
    f"{NET}:http(code=503)",
    f"{NET}:http(code=429)",
    f"{NET}:refused",
    f"{NET}:requests_refused",
    f"{NET}:requests_http(code=502)",
    f"{NET}:named(name='ReadTimeout')",
    f"{NET}:named(name='ConnectTimeout')",
    f"{NET}:named(name='ConnectError')",
    f"{NET}:wrapped",
    f"{NET}:in_handling",
]
PERMANENT = [f"{NET}:http(code=404)", f"{NET}:requests_http(code=403)", f"{NET}:missing"]


@pytest.mark.parametrize("spec", TRANSIENT)
@pytest.mark.parametrize("build", ["data", "model"])
def test_a_factorys_network_error_is_retriable(spec, build):
    from ddpjob import plugins
    from ddpjob.errors import Retriable

    with pytest.raises(Retriable) as err:
        (plugins.build_data if build == "data" else plugins.build_model)(spec)
    assert "\n" not in str(err.value) and spec in str(err.value) and "transient" in str(err.value)


@pytest.mark.parametrize("spec", PERMANENT)
def test_a_factorys_other_errors_stay_bad_input(spec):
    from ddpjob import plugins
    from ddpjob.errors import UsageError

    with pytest.raises(UsageError):
        plugins.load_callable(spec)()
