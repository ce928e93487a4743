"""nopad: padding-free LLM training and in-process generation on Hugging Face transformers.

One import name for everything nopad installs: ``nopad.packing`` (the varlen core both sides
share), ``nopad.dataloaders`` (packed rows for training), ``nopad.inference`` (the in-flight
batching generator), ``nopad.training`` (steps, losses, checkpoints, the TRL trainers),
``nopad.recipes`` (the command-line recipes) and ``nopad.assets`` (the offline demo model). The
repository keeps them as top-level folders; the install maps each under ``nopad`` (pyproject's
``package-dir``), so no name of ours can shadow another distribution's (``inference``,
``recipes`` and ``dataloaders`` all exist on the package index).
"""

__version__ = "0.1.0"
