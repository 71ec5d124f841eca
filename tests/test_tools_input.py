"""Bad input to the auxiliary commands (trace, bench comm, data prepare and verify, export,
the benchmarks) ends with exit code 2 and a message naming the flag, before any process
starts or any work is done, and leaves nothing half-written behind. No processes, except
where a worker pool is the point of the test."""

from __future__ import annotations

import io
import json
import runpy
import sys
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.data.prepare import DataError, prepare
from paratrain.parallel.pipeline.timeline import Interval, StepRecord, Timeline
from paratrain.trace import RenderError, step_index


def three_steps() -> Timeline:
    """A 1F1B pp=2 m=1 run of three recorded steps, each a different length."""
    def step(span: float) -> StepRecord:
        return StepRecord(span, [Interval("F", 0, 0, 0, 1), Interval("B", 0, 0, 1, span)])
    return Timeline("1f1b", 2, 1, 1, [[step(2.0), step(3.0), step(4.0)] for _ in range(2)])


# ---- trace --step ---------------------------------------------------------------------------


def test_trace_steps_are_numbered_from_one_like_the_printout():
    timeline = three_steps()
    assert [step_index(timeline, s) for s in (1, 2, 3, None)] == [0, 1, 2, 2]
    for bad in (0, 4, 99, -1):
        with pytest.raises(RenderError, match=r"--step .*numbered 1\.\.3"):
            step_index(timeline, bad)


def test_trace_run_step_out_of_range_exits_2_naming_the_range(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.json"
    three_steps().save(path)
    for bad in ("99", "0", "4"):
        assert main(["trace", "--run", str(path), "--step", bad, "--out", str(tmp_path / "x.svg")]) == 2
        assert "--step" in capsys.readouterr().err
    assert not (tmp_path / "x.svg").exists()
    assert main(["trace", "--run", str(path), "--step", "3", "--out", str(tmp_path / "x.svg")]) == 0
    assert "drawing step 3" in capsys.readouterr().out
    assert main(["trace", "--step", "2", "--out", str(tmp_path / "y.svg")]) == 2
    assert "--run" in capsys.readouterr().err


def test_trace_run_refuses_the_flags_of_a_simulated_schedule(tmp_path, capsys):
    """`trace --run RUN --pp 2` drew the recorded run, ignoring --pp without a word."""
    path = tmp_path / "timeline.json"
    three_steps().save(path)
    for flags in (["--pp", "2"], ["--schedule", "gpipe", "--b-cost", "2"]):
        argv = ["trace", "--run", str(path), *flags, "--out", str(tmp_path / "x.svg")]
        assert main(argv) == 2, flags
        err = capsys.readouterr().err
        assert f"{', '.join(flags[::2])} describe" in err and "leave" in err, err
    assert not (tmp_path / "x.svg").exists()


# ---- trace cost flags -----------------------------------------------------------------------


@pytest.mark.parametrize("flag,value", [("--b-cost", "-1"), ("--f-cost", "0"), ("--f-cost", "nan")])
def test_trace_cost_flags_must_be_positive(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["trace", flag, value, "--out", str(tmp_path / "s.svg")])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "s.svg").exists()


# ---- bench comm --json ----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing/x.json", "."])
def test_bench_json_path_is_checked_before_spawning(where, tmp_path, monkeypatch, capsys):
    from paratrain.bench import comm

    def spawn(*args, **kwargs):
        raise AssertionError("spawned before checking --json")

    monkeypatch.setattr(comm, "spawn", spawn)
    argv = ["bench", "comm", "--json", str(tmp_path / where), "--sizes", "1K", "--iters", "1"]
    assert main(argv) == 2
    assert "--json" in capsys.readouterr().err


# ---- data prepare ---------------------------------------------------------------------------


@pytest.fixture
def no_pool(monkeypatch):
    """Fail the test if the worker pool starts."""
    from paratrain.data import prepare as module

    def pool(*args, **kwargs):
        raise AssertionError("the worker pool started before the inputs were checked")

    monkeypatch.setattr(module, "ProcessPoolExecutor", pool)


def test_prepare_refuses_an_unsupported_extension_before_the_pool(tmp_path, no_pool):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.md").write_text("# notes")
    with pytest.raises(DataError, match=r"b\.md: unsupported input \.md"):
        prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.md")], "bytes", str(tmp_path / "ds"),
                workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.md"]


def test_prepare_refuses_a_missing_field_before_the_pool(tmp_path, no_pool):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(DataError, match="'text' field.*--field"):
        prepare([str(tmp_path / "a.jsonl")], "bytes", str(tmp_path / "ds"), workers=1, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def test_prepare_failure_leaves_no_partial_output(tmp_path):
    # The first line passes the quick check; the third fails while tokenizing.
    lines = [{"text": "one"}, {"text": "two"}, {"body": "three"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DataError, match=r"a\.jsonl:3"):
        prepare([str(tmp_path / "a.jsonl")], "bytes", str(tmp_path / "ds"), workers=1, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def test_prepare_workers_negative_exits_2(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello")
    argv = ["data", "prepare", str(tmp_path / "a.txt"), "--tokenizer", "bytes", "--out", str(tmp_path / "ds"),
            "--workers", "-1"]
    assert main(argv) == 2
    assert "--workers -1" in capsys.readouterr().err


def test_prepare_given_a_directory_names_its_files(tmp_path, capsys):
    """It said 'input file(s) not found: text' of a folder that exists."""
    (tmp_path / "text").mkdir()
    argv = ["data", "prepare", str(tmp_path / "text"), "--tokenizer", "bytes", "--out", str(tmp_path / "ds")]
    assert main(argv) == 2
    assert f"{tmp_path / 'text'} is a directory; give its files, e.g. {tmp_path / 'text' / '*.txt'}" in capsys.readouterr().err


def damaged_parquet(path: Path) -> None:
    """A parquet file whose footer (the schema) reads but whose data pages are zeros."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"document {i}" for i in range(1000)]}), path)
    data = path.read_bytes()
    path.write_bytes(data[:4] + bytes(len(data) // 2) + data[4 + len(data) // 2:])


WORDS_TOKENIZER = json.dumps({  # a valid tokenizer.json without </s>
    "version": "1.0", "added_tokens": [dict(id=0, content="<|endoftext|>", special=True, single_word=False,
                                             lstrip=False, rstrip=False, normalized=False)],
    "model": {"type": "WordLevel", "vocab": {"<|endoftext|>": 0, "hello": 1}, "unk_token": "<|endoftext|>"}})
PREPARE_CASES = [  # (id, files written, flags after the input, words the message must hold)
    ("tokenizer-damaged", {"tok.json": '{"model": '}, ["--tokenizer", "{tmp}/tok.json"],
     "--tokenizer"),
    ("parquet-not-parquet", {"a.parquet": "not parquet"}, [], "not a readable parquet file"),
    ("out-is-a-file", {"ds": "x"}, [], "--out {tmp}/ds: a file, not a directory"),
    ("eos-with-bytes", {}, ["--eos", "</s>"], "--eos '</s>': byte-level data"),
    ("input-empty", {"a.txt": ""}, [], "empty (0 bytes)"),
    ("eos-not-a-token", {"tok.json": WORDS_TOKENIZER}, ["--tokenizer", "{tmp}/tok.json", "--eos", "</s>"],
     "--eos '</s>': not a token of {tmp}/tok.json; its special tokens are <|endoftext|>"),
]


@pytest.mark.parametrize("case", PREPARE_CASES, ids=[c[0] for c in PREPARE_CASES])
def test_prepare_bad_input_exits_2_before_the_pool(case, tmp_path, no_pool, capsys):
    """Each ended in a traceback (a damaged tokenizer.json or parquet file, --out naming a
    file), or exited 0: --eos was ignored for bytes, an empty file made an empty dataset."""
    _, files, flags, words = case
    (tmp_path / "a.txt").write_text("hello")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    source = "a.parquet" if "a.parquet" in files else "a.txt"
    if source == "a.parquet":
        pytest.importorskip("pyarrow")
    argv = ["data", "prepare", str(tmp_path / source), "--tokenizer", "bytes",
            "--out", str(tmp_path / "ds"), *[f.format(tmp=tmp_path) for f in flags]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "ds.partial").exists()


def test_prepare_names_damaged_parquet_data_and_inputs_without_text(tmp_path):
    """Parquet pages damaged past a sound footer were a pyarrow traceback mid-run; .jsonl
    files of blank lines or empty texts made a dataset of EOS tokens alone, exit 0."""
    from paratrain.data.prepare import read_documents

    damaged_parquet(tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet: not a readable parquet file"):
        list(read_documents(tmp_path / "d.parquet", "text"))
    (tmp_path / "a.jsonl").write_text('{"text": ""}\n\n{"text": null}\n')
    with pytest.raises(DataError, match=r"no text \(1 document\(s\), all empty\).*--field"):
        prepare([str(tmp_path / "a.jsonl")], "bytes", str(tmp_path / "ds"), workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "d.parquet"]


# ---- data verify -----------------------------------------------------------------------------


def hand_dataset(root: Path, **changes) -> Path:
    """A one-shard dataset of ten tokens, its meta.json edited by ``changes``."""
    import hashlib

    root.mkdir()
    data = bytes(range(20))  # ten uint16 tokens
    (root / "tokens-00000.bin").write_bytes(data)
    shard = {"file": "tokens-00000.bin", "tokens": 10, "sha256": hashlib.sha256(data).hexdigest()}
    meta = {"format": 1, "tokenizer": "bytes", "vocab_size": 256, "eos_id": 0, "dtype": "uint16",
            "documents": 1, "tokens": 10, "train_tokens": 9, "shards": [shard], **changes}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


META_CASES = [  # (id, meta.json changes, words the message must hold)
    ("tokens-text", {"tokens": "10"}, "tokens is '10', expected a whole number"),
    ("vocab-bool", {"vocab_size": True}, "vocab_size is True"),
    ("dtype-float", {"dtype": "float32"}, "dtype is 'float32'"),
    ("shards-object", {"shards": {"file": "x"}}, "shards is {"),
    ("shard-no-sha", {"shards": [{"file": "tokens-00000.bin", "tokens": 10}]},
     "shards[0].sha256 is missing"),
    ("train-past-end", {"train_tokens": 11}, "do not fit the shards' 10 tokens"),
    ("shard-outside", {"shards": [{"file": "../../etc/passwd", "tokens": 10, "sha256": "0"}]},
     "shards[0].file is '../../etc/passwd', expected a file name beside meta.json"),
]


@pytest.mark.parametrize("case", META_CASES, ids=[c[0] for c in META_CASES])
def test_verify_names_a_mistyped_meta_field(case, tmp_path, capsys):
    """A string where a count belongs was a ValueError traceback in the printout, a
    shard without its checksum a KeyError: each is one line naming the field."""
    _, changes, words = case
    assert main(["data", "verify", str(hand_dataset(tmp_path / "ds"))]) == 0
    assert "10 tokens, checksums match" in capsys.readouterr().out
    assert main(["data", "verify", str(hand_dataset(tmp_path / "bad", **changes))]) == 2
    err = capsys.readouterr().err
    assert words in err and "meta.json" in err and len(err.strip().splitlines()) == 1, err


def test_verify_names_the_dataset_argument_not_train_flag(tmp_path, capsys):
    """verify's messages said --data, train's flag, where the user gave a positional."""
    from paratrain.data.dataset import read_meta

    assert main(["data", "verify", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert f"dataset {tmp_path / 'none'}: no meta.json there" in err and "--data" not in err
    with pytest.raises(DataError, match="^--data "):  # train's own check still names its flag
        read_meta(tmp_path / "none")


# ---- a closed stdout --------------------------------------------------------------------------


class ClosedPipe(io.StringIO):
    """stdout whose reader went away (``| head`` after its bytes): every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_ends_quietly_like_sigpipe(monkeypatch, capsys):
    """`paratrain plan --json | head -c 100` ended in a BrokenPipeError traceback."""
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["plan", "--model", "llama3-8b", "--json"]) == 141  # 128 + SIGPIPE, as a shell says
    assert capsys.readouterr().err == ""


# ---- export ---------------------------------------------------------------------------------


def test_export_refuses_a_non_empty_out_directory(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from paratrain.models import hf
    from paratrain.models.gpt import GPT, PRESETS

    cfg = PRESETS["tiny"]
    source = hf.export(GPT(cfg).state_dict(), cfg, tmp_path / "source")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["export", str(source), "--to", "hf", "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == "{}"
    # the refusal comes before any weights are read: a missing source is not even looked at
    assert main(["export", str(tmp_path / "none"), "--to", "hf", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["export", str(source), "--to", "hf", "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"]
    hf.export(GPT(cfg).state_dict(), cfg, out, overwrite=True)  # asked for: replaced
    assert json.loads((out / "config.json").read_text())["architectures"]



def test_export_of_a_run_directory_names_its_newest_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (2, 10):  # newest by number, not by name
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step}" / "meta.json").write_text("{}")
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    assert f"export one of its checkpoints, e.g. {run}/checkpoints/step-10" in capsys.readouterr().err


# ---- benchmarks -------------------------------------------------------------------------------

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(script: str, args: list[str], monkeypatch) -> int:
    """Run a benchmark's ``__main__`` in this process with ``args``; its exit code."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    return exc.value.code


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")
                                          if p.name != "common.py"))
def test_benchmark_counts_are_checked_before_any_process(script, monkeypatch, capsys):
    flag = {"init_and_checkpoint.py": "--rounds", "plan_speed.py": "--rounds", "gpu_compute.py": "--reps",
            "gpu_memory.py": "--micro-batch", "moe_vs_peers.py": "--iters",
            "async_save.py": "--rounds"}.get(script, "--steps")
    assert run_benchmark(script, [flag, "0"], monkeypatch) == 2
    assert f"argument {flag}: must be at least" in capsys.readouterr().err


def test_benchmark_sequence_must_fit_the_model(monkeypatch, capsys):
    assert run_benchmark("zero_vs_peers.py", ["--model", "tiny", "--seq", "256"], monkeypatch) == 2
    assert "--seq 256 is longer than model tiny's max_seq_len 128" in capsys.readouterr().err


BAD_FLAGS = [  # (script, flags, words): each failed in every rank, deep in the model or torch
    ("pp_vs_torch.py", ["--pp", "1"], "argument --pp: must be at least 2"),
    ("pp_vs_torch.py", ["--pp", "2,x"], "argument --pp: expected an integer, got 'x'"),
    ("pp_vs_torch.py", ["--pp", "16"], "--pp 16: 8 layers cannot be split"),
    ("pp_vs_torch.py", ["--seq", "256"], "--seq 256 is longer than the model's max_seq_len 128"),
    ("pp_vs_torch.py", ["--microbatches", "3"], "--batch 8 must be a multiple of --microbatches 3"),
    ("cp_methods.py", ["--seq", "63"], "--seq 63 must be a multiple of 2 x --nproc = 4"),
    ("cp_methods.py", ["--nproc", "3", "--batch", "3", "--seq", "96"], "--nproc 3 must divide"),
    ("cp_methods.py", ["--model", "nope"], "--model: unknown model preset 'nope'"),
    ("domain_parallel.py", ["--nproc", "1"], "argument --nproc: must be at least 2"),
    ("domain_parallel.py", ["--nproc", "2", "3", "--size", "16"], "--size 16 must be a multiple of 4 x --nproc 3"),
    ("domain_parallel.py", ["--width", "2"], "--width 2: width=2: the group norms"),
    ("strong_scaling.py", ["--steps", "2"], "argument --steps: must be at least 3"),
    ("strong_scaling.py", ["--nproc", "3"], "--nproc 3: give 1 or even sizes"),
    ("strong_scaling.py", ["--nproc", "1,2", "--global-batch", "2"], "--nproc 2 with --global-batch 2"),
]


@pytest.mark.parametrize("script,flags,words", BAD_FLAGS,
                         ids=[f"{s[:-3]}{''.join(f)}" for s, f, _ in BAD_FLAGS])
def test_benchmark_flags_the_ranks_would_fail_on_are_refused_first(script, flags, words, monkeypatch, capsys):
    """strong_scaling --steps 2 ended in a StatisticsError after the whole run, --nproc 3 in
    a ConfigError traceback; the others failed in every rank once spawned."""
    from paratrain import launch

    def spawn(*args, **kwargs):
        raise AssertionError("a world was spawned before the flags were checked")

    monkeypatch.setattr(launch, "spawn", spawn)  # the scripts import it when run below
    assert run_benchmark(script, flags, monkeypatch) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after argparse's usage lines
    assert last.startswith(f"{script}: error: ") and words in last, last


# ---- report -----------------------------------------------------------------------------------

def test_report_reads_a_torn_metrics_file_and_checks_out_first(tmp_path, capsys):
    """A killed run tears its last line (docs/runs.md): report drew nothing but a
    JSONDecodeError traceback; --out x.txt was matplotlib's traceback, --out DIR wrote DIR.png."""
    run = tmp_path / "run"
    run.mkdir()
    record = {"loss": 2.0, "tokens_per_s": 1.0, "lr": 1e-3}
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **record}) + "\n" for s in (1, 2))
                                       + '{"step": 3, "lo')
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 line(s)" in captured.err and "(2 steps)" in captured.out
    assert main(["report", str(run / "metrics.jsonl"), "--out", str(tmp_path / "r.svg")]) == 0
    assert (tmp_path / "r.svg").is_file()
    for out, words in ((tmp_path / "x.txt", "name a .png, .svg, .pdf file"),
                       (tmp_path, "name a .png, .svg, .pdf file"),
                       (tmp_path / "none" / "x.png", "does not exist")):
        assert main(["report", str(run), "--out", str(out)]) == 2
        assert words in capsys.readouterr().err, out


def test_trace_and_bench_comm_refuse_what_cannot_run(tmp_path, capsys):
    """trace --pp 100000 --microbatches 100000 ran until killed; bench comm --nproc 100000
    tried to start 100000 processes, and --sizes , ended in StopIteration after spawning."""
    for argv, words in ((["trace", "--pp", "100000", "--microbatches", "100000"], "boxes to draw"),
                        (["trace", "--run", str(tmp_path / "none.json")], "--run"),
                        (["trace", "--out", str(tmp_path / "none" / "x.png")], "does not exist"),
                        (["bench", "comm", "--nproc", "100000"], "more than 64 processes"),
                        (["bench", "comm", "--sizes", "1000000G"], "lower the largest size")):
        assert main(argv) == 2, argv
        assert words in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["bench", "comm", "--sizes", ","])
    assert "give at least one size" in capsys.readouterr().err


def test_a_killed_prepare_leaves_no_workers_and_the_next_one_clears_its_partial(tmp_path):
    """SIGKILL of `data prepare` left its workers running (2.1 GB, a minute later) and a
    .partial that refused every later run until removed by hand."""
    import signal
    import subprocess
    import time

    from helpers import tiny_bpe

    def alive(pid: int) -> bool:  # a zombie (killed, not yet reaped) is not running
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
        except OSError:
            return False

    bpe = tiny_bpe(tmp_path / "bpe.json")
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": f"the cat sat on the mat {i} " * 40}) + "\n"
                           for i in range(60_000)))
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "paratrain", "data", "prepare", str(big), "--tokenizer", str(bpe),
           "--out", str(out), "--workers", "2"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial, deadline, workers = tmp_path / "ds.partial", time.monotonic() + 60, []
    while time.monotonic() < deadline and first.poll() is None:
        children = Path(f"/proc/{first.pid}/task/{first.pid}/children")
        workers = [int(c) for c in children.read_text().split()] if children.exists() else []
        if (partial / ".owner").is_file() and len(workers) >= 2:
            break
        time.sleep(0.02)
    assert first.poll() is None and workers, "prepare finished before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    deadline = time.monotonic() + 20
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(w) for w in workers), f"workers {workers} outlived their prepare"
    assert partial.is_dir()  # what the killed run left
    (tmp_path / "small.txt").write_text("the cat sat\n")
    again = subprocess.run([*cmd[:5], str(tmp_path / "small.txt"), *cmd[6:]], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"removing {partial}, left by an interrupted prepare" in again.stderr, again.stderr
    assert (out / "meta.json").is_file() and not partial.exists()
