import itertools
import pickle

import datasets
import numpy as np
import pytest

from nopad.dataloaders.streaming import StreamingPackedLoader

rng = np.random.default_rng(1)
ROWS = [{"input_ids": rng.integers(3, 100, size=n).tolist()} for n in rng.integers(1, 50, size=150)]


def _gen():
    yield from ROWS


def _loader(source=_gen, rank=0, **kw):
    kw.setdefault("buffer_size", 16)
    kw.setdefault("balance_window", 2)
    return StreamingPackedLoader(source, 96, num_replicas=2, rank=rank, seed=4, **kw)


def _keys(batches):
    return [tuple(b["indices"].tolist()) for b in batches]


def test_two_ranks_see_every_row_once_in_equal_steps():
    loaders = [_loader(rank=r) for r in range(2)]
    epochs = [list(x) for x in loaders]
    assert len(epochs[0]) == len(epochs[1])
    seen = sorted(i for e in epochs for b in e for i in b["indices"].tolist())
    assert seen == list(range(len(ROWS)))
    assert all(b["input_ids"].shape[1] <= 96 for e in epochs for b in e)
    stats = loaders[0].last_stats
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in ROWS)
    assert stats["sequences_dropped"] == 0 and stats["sequences_duplicated"] == 0
    assert stats["steps_per_rank"] == len(epochs[0]) and stats["efficiency"] > 0.9
    assert loaders[0].epoch == 1 and loaders[0].rows == {}


def test_hf_iterable_dataset_source_gives_the_same_batches():
    hf = datasets.Dataset.from_list(ROWS).to_iterable_dataset()
    assert _keys(_loader(hf)) == _keys(_loader(_gen))


@pytest.mark.parametrize("stop", [1, 5, "epoch_end", "next_epoch"])
def test_resume_is_exact_including_buffer_and_across_epochs(stop):
    ref = _loader()
    per_epoch = len(list(_loader()))
    expected = _keys(list(ref) + list(ref))
    k = {1: 1, 5: 5, "epoch_end": per_epoch, "next_epoch": per_epoch + 2}[stop]
    first = _loader()
    got, it = [], iter(first)
    for _ in range(k):
        try:
            got.append(next(it))
        except StopIteration:
            it = iter(first)
            got.append(next(it))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state["packer"]["buffer"] or stop in ("epoch_end",) or k >= per_epoch
    resumed = _loader()
    resumed.load_state_dict(state)
    while len(got) < len(expected):
        got += list(resumed)
    assert _keys(got) == expected


def test_worker_processes_read_the_stream_and_resume_exactly():
    from torch.utils.data import DataLoader

    hf = datasets.Dataset.from_list(ROWS).to_iterable_dataset(num_shards=2)
    workers = DataLoader(hf, batch_size=None, num_workers=2)  # rows read in 2 worker processes
    expected = _keys(_loader(workers))
    other = _keys(_loader(workers, rank=1))
    assert sorted(i for k in expected + other for i in k) == list(range(len(ROWS)))  # stream positions
    first = _loader(workers)
    got = _keys(itertools.islice(iter(first), 3))
    resumed = _loader(workers)
    resumed.load_state_dict(first.state_dict())
    assert got + _keys(resumed) == expected


def test_steps_multiple_of_gives_whole_optimizer_steps():
    loaders = [_loader(rank=r, steps_multiple_of=3) for r in range(2)]
    epochs = [list(x) for x in loaders]
    assert len(epochs[0]) == len(epochs[1]) and len(epochs[0]) % 3 == 0
    seen = sorted(i for e in epochs for b in e for i in b["indices"].tolist() if b["num_loss_tokens"])
    assert set(seen) == set(range(len(ROWS)))


def test_split_and_duplicates_keep_rows_until_used():
    rows = [{"input_ids": list(range(1, 200))}]  # one row split into 3 pieces, 2 ranks -> 4 bins
    loaders = [StreamingPackedLoader(rows, 96, num_replicas=2, rank=r, overflow="split") for r in range(2)]
    epochs = [list(x) for x in loaders]
    assert [len(e) for e in epochs] == [2, 2]
    stats = loaders[0].last_stats
    assert stats["sequences_split"] == 1 and stats["sequences_duplicated"] == 1
    assert sum(b["num_loss_tokens"] for e in epochs for b in e) == 199 - 3  # first of each piece


def test_bad_inputs():
    with pytest.raises(TypeError, match="one-shot iterator"):
        StreamingPackedLoader(iter(ROWS), 96)
    with pytest.raises(ValueError, match="stream is empty"):
        list(StreamingPackedLoader([], 96))
    with pytest.raises(KeyError, match="no 'input_ids'"):
        list(StreamingPackedLoader([{"text": "hi"}], 96))
    with pytest.raises(ValueError, match="capacity"):
        list(StreamingPackedLoader([{"input_ids": list(range(100))}], 96))
    with pytest.raises(ValueError, match="tokens_per_batch"):
        _loader().load_state_dict(StreamingPackedLoader(_gen, 64, num_replicas=2, rank=0).state_dict())


@pytest.mark.parametrize(
    "field, change",
    [
        ("tokens_per_batch", {"tokens_per_batch": 64}),
        ("buffer_size", {"buffer_size": 8}),
        ("seed", {"seed": 5}),
        ("max_seqs_per_batch", {"max_seqs_per_batch": 2}),
        ("overflow", {"overflow": "truncate"}),
        ("balance_window", {"balance_window": 3}),
        ("steps_multiple_of", {"steps_multiple_of": 2}),
        ("num_replicas", {"num_replicas": 1}),
        ("attention_cost", {"attention_cost": 0.5}),
    ],
)
def test_streaming_resume_fingerprint_names_the_field(field, change):
    first = _loader()
    next(iter(first))
    kw = {"num_replicas": 2, "rank": 0, "seed": 4, "buffer_size": 16, "balance_window": 2, **change}
    other = StreamingPackedLoader(_gen, kw.pop("tokens_per_batch", 96), **kw)
    with pytest.raises(ValueError, match=f"made with {field}=.* but this loader has {field}="):
        other.load_state_dict(first.state_dict())


def test_streaming_resume_on_other_data_or_garbage_is_an_error():
    first = _loader()
    next(iter(first))
    state = first.state_dict()
    assert state["rows_read"] > 0
    changed = [dict(r) for r in ROWS]
    changed[0] = {"input_ids": changed[0]["input_ids"] + [7]}
    other = _loader(source=changed)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="are not the ones the checkpoint read"):
        next(iter(other))
    same = _loader(source=list(ROWS))
    same.load_state_dict(state)
    next(iter(same))  # the same rows from another re-iterable: accepted
    for garbage in (None, {}, {"rows_read": 3}):
        with pytest.raises(ValueError, match="not a StreamingPackedLoader state"):
            _loader().load_state_dict(garbage)
