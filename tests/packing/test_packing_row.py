"""The packed row (nopad.packing.row) and the distributed helpers (nopad.packing.distributed): the row's schema,
the one builder every producer goes through, moving it, reading it as a dict; world size,
reductions, engine detection and compute dtype in one process (and on two gloo ranks, slow)."""

import os
import pickle

import pytest
import torch

from nopad import packing
from nopad.dataloaders.collator import PackedCollator
from nopad.dataloaders.loader import move_batch
from nopad.packing import distributed
from nopad.packing.bins.tree import TreePath, pack_tree_rows
from nopad.packing.row import IGNORE_INDEX, PackedRow, as_row
from nopad.packing.varlen import VarlenMeta
from nopad.training.grpo import Rollout, empty_rollout_row, pack_rollouts, pair_advantages
from nopad.training.loss import row_loss_sum
from tests.support import launch

SFT_KEYS = [
    "input_ids",
    "labels",
    "position_ids",
    "nopad_meta",
    "seq_lens",
    "indices",
    "num_loss_tokens",
    "num_loss_seqs",
]


def _row() -> PackedRow:
    return PackedRow.build(
        [5, 6, 7, 8, 9],
        [IGNORE_INDEX, 6, 7, IGNORE_INDEX, IGNORE_INDEX],
        VarlenMeta.from_lengths([3, 2]),
        indices=[4, 1],
    )


# ----------------------------------------------------------------------------- schema and builder
def test_build_writes_the_schema():
    row = _row()
    assert row.input_ids.tolist() == [[5, 6, 7, 8, 9]] and row.input_ids.dtype == torch.int64
    assert row.labels.tolist() == [[-100, 6, 7, -100, -100]] and row.labels.dtype == torch.int64
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert row.position_ids.data_ptr() == row.nopad_meta.position_ids.data_ptr()  # a view: no copy to check
    assert row.seq_lens.tolist() == [3, 2] and row.indices.tolist() == [4, 1]
    assert (row.num_loss_tokens, row.num_loss_seqs, row.num_tokens) == (2, 1, 5)
    assert row.token_values == {} and row.empty is False
    assert IGNORE_INDEX == packing.IGNORE_INDEX == -100 and packing.PackedRow is PackedRow


def test_build_refuses_parts_that_disagree():
    meta = VarlenMeta.from_lengths([2, 2])
    with pytest.raises(ValueError, match="same row"):
        PackedRow.build([1, 2, 3], [IGNORE_INDEX, 2, 3], meta)
    with pytest.raises(ValueError, match="token 2, the first of sequence 1"):
        PackedRow.build([1, 2, 3, 4], [IGNORE_INDEX, 2, 3, 4], meta)
    with pytest.raises(ValueError, match=r"gen_logprobs has shape \(3,\) but the row has 2 loss tokens"):
        PackedRow.build(
            [1, 2, 3, 4], [IGNORE_INDEX, 2, IGNORE_INDEX, 4], meta, token_values={"gen_logprobs": [0.0] * 3}
        )
    static = VarlenMeta.static_decode(
        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    )
    with pytest.raises(ValueError, match="static decode"):
        PackedRow.build([1], [IGNORE_INDEX], static)


def test_token_values_are_any_named_per_token_data():
    """The row carries per-token values by name without knowing them: checked, moved, kept by pair."""
    meta = VarlenMeta.from_lengths([2, 2])
    row = PackedRow.build([1, 2, 3, 4], [IGNORE_INDEX, 2, IGNORE_INDEX, 4], meta, token_values={"weight": [0.5, 2]})
    assert row.token_values["weight"].dtype == torch.float32 and list(row)[-1] == "token_values"
    both = row.with_token_values({"score": torch.tensor([1.0, -1.0], dtype=torch.float64)})
    assert sorted(both.token_values) == ["score", "weight"] and row.token_values.keys() == {"weight"}
    assert both.token_values["score"].dtype == torch.float32
    assert both.to("meta").token_values["score"].device.type == "meta"
    for bad in ("ab", None):
        with pytest.raises(TypeError, match=r"token_values\['w'\] must be numbers"):
            PackedRow.build([1, 2, 3, 4], [IGNORE_INDEX, 2, IGNORE_INDEX, 4], meta, token_values={"w": bad})
    with pytest.raises(ValueError, match=r"score has shape \(3,\) but the row has 2 loss tokens"):
        row.with_token_values({"score": [0.0] * 3})
    with pytest.raises(TypeError, match="token_values must map a name"):
        PackedRow.build([1, 2], [IGNORE_INDEX, 2], VarlenMeta.from_lengths([2]), token_values=[1.0])


def test_collator_builds_through_the_builder():
    row = PackedCollator(pad_to_multiple_of=4)(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "index": 4},
            {"input_ids": [1, 2, 3, 4, 5, 6], "seq_lengths": [2, 4], "index": 7},
        ]
    )
    assert isinstance(row, PackedRow)
    assert row.input_ids.tolist() == [[5, 6, 7, 1, 2, 3, 4, 5, 6, 0, 0, 0]]
    assert row.labels.tolist() == [[-100, 6, 7, -100, 2, -100, 4, 5, 6, -100, -100, -100]]
    assert row.nopad_meta.seqlens_q == (3, 2, 4, 3)  # the filler is a sequence of the meta...
    assert row.seq_lens.tolist() == [3, 2, 4]  # ...but not of the data
    assert row.indices.tolist() == [4, 7, 7]
    assert (row.num_loss_tokens, row.num_loss_seqs) == (6, 3)
    assert list(row) == SFT_KEYS


def test_tree_row_builds_through_the_builder():
    """Two paths sharing [1, 2, 3] and training on its last token (a model token before a fork):
    labelled once, read by two pairs, each with its own advantage."""
    paths = [
        TreePath([1, 2, 3, 4, 5], [False, False, True, True, True], {"advantages": [0.0, 0, 1, 2, 3]}),
        TreePath([1, 2, 3, 6], [False, False, True, True], {"advantages": [0.0, 0, 7, 8]}),
        TreePath([7, 8, 9], [False, True, True], {"advantages": [0.0, 5, 6]}),
    ]
    (row,) = pack_tree_rows(paths, capacity=16)
    assert row.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert row.labels.tolist() == [[-100, -100, 3, 4, 5, 6, -100, 8, 9]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2]]
    assert row.seq_lens.tolist() == [5, 1, 3]
    assert row.indices.tolist() == [0, 1, 2]
    assert row.pair_tokens.tolist() == [0, 1, 2, 0, 3, 4, 5]
    assert row.pair_seqs.tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert row.token_values["advantages"].tolist() == [1.0, 2.0, 3.0, 7.0, 8.0, 5.0, 6.0]
    assert (row.num_loss_tokens, row.num_loss_seqs) == (7, 3)  # as the flat sequences count them
    assert row.loss_tokens()[0].tolist() == [1, 2, 3, 2, 6, 7]  # token 6 is predicted by token 3's row
    assert list(row) == SFT_KEYS + ["token_values", "pair_tokens", "pair_seqs"]
    with pytest.raises(ValueError, match="no pair reads it"):
        PackedRow.build(row.input_ids, row.labels, row.nopad_meta, indices=[0, 1, 2], pairs=([0, 1], [0, 0]))
    with pytest.raises(ValueError, match="must index the row's 3 sequences"):
        PackedRow.build(
            row.input_ids, row.labels, row.nopad_meta, indices=[0, 1, 2], pairs=(list(range(6)), [0, 0, 0, 0, 0, 3])
        )


def _rollouts() -> list[Rollout]:
    return [
        Rollout([1, 2], [3, 4], [-0.5, -0.25], advantage=1.0),
        Rollout([5], [6, 7, 8], [-1.0, -2.0, -3.0], advantage=-1.0),
        Rollout([1, 2], [9], [-0.125], advantage=0.5),
    ]


def test_rollouts_pack_through_the_builder(monkeypatch):
    calls, build = [], PackedRow.build.__func__

    def spy(cls, *args, **kwargs):
        calls.append(1)
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(PackedRow, "build", classmethod(spy))
    shared = pack_rollouts(_rollouts(), capacity=16)
    plain = pack_rollouts(_rollouts(), capacity=16, shared_prefix=False)
    empty = empty_rollout_row()
    assert len(calls) == len(shared) + len(plain) + 1 == 3  # every row, whichever path, from the builder
    (s,), (p,) = shared, plain
    assert s.input_ids.tolist() == [[1, 2, 3, 4, 9, 5, 6, 7, 8]]  # the prompt [1, 2] once
    assert s.labels.tolist() == [[-100, -100, 3, 4, 9, -100, 6, 7, 8]]
    assert s.indices.tolist() == [0, 2, 1] and s.seq_lens.tolist() == [4, 1, 4]
    assert s.pair_tokens.tolist() == list(range(6)) and s.pair_seqs.tolist() == [0, 0, 1, 2, 2, 2]
    assert s.token_values["gen_logprobs"].tolist() == [-0.5, -0.25, -0.125, -1.0, -2.0, -3.0]
    assert pair_advantages(s, _rollouts()).tolist() == [1.0, 1.0, 0.5, -1.0, -1.0, -1.0]
    assert (s.num_loss_tokens, s.num_loss_seqs) == (6, 3)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 9]]  # BFD: longest first, in order
    assert p.labels.tolist() == [[-100, -100, 3, 4, -100, 6, 7, 8, -100, -100, 9]]
    assert p.indices.tolist() == [0, 1, 2] and p.seq_lens.tolist() == [4, 4, 3]
    assert p.token_values["gen_logprobs"].tolist() == [-0.5, -0.25, -1.0, -2.0, -3.0, -0.125]
    assert pair_advantages(p, _rollouts()).tolist() == [1.0, 1.0, -1.0, -1.0, -1.0, 0.5]
    assert (empty.empty, empty.num_loss_tokens, empty.num_loss_seqs) == (True, 0, 0)
    assert empty.labels.tolist() == [[-100, 0]] and empty.token_values["gen_logprobs"].tolist() == [0.0]
    assert empty["empty"] is True and "empty" not in s


def test_a_rollout_without_prompt_is_an_error_not_a_shifted_row():
    with pytest.raises(ValueError, match="nothing before it"):
        pack_rollouts([Rollout([], [3, 4], [-0.5, -0.25])], capacity=8, shared_prefix=False)


# ----------------------------------------------------------------------------- use
def test_to_moves_the_model_and_loss_tensors_and_keeps_bookkeeping_on_the_host():
    row = pack_rollouts(_rollouts(), capacity=16)[0]
    moved = row.to("meta", non_blocking=True)
    assert moved is not row and row.input_ids.device.type == "cpu"
    for t in (
        moved.input_ids,
        moved.labels,
        moved.position_ids,
        moved.token_values["gen_logprobs"],
        moved.nopad_meta.cu_seqlens_q,
        moved.nopad_meta.key_index,
    ):
        assert t.device.type == "meta"
    assert moved.seq_lens.device.type == moved.indices.device.type == "cpu"
    assert (moved.num_loss_tokens, moved.num_loss_seqs) == (row.num_loss_tokens, row.num_loss_seqs)
    assert move_batch(row, "meta").input_ids.device.type == "meta"  # the old name, through the row
    from accelerate.utils import send_to_device

    assert isinstance(send_to_device(row, "meta"), PackedRow)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
def test_a_pinning_dataloader_keeps_the_row():
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = pin_memory(_row())  # what DataLoader(pin_memory=True) runs on every batch
    assert isinstance(pinned, PackedRow) and pinned.input_ids.is_pinned() and pinned.labels.is_pinned()
    assert pinned.to("cuda", non_blocking=True).nopad_meta.device.type == "cuda"


def test_model_kwargs_are_what_the_forward_takes():
    row = _row()
    kwargs = row.model_kwargs()
    assert list(kwargs) == ["input_ids", "position_ids", "nopad_meta"]
    assert kwargs["input_ids"] is row.input_ids and kwargs["nopad_meta"] is row.nopad_meta
    assert row.model_kwargs(labels=True)["labels"] is row.labels


# ----------------------------------------------------------------------------- read as a dict
def test_a_row_reads_as_the_dict_it_was():
    row = _row()
    assert row["input_ids"] is row.input_ids and row["nopad_meta"] is row.nopad_meta
    assert list(row.keys()) == SFT_KEYS and len(row) == len(SFT_KEYS)
    assert "labels" in row and "token_values" not in row and "empty" not in row
    assert row.get("empty") is None and row.get("num_loss_tokens") == 2
    with pytest.raises(KeyError):
        row["token_values"]
    assert dict(row)["seq_lens"] is row.seq_lens and (lambda **kw: sorted(kw))(**row) == sorted(SFT_KEYS)
    row["token_values"] = {"gen_logprobs": torch.zeros(2)}  # a field may be set by key, as on the dict
    assert "token_values" in row
    with pytest.raises(KeyError, match="no field 'ref_logprobs'"):
        row["ref_logprobs"] = torch.zeros(2)


def test_dict_batches_become_rows():
    row = _row()
    again = as_row(dict(row))
    assert isinstance(again, PackedRow) and as_row(row) is row
    assert torch.equal(again.labels, row.labels) and (again.num_loss_tokens, again.num_loss_seqs) == (2, 1)
    with pytest.raises(KeyError, match="needs input_ids, labels and nopad_meta"):
        as_row({"input_ids": row.input_ids})
    logits = torch.randn(1, row.input_ids.shape[1], 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(row_loss_sum(logits, dict(row)), row_loss_sum(logits, row))  # the loss takes both
    restored = pickle.loads(pickle.dumps(row))  # DataLoader workers send rows between processes
    assert torch.equal(restored.input_ids, row.input_ids) and list(restored) == SFT_KEYS


# ----------------------------------------------------------------------------- nopad.packing.distributed
def test_distributed_helpers_in_one_process():
    assert (distributed.world_size(), distributed.rank(), distributed.is_distributed()) == (1, 0, False)
    assert distributed.global_sum(2.5) == 2.5 and distributed.global_max(-1) == -1.0
    assert distributed.any_rank(True) is True and distributed.any_rank(False) is False
    linear = torch.nn.Linear(2, 2)
    assert distributed.zero_stage(linear) is None and distributed.zero3_engine(linear) is None
    assert distributed.fsdp2_modules(linear) == []


def test_compute_dtype():
    linear = torch.nn.Linear(2, 2).to(torch.bfloat16)
    query = torch.zeros(1, dtype=torch.float16)
    assert distributed.compute_dtype(linear) == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        assert distributed.compute_dtype(torch.nn.Linear(2, 2), query) == torch.float16
        assert distributed.compute_dtype(torch.nn.Linear(2, 2), "cpu") == torch.float16
        assert distributed.compute_dtype(torch.nn.Linear(2, 2)) == torch.float32  # no device: no autocast
    quantized = torch.nn.Module()
    quantized.register_buffer("w", torch.zeros(2, dtype=torch.int8))
    assert distributed.compute_dtype(quantized, query) == torch.float16  # nothing else to go by
    quantized.config = type("Config", (), {"dtype": torch.bfloat16})()
    assert distributed.compute_dtype(quantized, query) == torch.bfloat16
    assert distributed.compute_dtype(torch.nn.Module()) == torch.get_default_dtype()


def _two_rank_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = {
            "world": distributed.world_size(),
            "rank": distributed.rank(),
            "sum": distributed.global_sum(2**24 + 1),  # exact only in float64
            "max": distributed.global_max(rank * 10),
            "any": distributed.any_rank(rank == 1),
            "none": distributed.any_rank(False),
        }
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(300)  # the spawn's own 120 s, then a margin
def test_distributed_helpers_on_two_gloo_ranks(tmp_path):
    launch.spawn(_two_rank_worker, args=(launch.free_port(), str(tmp_path)), nprocs=2, timeout=120)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank, got in enumerate(results):
        assert got == {"world": 2, "rank": rank, "sum": 2.0 * (2**24 + 1), "max": 10.0, "any": True, "none": False}
