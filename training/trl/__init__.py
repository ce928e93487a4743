"""nopad inside TRL: the one place in the library that imports ``trl``.

``grpo_trainer``: ``NopadGRPOTrainer`` (packed training forwards), ``rollout``: ``nopad_rollout_func``
(nopad's generator as TRL's ``rollout_func``), ``sft_trainer``: ``NopadSFTTrainer``, ``compat``: the
TRL version and private names they were written for, checked at construction, ``vllm_state``: the
vLLM flags ``importance_sampling=True`` sets. Every module imports ``trl`` lazily, so importing
this package does not import TRL.
"""

from collections.abc import Callable


def lazy_class(namespace: dict, name: str, build: Callable[[], type]) -> Callable[[str], type]:
    """A module ``__getattr__`` that builds the class ``name`` (a subclass of a TRL trainer) on
    first use and keeps it, so importing the module does not import TRL."""

    def __getattr__(attr: str) -> type:
        if attr != name:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {attr!r}")
        namespace[name] = built = build()
        return built

    return __getattr__
