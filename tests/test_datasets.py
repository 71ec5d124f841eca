"""Tokenized datasets: `paratrain data prepare` from text, JSON lines and parquet with a
tokenizer trained here (and with bytes), training on them at dp2 with exact resume, and a
sampler whose per-step cost does not grow with the dataset."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from distributed import run_world
from paratrain.data.dataset import load_split, read_meta, verify
from paratrain.data.prepare import DataError, prepare
from paratrain.train.data import PAD, DistributedSampler

DOCS = [f"Document {i}: the quick brown fox jumps over the lazy dog {i % 7} times. " * (1 + i % 5)
        for i in range(120)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    (root / "a.txt").write_text(DOCS[0])
    with open(root / "b.jsonl", "w") as f:
        for doc in DOCS[1:60]:
            f.write(json.dumps({"body": doc}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS[60:]}), root / "c.parquet")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer.json"))
    return root, [str(root / n) for n in ("a.txt", "b.jsonl", "c.parquet")]


def expected_stream(tokenizer, eos: int) -> list[int]:
    out = []
    for doc in DOCS:
        out += (list(doc.encode()) if tokenizer is None else tokenizer.encode(doc).ids) + [eos]
    return out


def test_prepare_with_a_trained_tokenizer_and_with_bytes(inputs, tmp_path):
    from tokenizers import Tokenizer

    root, files = inputs
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    meta = prepare(files, str(root), str(tmp_path / "bpe"), field="body", val_fraction=0.1,
                   workers=2, shard_tokens=1000, progress=False)  # the directory holds tokenizer.json
    want = expected_stream(tok, eos)
    train, val, m = load_split(tmp_path / "bpe")
    assert meta["documents"] == len(DOCS) and meta["tokens"] == len(want) and meta["dtype"] == "uint16"
    assert len(meta["shards"]) == -(-len(want) // 1000)  # shards cut at 1000 tokens
    assert np.asarray(train[:]).tolist() + np.asarray(val[:]).tolist() == want
    assert len(train) == int(len(want) * 0.9) == m.train_tokens
    verify(tmp_path / "bpe")

    meta = prepare(files, "bytes", str(tmp_path / "bytes"), field="body", workers=1, progress=False)
    train, val, m = load_split(tmp_path / "bytes")
    assert m.vocab_size == 256 and np.asarray(train[:]).tolist() + np.asarray(val[:]).tolist() \
        == expected_stream(None, 0)


def test_prepare_names_the_train_command_for_its_tokenizer(inputs, tmp_path, capsys):
    """A Hugging Face model directory's tokenizer: train that model (``--model DIR``, which
    refuses --vocab-size); any other tokenizer: a preset sized to its vocabulary."""
    from paratrain.cli import main

    root, files = inputs
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((root / "tokenizer.json").read_bytes())
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    for tokenizer, want in ((model, f"paratrain train --model {model} --data {tmp_path / 'a'}\n"),
                            (root, f"paratrain train --data {tmp_path / 'b'} --vocab-size 300\n")):
        out = tmp_path / ("a" if tokenizer == model else "b")
        assert main(["data", "prepare", files[0], "--tokenizer", str(tokenizer), "--out", str(out),
                     "--workers", "1"]) == 0
        assert capsys.readouterr().out.endswith("train on it   " + want)


def test_corrupt_and_bad_inputs_are_named(inputs, tmp_path):
    root, files = inputs
    prepare(files[:1], "bytes", str(tmp_path / "ds"), progress=False, workers=1)
    shard = next((tmp_path / "ds").glob("tokens-*.bin"))
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum mismatch"):
        verify(tmp_path / "ds")
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="expected .* bytes"):
        read_meta(tmp_path / "ds")
    for args, match in [((files[1:2], "bytes", str(tmp_path / "x")), "'text' field"),
                        (([str(root / "tokenizer.json")], "bytes", str(tmp_path / "y")), "unsupported input"),
                        ((files[:1], str(tmp_path / "nope.json"), str(tmp_path / "z")), "nothing is downloaded"),
                        ((files[:1], "bytes", str(tmp_path / "ds")), "not empty")]:
        with pytest.raises(DataError, match=match):
            prepare(*args, progress=False, workers=1)


def train_and_resume(configs):
    """An uninterrupted run that checkpoints at step 3, then a run resumed from there."""
    from paratrain.mesh import Mesh
    from paratrain.train.loop import train

    full, resumed = configs
    whole = train(full, Mesh.build(full.layout))
    resumed = resumed.validate()  # the checkpoint exists only now
    rest = train(resumed, Mesh.build(resumed.layout))
    return whole.losses, rest.losses


def test_train_on_a_dataset_at_dp2_and_resume_exactly(inputs, tmp_path):
    from paratrain.train.config import load

    root, files = inputs
    prepare(files, str(root), str(tmp_path / "ds"), field="body", workers=2, progress=False)
    base = dict(preset="tiny", vocab_size=300, data=str(tmp_path / "ds"), seq_len=32, global_batch=8,
                steps=6, warmup_steps=1, eval_every=0, eval_batches=1, progress=False, nproc=2)
    full = load(None, {**base, "run_dir": str(tmp_path / "a"), "save_every": 3}).validate()
    resumed = load(None, {**base, "run_dir": str(tmp_path / "b"),
                          "resume": str(tmp_path / "a" / "checkpoints" / "step-3")})
    whole, rest = run_world(train_and_resume, 2, (full, resumed))[0]
    assert whole[-1] < whole[0]
    assert rest == pytest.approx(whole[3:], rel=1e-6)


def test_sampler_work_per_step_does_not_grow_with_the_dataset():
    """O(1) work per sample, held by what a step allocates (numpy reports its buffers to
    tracemalloc), not by its time: a bound on time fails on a slower machine. A sampler
    that permuted all n samples would allocate 80 MB at n = 10^7."""
    import tracemalloc

    def per_step(n: int) -> int:
        sampler = DistributedSampler(n, global_batch=256, dp_rank=0, dp_size=2, seed=3)
        peaks = []
        for step in range(0, 400, 7):
            tracemalloc.start()
            sampler.local_indices(step)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        return max(peaks)

    small, large = per_step(10_000), per_step(10_000_000)
    assert large <= 2 * small + 2**16, (small, large)


def test_every_sample_once_per_epoch_across_ranks():
    n, batch = 1003, 40
    ranks = [DistributedSampler(n, batch, dp_rank=r, dp_size=4, seed=1, remainder="pad") for r in range(4)]
    for epoch in range(2):
        seen = [i for step in range(epoch * ranks[0].steps_per_epoch, (epoch + 1) * ranks[0].steps_per_epoch)
                for s in ranks for i in s.local_indices(step) if i >= 0]
        assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_an_epoch_boundary_where_the_samples_divide_the_global_batch(remainder):
    """A blind spot of the suite: n a multiple of the global batch. No step is padding, the
    epoch ends exactly at n / batch steps, each epoch reads every sample once, and the next
    epoch is another order (an off-by-one gave an all-PAD step, or repeated the epoch)."""
    n, batch = 1000, 40
    ranks = [DistributedSampler(n, batch, dp_rank=r, dp_size=2, seed=3, remainder=remainder) for r in range(2)]
    assert ranks[0].steps_per_epoch == n // batch and ranks[0].dropped_per_epoch == 0
    orders = []
    for epoch in range(3):
        steps = range(epoch * (n // batch), (epoch + 1) * (n // batch))
        seen = [i for step in steps for s in ranks for i in s.local_indices(step)]
        assert PAD not in seen and sorted(seen) == list(range(n)), epoch
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]


def test_a_dataset_beyond_the_models_vocabulary_is_refused_before_launch(inputs, tmp_path):
    from paratrain.train import preflight
    from paratrain.train.config import ConfigError, load

    root, files = inputs
    prepare(files, str(root), str(tmp_path / "ds"), field="body", workers=1, progress=False)
    cfg = load(None, {"preset": "tiny", "data": str(tmp_path / "ds"), "seq_len": 32,
                      "global_batch": 8, "nproc": 1}).validate()  # tiny has 256 tokens, the BPE 300
    with pytest.raises(ConfigError, match="model.vocab_size.*--vocab-size 300"):
        preflight.check_data(cfg)
    preflight.check_data(load(None, {"preset": "tiny", "vocab_size": 300, "data": str(tmp_path / "ds"),
                                     "seq_len": 32, "global_batch": 8, "nproc": 1}).validate())


def test_a_dataset_one_batch_short_is_refused_before_launch(tmp_path):
    """T tokens make (T - 1) // seq_len samples (each needs its next token as a target), so
    a dataset of exactly 2 x seq_len tokens holds one sample, not two; padding needs one."""
    from paratrain.train import preflight
    from paratrain.train.config import ConfigError, load

    text = tmp_path / "doc.txt"
    for length in (300, 301):  # one of them gives an even token count
        shutil.rmtree(tmp_path / "ds", ignore_errors=True)
        text.write_text("x" * length)
        prepare([str(text)], "bytes", str(tmp_path / "ds"), val_fraction=0.0, workers=1,
                progress=False)
        tokens = read_meta(tmp_path / "ds").train_tokens
        if tokens % 2 == 0:
            break
    base = {"preset": "tiny", "data": str(tmp_path / "ds"), "seq_len": tokens // 2,
            "max_seq_len": tokens, "global_batch": 2, "nproc": 1}
    with pytest.raises(ConfigError, match="make 1 samples .* fewer than one global batch of 2"):
        preflight.check_data(load(None, base).validate())
    preflight.check_data(load(None, {**base, "remainder": "pad"}).validate())


def test_documents_that_are_not_text_are_named_by_line(tmp_path):
    """A null text is skipped (as a parquet null is); a number or a list (a tokenizer would
    read it as a sentence pair), a file that is not UTF-8 and a non-text parquet column are
    refused, naming the line or column, before the worker pool tokenizes anything."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "one"}\n{"text": null}\n{"text": "two"}\n')
    meta = prepare([str(good)], "bytes", str(tmp_path / "ok"), val_fraction=0.0, workers=1,
                   progress=False)
    assert (meta["documents"], meta["tokens"]) == (2, 8)  # 'one' and 'two', each with EOS
    cases = {"number.jsonl": ('{"text": "one"}\n{"text": 123}\n', r"number.jsonl:2: the 'text' field is int"),
             "pair.jsonl": ('{"text": ["a", "b"]}\n', r"pair.jsonl:1: the 'text' field is list"),
             "latin1.jsonl": ('{"text": "caf\xe9"}\n'.encode("latin-1"), "not UTF-8")}
    for name, (content, match) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(DataError, match=match):
            prepare([str(path)], "bytes", str(tmp_path / f"out-{name}"), workers=1, progress=False)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    with pytest.raises(DataError, match="column 'text' holds int64, not text"):
        prepare([str(tmp_path / "ints.parquet")], "bytes", str(tmp_path / "p"), workers=1, progress=False)


def test_a_dataset_whose_validation_split_holds_no_sample_is_refused(tmp_path):
    """As a corpus is: a run would otherwise end with no validation loss, silently."""
    from paratrain.train import preflight
    from paratrain.train.config import ConfigError, load

    text = tmp_path / "doc.txt"
    text.write_text("word " * 2000)
    for fraction in (0.004, 0.0):  # 40 validation tokens, then none (no split: fine)
        shutil.rmtree(tmp_path / "ds", ignore_errors=True)
        prepare([str(text)], "bytes", str(tmp_path / "ds"), val_fraction=fraction, workers=1,
                progress=False)
        cfg = load(None, {"preset": "tiny", "data": str(tmp_path / "ds"), "seq_len": 64,
                          "global_batch": 8, "nproc": 1}).validate()
        if fraction:
            with pytest.raises(ConfigError, match=r"validation split \(\d+ tokens\) holds no sample"):
                preflight.check_data(cfg)
        else:
            preflight.check_data(cfg)


def test_text_given_as_data_is_named_as_the_input_of_prepare(tmp_path):
    """`train --data notes.txt` (or a folder of .txt) suggested `data prepare ... --out
    notes.txt`, which prepare refuses (--out exists): the text is prepare's input."""
    (tmp_path / "notes.txt").write_text("some text\n")
    with pytest.raises(DataError, match=r"notes\.txt: a file, not a dataset directory; .*"
                                        r"`paratrain data prepare \S+notes\.txt --tokenizer T --out DATA`"):
        read_meta(tmp_path / "notes.txt")
    with pytest.raises(DataError, match=r"no meta\.json there, so not a dataset; .*--out DATA`"):
        read_meta(tmp_path)
    with pytest.raises(DataError, match=r"--out \S+new`$"):  # not there yet: prepare makes it
        read_meta(tmp_path / "new")


def test_a_dataset_prepared_again_at_the_same_path_is_named_on_resume(tmp_path):
    """The checkpoint recorded the dataset's path only: prepared again from other text, a
    resume went on at a position that means nothing in the new data, silently."""
    from paratrain.train.config import load
    from paratrain.train.runs import data_changes

    def prepared(text: str) -> str:
        source = tmp_path / "text.txt"
        source.write_text(text * 400)
        shutil.rmtree(tmp_path / "ds", ignore_errors=True)
        prepare([str(source)], "bytes", str(tmp_path / "ds"), progress=False, workers=1)
        return str(tmp_path / "ds")

    cfg = load(None, dict(preset="tiny", data=prepared("the cat sat on the mat\n"), seq_len=16,
                          run_dir=str(tmp_path / "run"))).validate()
    meta = {"data": {**cfg.data_order(), "step": 4, "samples_seen": 64}}
    assert data_changes(meta, cfg) == []
    prepared("a dog ran in the park\n")  # the same path, other content
    notes = data_changes(meta, cfg)
    assert len(notes) == 1 and f"the dataset at {tmp_path / 'ds'} holds other data" in notes[0], notes
    assert "64 samples" in notes[0] and "prepare it again from the same text" in notes[0]


def test_a_long_document_is_tokenized_in_pieces_with_the_whole_documents_tokens(tmp_path, monkeypatch):
    """One 20 MB line held 4.2 GB in the tokenizer; long documents are now encoded in
    pieces, cut where a byte-level BPE pre-tokenizes anyway, so the tokens are the same
    and the document still ends with one end-of-document token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from paratrain.data import prepare as P

    lines = "".join(f"the cat sat  on the mat {i}\n" for i in range(300))
    one_line = " ".join(["the  mat sat"] * 700)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))  # GPT-2's byte-level pre-tokenizer, with merges
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([lines, one_line], trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe = tmp_path / "bpe.json"
    tok.save(str(bpe))
    assert "Ġmat" in tok.encode(one_line).tokens  # merges across the spaces the cuts respect
    for doc in (lines, one_line):
        cut = list(P.pieces(doc, 500))
        assert len(cut) > 5 and max(map(len, cut)) <= 500 and "".join(cut) == doc
        assert [t for piece in cut for t in tok.encode(piece).ids] == tok.encode(doc).ids
    monkeypatch.setattr(P, "PIECE_CHARS", 500)
    monkeypatch.setattr(P, "BATCH_CHARS", 2000)
    (tmp_path / "doc.txt").write_text(lines)
    meta = prepare([str(tmp_path / "doc.txt")], str(bpe), str(tmp_path / "ds"), progress=False,
                   workers=1, val_fraction=0.0)
    stored = np.fromfile(tmp_path / "ds" / meta["shards"][0]["file"], dtype=meta["dtype"])
    assert meta["documents"] == 1
    assert stored.tolist() == tok.encode(lines).ids + [meta["eos_id"]]
