"""nopad.recipes.preprocess with a tiny offline word-level tokenizer: chat masking, text, pack, save."""

import json
import logging

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nopad.inference.chat import tokenize_conversation
from nopad.recipes.preprocess import load_records, main, tokenize_dataset, tokenize_text

WORDS = ["<unk>", "<eos>", "<s>", "</s>", "user", "assistant"] + "hi hello how are you fine ok".split()
TEMPLATE = (
    "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    return tok


CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "how are you"},
    {"role": "assistant", "content": "fine ok"},
]


def test_chat_masks_everything_but_assistant_turns(tokenizer):
    ids, labels = tokenize_conversation(tokenizer, CHAT)
    # <s> user hi </s> <s> assistant hello </s> <s> user how are you </s> <s> assistant fine ok </s>
    assert ids == [2, 4, 6, 3, 2, 5, 7, 3, 2, 4, 8, 9, 10, 3, 2, 5, 11, 12, 3]
    assert labels == [-100] * 6 + [7, 3] + [-100] * 8 + [11, 12, 3]


def test_chat_needs_a_prefix_consistent_template(tokenizer):
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<eos>")
    tok.chat_template = "{% for m in messages|reverse %}<s> {{ m['content'] }} </s> {% endfor %}"
    with pytest.raises(ValueError, match="prefix-consistent template"):
        tokenize_conversation(tok, CHAT)
    tok.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat_template"):
        tokenize_conversation(tok, CHAT)


def test_text_appends_eos(tokenizer):
    assert tokenize_text(["hi you", "ok"], tokenizer) == [[6, 10, 1], [12, 1]]
    assert tokenize_text(["hi you"], tokenizer, add_eos=False) == [[6, 10]]


def test_tokenize_dataset_picks_the_format(tokenizer):
    chats = tokenize_dataset(datasets.Dataset.from_dict({"messages": [CHAT[:2]]}), tokenizer)
    assert chats.column_names == ["input_ids", "labels"]
    assert chats[0]["labels"] == [-100] * 6 + [7, 3]
    text = tokenize_dataset(datasets.Dataset.from_dict({"body": ["hi"]}), tokenizer, text_field="body")
    assert text[:] == {"input_ids": [[6, 1]]}
    with pytest.raises(ValueError, match=r"found neither a 'messages' \(chat\) nor a 'text'"):
        tokenize_dataset(datasets.Dataset.from_dict({"x": ["hi"]}), tokenizer)


def test_load_records_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl' does not exist; give .jsonl, .jsonl.gz"):
        load_records(tmp_path / "missing.jsonl")
    one = datasets.Dataset.from_dict({"text": ["x"]})
    datasets.DatasetDict(a=one, b=one).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"holds splits \['a', 'b'\]; choose one with its split key"):
        load_records(tmp_path / "dd")


def test_cli_end_to_end(tmp_path, tokenizer, capsys):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    data = tmp_path / "chats.jsonl"
    rows = [{"messages": CHAT}, {"messages": CHAT[:2]}, {"messages": CHAT[2:]}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "packed"
    packed = main([f"input={data}", f"output={out}", f"tokenizer={tok_dir}", "capacity=32"])
    assert packed[:] == datasets.load_from_disk(str(out))[:]
    # 19 + 8 + 11 tokens: bfd puts the 19- and 11-token chats together, the 8-token one alone
    assert packed["seq_lengths"] == [[19, 11], [8]]
    assert packed[1]["labels"] == [-100] * 6 + [7, 3]
    assert "saved 2 packed rows of <= 32 tokens" in capsys.readouterr().out
    # text input from a save_to_disk directory, with overflow split
    datasets.Dataset.from_dict({"text": ["hi " * 10, "ok"]}).save_to_disk(str(tmp_path / "text"))
    packed = main(
        [
            f"input={tmp_path / 'text'}",
            f"output={tmp_path / 'p2'}",
            f"tokenizer={tok_dir}",
            "capacity=4",
            "overflow=split",
        ]
    )
    assert packed["seq_lengths"] == [[4], [4], [3], [2]]  # 11 tokens -> 4 + 4 + 3; then "ok <eos>"
    with pytest.raises(ValueError, match="set both input="):
        main([f"tokenizer={tok_dir}"])


@pytest.mark.parametrize(
    "content,message",
    [
        ("", "holds no records"),
        ('{"text": "ok"}\n{"text": "broken\n', r"bad.jsonl:2 is not valid JSON"),
        ('["a list"]\n', r"bad.jsonl:1 is a JSON list, not an object"),
        ('{"messages": "hello"}\n', r"bad.jsonl:1: field 'messages' must be a list, got str 'hello'"),
        ('{"messages": []}\n', r"bad.jsonl:1: messages must be a non-empty list"),
        ('{"text": 5}\n', r"bad.jsonl:1: field 'text' must be a string, got int 5"),
        ('{"text": null}\n', r"bad.jsonl:1: field 'text' must be a string, got null"),
        (
            '{"text": "a"}\n{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
            r"bad.jsonl:2 is a messages record, but the first record is a text record",
        ),
        ('{"body": "a"}\n', r"bad.jsonl:1 has fields \['body'\]; expected \{\"messages\": <list>\} or"),
        ('{"messages": [{"role": "user", "content": "hi"}]}\n', r"bad.jsonl:1: the conversation has no assistant turn"),
    ],
)
def test_bad_jsonl_is_a_clear_error_naming_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_records(path)


def test_the_shipped_yaml_lists_exactly_the_defaults_and_settings_are_typed(capsys):
    from nopad.recipes.config import load_config
    from nopad.recipes.preprocess import DEFAULT_CONFIG, PreprocessConfig

    assert load_config(PreprocessConfig, DEFAULT_CONFIG) == PreprocessConfig()
    for arg, message in [
        ("strategy=best", "strategy must be 'bfd', 'ffd' or 'nextfit', got 'best'"),
        ("capacity=0", "capacity must be an integer >= 1, got 0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(["input=x.jsonl", "output=out", arg])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def _write_formats(tmp_path) -> dict:
    """The same two text records in every format users keep data in."""
    import gzip

    rows = [{"text": "hi there"}, {"text": "ok"}]
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    paths = {
        "jsonl": tmp_path / "d.jsonl",
        "gz": tmp_path / "d.jsonl.gz",
        "json": tmp_path / "d.json",
        "bom": tmp_path / "bom.jsonl",
        "parquet": tmp_path / "d.parquet",
        "csv": tmp_path / "d.csv",
        "saved": tmp_path / "saved",
        "dict": tmp_path / "dict",
    }
    paths["jsonl"].write_text(lines)
    paths["gz"].write_bytes(gzip.compress(lines.encode()))
    paths["json"].write_text(json.dumps(rows))
    paths["bom"].write_bytes(b"\xef\xbb\xbf" + lines.encode())
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(paths["parquet"]))
    ds.to_csv(str(paths["csv"]), index=False)
    ds.save_to_disk(str(paths["saved"]))
    datasets.DatasetDict(train=ds, test=ds.select([0])).save_to_disk(str(paths["dict"]))
    return paths


def test_every_input_format_reads_the_same_records(tmp_path, caplog):
    for name, path in _write_formats(tmp_path).items():
        with caplog.at_level(logging.INFO):
            assert load_records(path)["text"] == ["hi there", "ok"], name
    assert "using split 'train' of ['train', 'test']" in caplog.text
    assert load_records(tmp_path / "dict", split="test")["text"] == ["hi there"]
    with pytest.raises(ValueError, match=r"holds splits \['train', 'test'\]; choose one"):
        load_records(tmp_path / "dict", split="dev")


def test_preprocess_refuses_to_drop_most_of_a_long_document(tmp_path, tokenizer):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"text": "hi " * 100}) + "\n")
    args = [f"input={data}", f"tokenizer={tok_dir}", "capacity=8"]
    dropped = (
        r"^overflow=truncate would drop 93 of 101 tokens \(92%\) of the 1 sequences longer than "
        r"capacity=8, more than max_dropped_fraction=0.05"
    )
    with pytest.raises(ValueError, match=dropped):
        main([*args, f"output={tmp_path / 'p'}"])
    packed = main([*args, f"output={tmp_path / 'p'}", "max_dropped_fraction=1"])
    assert packed["seq_lengths"] == [[8]]


def test_an_empty_text_is_one_line_naming_the_record(tmp_path, tokenizer):
    """The packer's error used to name its own skip_empty argument, which the recipe does not have."""
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hi", "", "hello", ""]))
    with pytest.raises(
        ValueError,
        match=r"^2 of .*texts.jsonl's records tokenize to no tokens \(the first: "
        r"record 1, an empty 'text'\); remove them .* or set add_eos=true",
    ):
        main([f"input={data}", f"tokenizer={tok_dir}", f"output={tmp_path / 'p'}", "add_eos=false"])
    assert main([f"input={data}", f"tokenizer={tok_dir}", f"output={tmp_path / 'p'}"])["seq_lengths"]


def test_preprocess_refuses_an_sft_run_directory(tmp_path, tokenizer):
    tok_dir = tmp_path / "tok"
    tokenizer.save_pretrained(tok_dir)
    (tmp_path / "runs" / "step_2").mkdir(parents=True)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(FileExistsError, match="is a training run's output directory; writing the packed"):
        main([f"input={data}", f"tokenizer={tok_dir}", f"output={tmp_path / 'runs'}"])


# each wrong conversation, as preprocess and per-turn SFT both read it: file:line, then the field
BAD_CHATS = [
    (
        [{"content": "hi"}, {"role": "assistant", "content": "b"}],
        r"bad.jsonl:1: messages\[0\].role is missing; give one of system",
    ),
    (
        [{"role": "user", "content": None}, {"role": "assistant", "content": "b"}],
        r"bad.jsonl:1: messages\[0\].content must be a string, got null",
    ),
    (
        [{"role": "user", "content": 7}, {"role": "assistant", "content": "b"}],
        r"bad.jsonl:1: messages\[0\].content must be a string, got int 7",
    ),
    (
        [{"role": "user"}, {"role": "assistant", "content": "b"}],
        r"bad.jsonl:1: messages\[0\].content must be a string, got missing",
    ),
    (
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}],
        r"bad.jsonl:1: messages\[1\] is an assistant turn before any user turn",
    ),
    (
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"},
        ],
        r"bad.jsonl:1: messages\[1\] and messages\[2\] are two assistant turns in a row",
    ),
    (
        [{"role": "wizard", "content": "a"}, {"role": "assistant", "content": "b"}],
        r"bad.jsonl:1: messages\[0\].role 'wizard' is not a chat role; give one of system",
    ),
    ([{"role": "user", "content": "a"}, "hello"], r"bad.jsonl:1: messages\[1\] must be an object"),
]


@pytest.mark.parametrize("messages,message", BAD_CHATS)
def test_a_wrong_conversation_is_one_line_naming_its_line_and_field(tmp_path, messages, message):
    """Checked before any template or Arrow sees it: a jinja UndefinedError or an ArrowInvalid quoting
    another row used to be what the user saw, and an unknown role was rendered as a prompt turn."""
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "ok"}]})
        + "\n"
        + json.dumps({"messages": messages})
        + "\n"
    )
    with pytest.raises(ValueError, match=message.replace("jsonl:1", "jsonl:2")):
        load_records(path)
