"""Calibration data (kbbq_pl.io.data): token blocks from random text, plain text and JSON lines,
their errors, and the calibration data module's batches."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kbbq_pl.io.data import CalibrationDataModule, token_blocks, token_records
from kbbq_pl.io.models import load_model


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm")


def test_token_blocks_random_text_jsonl_and_errors(minilm, tmp_path):
    _, tokenizer = minilm
    a = token_blocks("random", tokenizer, n_tokens=1000, seq_len=128, seed=3)
    b = token_blocks("random", tokenizer, n_tokens=1000, seq_len=128, seed=3)
    assert a.shape == (8, 128) and torch.equal(a, b)
    assert not torch.equal(a, token_blocks("random", tokenizer, n_tokens=1000, seq_len=128, seed=4))
    assert (a[:, 0] == tokenizer.cls_token_id).all() and (a[:, -1] == tokenizer.sep_token_id).all()
    body = a[:, 1:-1]
    assert not torch.isin(body, torch.tensor(tokenizer.all_special_ids)).any()
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog . " * 200)
    blocks = token_blocks(text, tokenizer, n_tokens=256, seq_len=64, seed=0)
    assert blocks.shape == (4, 64) and tokenizer.decode(blocks[0, 1:4]).startswith(
        ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "."))
    lines = tmp_path / "corpus.jsonl"
    lines.write_text("\n".join(json.dumps({"body": f"sentence number {i} ."}) for i in range(300)))
    blocks = token_blocks(lines, tokenizer, n_tokens=128, seq_len=64, text_key="body")
    assert blocks.shape == (2, 64)
    with pytest.raises(ValueError, match="no 'text' field"):
        token_blocks(lines, tokenizer, n_tokens=128, seq_len=64)
    with pytest.raises(ValueError, match="fewer than the"):
        token_blocks(text, tokenizer, n_tokens=10**6, seq_len=64)
    with pytest.raises(FileNotFoundError, match="not a file"):
        token_blocks(tmp_path / "missing.txt", tokenizer, n_tokens=64, seq_len=64)
    assert token_blocks("random", None, n_tokens=64, seq_len=32, vocab_size=50).max() < 50


def test_dataset_files_are_read_by_their_format(minilm, tmp_path):
    """A ``.json`` (an array or JSON lines), ``.parquet``, ``.csv`` or ``.arrow`` file (JSON lines
    and CSV also compressed) is read by datasets' loader of its format: the records and token
    blocks of the same ``.jsonl`` file (before, each was read as plain text: JSON syntax
    calibrated on, parquet undecodable); ``hf:`` takes a sliced split (it was cut at its
    colon)."""
    import gzip

    import datasets
    import pyarrow as pa

    from kbbq_pl.io.data import source_records

    _, tokenizer = minilm
    rows = [{"id": i, "text": f"record {i}, the quick brown fox: \"{i * 7}\" ."} for i in range(90)]
    dataset = datasets.Dataset.from_list(rows)
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps(row) for row in rows))
    (tmp_path / "array.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text(jsonl.read_text())
    dataset.to_parquet(tmp_path / "corpus.parquet")
    dataset.to_csv(tmp_path / "corpus.csv", index=False)
    with gzip.open(tmp_path / "corpus.jsonl.gz", "wt") as compressed:  # as c4's shards
        compressed.write(jsonl.read_text())
    with gzip.open(tmp_path / "corpus.csv.gz", "wb") as compressed:
        dataset.to_csv(compressed, index=False)
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(tmp_path / "corpus.arrow", table.schema) as writer:
        writer.write_table(table)

    expected = source_records(jsonl)
    assert expected.texts == [row["text"] for row in rows]
    blocks = token_blocks(jsonl, tokenizer, n_tokens=512, seq_len=64, seed=1)
    for name in ("array.json", "lines.json", "corpus.parquet", "corpus.csv", "corpus.arrow",
                 "corpus.jsonl.gz", "corpus.csv.gz"):
        assert source_records(tmp_path / name) == expected, name
        assert torch.equal(token_blocks(str(tmp_path / name), tokenizer, n_tokens=512,
                                        seq_len=64, seed=1), blocks), name
    # hf:<path>[:<config>][:<split>], the split sliced as datasets reads it (a local folder
    # of data files stands for a Hub dataset here)
    folder = tmp_path / "dataset"
    folder.mkdir()
    dataset.to_parquet(folder / "train.parquet")
    assert source_records(f"hf:{folder}") == expected
    assert source_records(f"hf:{folder}::train[10:20]").texts == expected.texts[10:20]


def test_a_streamed_hf_source_reads_only_its_first_records(minilm, tmp_path):
    """``CalibrationDataModule(streaming=True)`` reads an ``hf:`` source as datasets' stream:
    its first records until the token budget's characters, its slice as records skipped and
    taken; the split's later files are never read (a folder of two shards, the second not
    JSON, stands for a Hub dataset too large to download: without streaming the whole split is
    read first, and fails on it).  A slice a stream cannot cut, and streaming a source that is
    no ``hf:`` dataset, are refused."""
    import datasets

    from kbbq_pl.io.data import CHARS_PER_TOKEN, hf_dataset, source_records

    _, tokenizer = minilm
    texts = [f"record {i}: the quick brown fox jumps over the lazy dog ." for i in range(3000)]
    folder = tmp_path / "c4"
    folder.mkdir()
    (folder / "train-00000.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    (folder / "train-00001.jsonl").write_text("this shard is not read\n")
    with pytest.raises(ValueError, match=r"text source 'hf:.*c4': datasets could not read its "
                                         r"split 'train' \(ArrowInvalid: JSON"):
        source_records(f"hf:{folder}")

    budget = CHARS_PER_TOKEN * 64
    stream = hf_dataset(f"hf:{folder}", streaming=True)
    assert isinstance(stream, datasets.IterableDataset)
    first = source_records(stream, max_chars=budget)
    count = len(first.texts)
    assert first.texts == texts[:count] and count < len(texts) / 4
    assert sum(map(len, texts[:count - 1])) < budget <= sum(map(len, texts[:count]))
    module = CalibrationDataModule(f"hf:{folder}", tokenizer, n_tokens=64, seq_len=32,
                                   streaming=True, packing=True)
    assert module.read is None
    batches = list(module.calibration_dataloader())
    assert torch.equal(torch.cat([batch["input_ids"] for batch in batches]),
                       token_blocks(texts[:count], tokenizer, n_tokens=64, seq_len=32))
    assert module.read == f"the first {count} records of a stream"

    # a slice is records skipped and taken (datasets' take may open the next shard: one shard)
    sliced = tmp_path / "sliced"
    sliced.mkdir()
    (sliced / "train.jsonl").write_text((folder / "train-00000.jsonl").read_text())
    assert [row["text"] for row in hf_dataset(f"hf:{sliced}::train[100:103]", streaming=True)] \
        == texts[100:103]
    assert [row["text"] for row in hf_dataset(f"hf:{sliced}::train[:2]", streaming=True)] \
        == texts[:2]
    whole = CalibrationDataModule(f"hf:{sliced}::train[:40]", tokenizer, n_tokens=64,
                                  seq_len=32, streaming=True, packing=False)
    records = [tokenizer.decode(batch["input_ids"][0], skip_special_tokens=True)
               for batch in whole.calibration_dataloader()]
    assert records and all(int(text.split()[1].rstrip(":")) < 40 for text in records)

    with pytest.raises(ValueError, match=r"a streamed split is sliced by records from the "
                                         r"start, as 'train\[:2048\]' .* not 'train\[:10%\]'"):
        hf_dataset(f"hf:{folder}::train[:10%]", streaming=True)
    with pytest.raises(ValueError, match="streaming reads an 'hf:<dataset>' source from the "
                                         "Hub; source 'mixed' is read as it is"):
        CalibrationDataModule("mixed", streaming=True)


def test_data_files_without_a_record_or_not_read_as_data(tmp_path):
    """An empty field (null, a blank CSV cell, "") is no record, as a text file's blank line
    (it was calibrated on as the text "None"); a folder, a DatasetDict, a file that is not
    UTF-8 text and a missing column are one line each."""
    import gzip

    import datasets

    from kbbq_pl.io.data import source_records

    (tmp_path / "gaps.csv").write_text("id,text\n1,first\n2,\n3,third\n")
    (tmp_path / "gaps.jsonl").write_text("\n".join(json.dumps({"text": value}) for value in (
        "first", None, "", "  ", "third")))
    for name in ("gaps.csv", "gaps.jsonl"):
        assert source_records(tmp_path / name).texts == ["first", "third"], name
    dataset = datasets.Dataset.from_list([{"id": 1, "text": "first"}])
    dataset.to_parquet(tmp_path / "corpus.parquet")
    with pytest.raises(FileNotFoundError, match=r"'.*' is a folder: 'hf:.*' reads its data "):
        source_records(tmp_path)
    with pytest.raises(ValueError, match=r"a DatasetDict of the splits \['train'\]: pass one "
                                         r"split, e.g. dataset\['train'\]"):
        source_records(datasets.DatasetDict(train=dataset))
    with gzip.open(tmp_path / "corpus.txt.gz", "wt") as compressed:
        compressed.write("a plain text, compressed")
    with pytest.raises(ValueError, match=r"'.*corpus.txt.gz' is not UTF-8 text \(byte 1\); a "
                                         r"data file is read by its extension: .jsonl, .json"):
        source_records(tmp_path / "corpus.txt.gz")
    with pytest.raises(ValueError, match=r"text source '.*corpus.parquet' has no 'body' "
                                         r"column \(columns: \['id', 'text'\]\)"):
        source_records(tmp_path / "corpus.parquet", "body")
    (tmp_path / "header.csv").write_text("text\n")
    with pytest.raises(ValueError, match=r"text source .*header.csv cannot be read as csv"):
        source_records(tmp_path / "header.csv")


def test_a_python_list_of_records(minilm, tmp_path):
    """A list of texts, or of dicts holding ``text_key``, is a source of those records, as the
    same ``.jsonl`` file; an error names the list by its size, not by its records."""
    from kbbq_pl.io.data import source_records

    _, tokenizer = minilm
    texts = [f"record {i}: the quick brown fox jumps over the lazy dog ." for i in range(90)]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": text}) for text in texts))
    expected = source_records(jsonl, "body")
    assert source_records(texts) == source_records([{"body": t} for t in texts], "body") == \
        expected
    blocks = token_blocks(jsonl, tokenizer, n_tokens=512, seq_len=64, seed=1, text_key="body")
    assert torch.equal(token_blocks(texts, tokenizer, n_tokens=512, seq_len=64, seed=1), blocks)
    module = CalibrationDataModule(texts, tokenizer, n_tokens=512, seq_len=64, seed=1)
    assert torch.equal(torch.cat([b["input_ids"] for b in module.calibration_dataloader()]),
                       blocks)
    with pytest.raises(ValueError, match=r"^calibration source a list of 90 records has \d+ "
                                         r"tokens: \d+ blocks"):
        token_blocks(texts, tokenizer, n_tokens=10**6, seq_len=64)
    with pytest.raises(ValueError, match=r"text record 1: no 'text' field \(fields: "
                                         r"\['body'\]\); pass text_key="):
        source_records([{"text": "a"}, {"body": "b"}])
    with pytest.raises(TypeError, match=r"text source an int: pass a file, 'mixed', "):
        source_records(4)


def test_datamodule_batches(minilm):
    _, tokenizer = minilm
    dm = CalibrationDataModule("random", tokenizer, n_tokens=512, seq_len=64, batch_size=3)
    batches = list(dm.calibration_dataloader())
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 2]
    assert all((b["attention_mask"] == 1).all() for b in batches)


def test_a_bad_source_or_size_is_refused_when_the_data_is_declared(tmp_path):
    """Before any model is loaded or any work is done (the commands build the data module
    first), not when the first batch is read."""
    with pytest.raises(FileNotFoundError, match="nofile.txt' is not a file, 'mixed'"):
        CalibrationDataModule(str(tmp_path / "nofile.txt"))
    with pytest.raises(FileNotFoundError, match="is a folder: 'hf:"):
        CalibrationDataModule(tmp_path)
    with pytest.raises(ValueError, match="batch_size >= 1, got 4096, 256 and 0"):
        CalibrationDataModule(batch_size=0)
    for source in ("mixed", "random", "hf:no/such-dataset"):  # the Hub is read at setup
        assert CalibrationDataModule(source).source == source


def test_whole_records_unpacked_and_grouped_by_length(minilm, tmp_path):
    """``packing=False``: each line is its own sequence ([CLS] ... [SEP], cut at ``seq_len``),
    a seeded draw until the budget; lines of one length share a batch, nothing is padded."""
    _, tokenizer = minilm
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    lines = [" ".join(words[: 1 + i % 8]) + f" line {i}" for i in range(60)]
    lines[7] = " ".join(["word"] * 100)  # longer than seq_len: cut, not dropped
    source = tmp_path / "sentences.txt"
    source.write_text("\n".join(lines) + "\n\n")
    dm = CalibrationDataModule(source, tokenizer, n_tokens=200, seq_len=32, batch_size=2,
                               seed=1, packing=False)
    batches = list(dm.calibration_dataloader())
    again = list(CalibrationDataModule(source, tokenizer, n_tokens=200, seq_len=32,
                                       batch_size=2, seed=1,
                                       packing=False).calibration_dataloader())
    assert [b["input_ids"].tolist() for b in batches] == [b["input_ids"].tolist() for b in again]
    rows = [row for b in batches for row in b["input_ids"]]
    drawn = token_records(source, tokenizer, n_tokens=200, max_len=32, seed=1)
    assert sorted(map(tuple, rows)) == sorted(tuple(r.tolist()) for r in drawn)
    assert sum(map(len, drawn)) >= 200 > sum(map(len, drawn[:-1]))  # stops at the budget
    assert all(len(b["input_ids"]) <= 2 and (b["attention_mask"] == 1).all() for b in batches)
    assert [b["input_ids"].shape[1] for b in batches] == sorted(
        b["input_ids"].shape[1] for b in batches)
    decoded = {tokenizer.decode(row[1:-1]) for row in rows}
    assert all(row[0] == tokenizer.cls_token_id and row[-1] == tokenizer.sep_token_id
               and len(row) <= 32 for row in rows)
    assert decoded <= {line.lower() for line in lines} | {" ".join(["word"] * 30)}
    other = CalibrationDataModule(source, tokenizer, n_tokens=200, seq_len=32, batch_size=2,
                                  seed=2, packing=False).calibration_dataloader()
    assert decoded != {tokenizer.decode(row[1:-1]) for b in other for row in b["input_ids"]}
    with pytest.raises(ValueError, match="fewer than n_tokens=100000"):
        CalibrationDataModule(source, tokenizer, n_tokens=100000, packing=False).setup()
    with pytest.raises(ValueError, match="whole records needs text"):
        CalibrationDataModule("random", tokenizer, packing=False).setup()


def test_packing_follows_the_model_unless_set(minilm):
    """``packing=None`` (the default): whole records for an encoder, packed blocks for a causal
    LM, and for an encoder without text to read; an explicit setting is kept."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    encoder, tokenizer = minilm
    causal = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2))

    def settled(model, **overrides):
        settings = {"source": "mixed", "tokenizer": tokenizer, "n_tokens": 300, "seq_len": 64,
                    **overrides}
        return CalibrationDataModule(**settings).for_model(model)

    assert CalibrationDataModule().packing is None and CalibrationDataModule().packs
    records = settled(encoder)
    assert records.packing is False and not records.packs
    shapes = {b["input_ids"].shape[1] for b in records.calibration_dataloader()}
    assert len(shapes) > 1 and max(shapes) <= 64  # whole records of their own lengths
    blocks = settled(causal)
    assert blocks.packing is True
    assert {b["input_ids"].shape[1] for b in blocks.calibration_dataloader()} == {64}
    assert settled(encoder, packing=True).packing is True
    assert settled(causal, packing=False).packing is False
    assert settled(encoder, source="random").packing is True
    # no tokenizer given: the one saved with the model reads the text; a model with none packs
    own = settled(encoder, tokenizer=None)
    assert own.packing is False and own.tokenizer.name_or_path == encoder.name_or_path
    unsaved = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32))
    assert settled(unsaved, tokenizer=None).packing is True


def _chats(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"what is {i} plus {i} ?"},
             {"role": "assistant", "content": f"{i} plus {i} is {2 * i} ."}]
            for i in range(count)]


def test_conversations_are_rendered_by_the_chat_template(minilm, tmp_path):
    """A field holding a conversation (ultrachat's ``messages``) is calibrated on as the
    tokenizer's chat template renders it, in a jsonl file and in a dataset, packed or whole;
    whole records take no second framing (the template's own special tokens frame them)."""

    import datasets

    from kbbq_pl.io.data import source_records

    _, plain = minilm
    tokenizer = copy.deepcopy(plain)
    tokenizer.chat_template = ("{% for m in messages %}[CLS] {{ m['role'] }} : "
                               "{{ m['content'] }} [SEP]{% endfor %}")
    chats = _chats(200)
    lines = tmp_path / "chats.jsonl"
    lines.write_text("\n".join(json.dumps({"messages": chat, "id": i})
                               for i, chat in enumerate(chats)))
    rendered = [tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
    assert rendered[3] == ("[CLS] user : what is 3 plus 3 ? [SEP]"
                           "[CLS] assistant : 3 plus 3 is 6 . [SEP]")
    records = source_records(lines, "messages", tokenizer)
    assert records.texts == rendered and all(records.templated)
    from_dataset = source_records(datasets.Dataset.from_list([{"messages": c} for c in chats]),
                                  "messages", tokenizer)
    assert from_dataset == records

    blocks = token_blocks(lines, tokenizer, n_tokens=512, seq_len=64, text_key="messages")
    stream = tokenizer("\n".join(rendered), add_special_tokens=False)["input_ids"]
    body = torch.tensor(stream[: len(stream) // 62 * 62]).reshape(-1, 62)
    assert all(any(torch.equal(row[1:-1], window) for window in body) for row in blocks)
    assert (blocks == tokenizer.cls_token_id).sum() > len(blocks)  # the template's tokens too

    whole = token_records(lines, tokenizer, n_tokens=300, max_len=64, text_key="messages")
    for ids in whole:
        text = tokenizer.decode(ids)
        assert text.startswith("[CLS] user :") and text.count("[CLS]") == 2, text
        assert ids[0] == tokenizer.cls_token_id and ids[1] != tokenizer.cls_token_id

    with pytest.raises(ValueError, match=r"record 0: a conversation, but tokenizer .* no chat "
                                         r"template"):
        token_blocks(lines, plain, n_tokens=128, seq_len=64, text_key="messages")
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": ["a", "b"]}))
    with pytest.raises(ValueError, match="record 1: the field is a list, neither text nor a "
                                         "conversation"):
        token_records(odd, tokenizer, n_tokens=64, max_len=32)


def test_a_large_source_is_read_in_part(minilm, tmp_path, monkeypatch):
    """A source holding more than ``CHARS_PER_TOKEN`` characters a calibration token is read
    in part, a seeded draw of its records in the source's order, the same from a text file, a
    jsonl file, a list and a dataset, and only the drawn conversations are rendered (a 230 MB
    jsonl was tokenized whole to take 16,384 tokens: 131 s and 16.7 GB); a streaming dataset
    is read until it holds as much (it was read to its end, which an endless one has not); a
    smaller source is read whole, as before."""
    import datasets

    from kbbq_pl.io import data
    from kbbq_pl.io.data import CHARS_PER_TOKEN, source_records

    _, tokenizer = minilm
    texts = [f"record {i}: the quick brown fox jumps over the lazy dog ." for i in range(2000)]
    size = sum(map(len, texts))
    assert CHARS_PER_TOKEN * 64 < size / 4  # 64 tokens need a quarter of the source at most
    (tmp_path / "corpus.txt").write_text("\n".join(texts) + "\n")
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": text}) for text in texts))
    sources = [tmp_path / "corpus.txt", jsonl, texts, datasets.Dataset.from_list(
        [{"text": text} for text in texts])]

    drawn = source_records(jsonl, max_chars=CHARS_PER_TOKEN * 64, seed=1)
    chars = sum(map(len, drawn.texts))
    assert CHARS_PER_TOKEN * 64 <= chars < CHARS_PER_TOKEN * 64 + len(texts[-1])
    indices = [texts.index(text) for text in drawn.texts]
    assert indices == sorted(indices) and indices[-1] > len(texts) / 2  # drawn, in order
    assert drawn.stream == "\n".join(drawn.texts)
    assert drawn.read == f"{len(drawn.texts)} of 2,000 records, a seeded draw (seed 1)"
    assert source_records(jsonl, max_chars=CHARS_PER_TOKEN * 64, seed=2).texts != drawn.texts
    blocks = token_blocks(jsonl, tokenizer, n_tokens=64, seq_len=32, seed=1)
    for source in sources:
        assert source_records(source, max_chars=CHARS_PER_TOKEN * 64, seed=1) == drawn, source
        assert torch.equal(token_blocks(source, tokenizer, n_tokens=64, seq_len=32, seed=1),
                           blocks), source
    records = token_records(jsonl, tokenizer, n_tokens=64, max_len=32, seed=1)
    assert {tokenizer.decode(ids[1:-1]) for ids in records} <= {
        tokenizer.decode(tokenizer(text)["input_ids"][1:-1]) for text in drawn.texts}
    # a source of no more than the budget is read whole: the text file as it stands
    assert source_records(sources[0], max_chars=size + len(texts)) == source_records(sources[0])
    assert source_records(sources[0]).stream.endswith("dog .\n")
    assert source_records(sources[0]).read == "all 2,000 records"

    rendered = []
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    render = chat_tokenizer.apply_chat_template
    monkeypatch.setattr(chat_tokenizer, "apply_chat_template",
                        lambda chat, **kw: rendered.append(chat) or render(chat, **kw))
    chats = [[{"role": "user", "content": text}] for text in texts]
    chat_records = source_records(chats, tokenizer=chat_tokenizer,
                                  max_chars=CHARS_PER_TOKEN * 64, seed=1)
    assert len(rendered) == len(chat_records.texts) == len(drawn.texts)

    def endless():
        for i in range(10**6):
            if i == 5000:
                raise AssertionError("read past what calibration needs")
            yield {"text": f"streamed record {i}: the quick brown fox jumps over the lazy dog ."}

    stream = datasets.IterableDataset.from_generator(endless)
    blocks = token_blocks(stream, tokenizer, n_tokens=64, seq_len=32)
    assert blocks.shape == (2, 32)
    first = source_records(stream, max_chars=CHARS_PER_TOKEN * 64)
    assert first.texts[0].startswith("streamed record 0:") and \
        sum(map(len, first.texts[:-1])) < CHARS_PER_TOKEN * 64 <= sum(map(len, first.texts))
    assert first.read == f"the first {len(first.texts)} records of a stream"
    short = datasets.IterableDataset.from_generator(lambda: ({"text": t} for t in texts[:5]))
    assert source_records(short, max_chars=CHARS_PER_TOKEN * 64).read == \
        "all 5 records of a stream"
    monkeypatch.setattr(data, "CHARS_PER_TOKEN", 10**9)  # a budget this stream cannot fill
    with pytest.raises(AssertionError, match="read past"):
        token_blocks(stream, tokenizer, n_tokens=64, seq_len=32)
