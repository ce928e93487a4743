import numpy as np
import pytest
import torch

from nopad.dataloaders.loader import PackedDataLoader, move_batch, packed_dataloader

rng = np.random.default_rng(0)
ROWS = [{"input_ids": rng.integers(3, 100, size=n).tolist()} for n in rng.integers(1, 40, size=120)]


def _keys(batches):
    return [tuple(b["indices"].tolist()) for b in batches]


def _run(loader, steps):
    out = []
    while len(out) < steps:
        for batch in loader:
            out.append(batch)
            if len(out) == steps:
                break
    return out


def test_loader_yields_packed_batches_and_moves_to_next_epoch():
    loader = packed_dataloader(ROWS, 96, seed=3)
    assert isinstance(loader, PackedDataLoader)
    epoch0 = list(loader)
    assert loader.epoch == 1 and len(epoch0) == len(loader)
    seen = sorted(i for b in epoch0 for i in b["indices"].tolist())
    assert seen == list(range(len(ROWS)))
    assert all(b["input_ids"].shape[1] <= 96 for b in epoch0)
    epoch1 = list(loader)
    assert _keys(epoch0) != _keys(epoch1)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_at", [3, "epoch_end", "next_epoch"])
def test_resume_gives_exactly_the_uninterrupted_batches(num_workers, stop_at):
    reference = packed_dataloader(ROWS, 96, seed=3, num_replicas=2, rank=1)
    steps_per_epoch = len(reference)
    total = 2 * steps_per_epoch + 2
    expected = _keys(_run(reference, total))
    k = {3: 3, "epoch_end": steps_per_epoch, "next_epoch": steps_per_epoch + 2}[stop_at]

    first = packed_dataloader(ROWS, 96, seed=3, num_replicas=2, rank=1, num_workers=num_workers)
    got = _keys(_run(first, k))
    if stop_at == "epoch_end":
        for _ in first:  # the loop ends naturally: state moves to the next epoch
            raise AssertionError("epoch already consumed")
    state = first.state_dict()
    resumed = packed_dataloader(ROWS, 96, seed=3, num_replicas=2, rank=1, num_workers=num_workers)
    resumed.load_state_dict(state)
    got += _keys(_run(resumed, total - k))
    assert got == expected


def test_forbidden_arguments_and_move_batch():
    loader = packed_dataloader(ROWS, 96)
    with pytest.raises(ValueError, match="shuffle= is decided"):
        PackedDataLoader(loader.dataset, loader.packed_sampler, shuffle=True)
    batch = move_batch(next(iter(loader)), torch.device("cpu"))
    assert batch["nopad_meta"].cu_seqlens_q.device.type == "cpu"
    assert isinstance(batch["num_loss_tokens"], int)


def test_sequence_longer_than_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="capacity|longer|budget"):
        list(packed_dataloader([{"input_ids": list(range(200))}], 96))
