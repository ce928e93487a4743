"""Bin packing: which sequences go into which fixed token budget (training side).

``pack`` assigns lengths to bins (best-fit decreasing by default, compiled), ``StreamingPacker``
does it for streams, ``pack_dataset`` packs a ``datasets.Dataset`` in one global pass, and
``tree.pack_tree_rows`` packs sequences that share prefixes (GRPO groups, forked episodes,
per-turn samples of a chat) with every shared token once.
"""

from nopad.packing.bins.binpack import pack
from nopad.packing.bins.hf_datasets import pack_dataset
from nopad.packing.bins.stats import Bins, PackStats
from nopad.packing.bins.streaming import StreamingPacker

__all__ = ["Bins", "PackStats", "StreamingPacker", "pack", "pack_dataset"]
