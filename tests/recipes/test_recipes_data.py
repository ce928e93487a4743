"""Data inputs of SFT, evaluate and GRPO: one reader for every format, wrong records
named by file, line and field, and a packed dataset that remembers its tokenizer."""

import json

import datasets
import pytest

from nopad.dataloaders import sources
from nopad.recipes.config import load_config
from nopad.recipes.sft_config import SFTRecipeConfig as SFTConfig
from nopad.recipes.tasks import load_examples
from nopad.recipes.tiny_model import AsciiTokenizer
from nopad.training.sft_data import load_rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "csv", "saved"])
def test_sft_and_evaluate_read_every_format(tmp_path, fmt):
    import gzip

    rows = [{"prompt": "1 + 1 =", "completion": " 2"}, {"prompt": "2 + 2 =", "completion": " 4"}]
    path = tmp_path / f"d.{fmt}"
    ds = datasets.Dataset.from_list(rows)
    if fmt == "jsonl":
        _write(path, rows)
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    else:
        datasets.DatasetDict(train=ds).save_to_disk(str(path))
    data = load_config(SFTConfig, None, [f"data.source={path}"]).data
    tokenized = load_rows(data, AsciiTokenizer(), 128)
    assert tokenized[0]["input_ids"] == [ord(c) for c in "1 + 1 = 2"] + [2]
    assert tokenized[0]["labels"] == [-100] * 7 + [ord(" "), ord("2"), 2]
    assert [e["prompt"] for e in load_examples(path)] == ["1 + 1 =", "2 + 2 ="]


@pytest.mark.parametrize(
    "lines, message",
    [
        ([{"prompt": "a", "completion": 3}], r"d.jsonl:1: field 'completion' must be a string, got int 3"),
        ([{"prompt": None, "completion": "b"}], r"d.jsonl:1: field 'prompt' must be a string, got null"),
        ([{"prompt": "a", "completion": "b"}, ["a", "b"]], r"d.jsonl:2 is a JSON list, not an object"),
        (
            [{"prompt": "a", "completion": "b"}, {"input_ids": [1, 2]}],
            r"d.jsonl:2 is a input_ids record, but the first record is a prompt/completion record",
        ),
    ],
)
def test_a_wrong_sft_record_is_named_by_line_and_field(tmp_path, lines, message):
    path = _write(tmp_path / "d.jsonl", lines)
    data = load_config(SFTConfig, None, [f"data.source={path}"]).data
    with pytest.raises(ValueError, match=message):
        load_rows(data, AsciiTokenizer(), 128)


def test_a_null_in_a_parquet_column_is_named_by_row(tmp_path):
    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": None}]).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"p.parquet row 2: field 'prompt' must be a string, got null"):
        load_examples(path)


def test_a_packed_dataset_trained_with_another_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    )
    packed = tmp_path / "packed"
    datasets.Dataset.from_dict({"input_ids": [[0, 1]], "seq_lengths": [[2]]}).save_to_disk(str(packed))
    sources.save_tokenizer_fingerprint(packed, tok)
    sources.check_tokenizer(packed, tok)  # the same tokenizer passes
    data = load_config(SFTConfig, None, [f"data.source={packed}"]).data
    with pytest.raises(
        ValueError,
        match=r"was tokenized with .*vocabulary of 3.*but the model's tokenizer "
        r"is AsciiTokenizer \(vocabulary of 128.*preprocess again",
    ):
        load_rows(data, AsciiTokenizer(), 128)
