"""Bin packing: which sequences go into which fixed token budget (training side).

``pack`` assigns lengths to bins (best-fit decreasing by default, compiled), ``StreamingPacker``
does it for streams, ``pack_dataset`` packs a ``datasets.Dataset`` in one global pass, and
``shared_prefix.pack_groups`` packs GRPO groups (prompt once + its completions) into rows.
"""

from packing.bins.binpack import pack
from packing.bins.hf_datasets import pack_dataset
from packing.bins.stats import Bins, PackStats
from packing.bins.streaming import StreamingPacker

__all__ = ["Bins", "PackStats", "StreamingPacker", "pack", "pack_dataset"]
