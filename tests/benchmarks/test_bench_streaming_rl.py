"""The streaming benchmark's system choice: a GPU call runs a subset (gpu_session.sh streaming), and the
ratios are against nopad sync, so a subset without it, or naming nothing, is refused before any model loads."""

import pytest

from benchmarks.bench_streaming_rl import SYSTEMS, chosen_systems


def test_a_subset_is_picked_by_the_words_of_its_names():
    assert chosen_systems(None) == SYSTEMS
    names = [name for name, _, _ in chosen_systems("sync,s=1 keep,s=2 keep")]
    assert names == ["nopad sync", "streaming s=1 keep", "streaming s=2 keep"]
    assert [name for name, _, _ in chosen_systems("sync, recompute")] == [
        "nopad sync",
        "streaming s=1 recompute",
        "streaming s=4 recompute",
    ]


@pytest.mark.parametrize("spec", ["s=1", "nothing like it", ""])
def test_a_subset_without_sync_or_matching_nothing_is_refused(spec):
    with pytest.raises(SystemExit, match="must name nopad sync"):
        chosen_systems(spec)
