"""The capture server's model classes: loaded INSIDE an SGLang server process only, by SGLang's
model registry (sglang/srt/models/registry.py, SGLang 0.5.14: `SGLANG_EXTERNAL_MODEL_PACKAGE`
names a package; every module of it is imported and its `EntryClass` classes replace the
built-in ones of the same name). Never imported by the runner (it imports sglang).

For each architecture in EAGLE3_CAPTURE_ARCHS (the target's config.json `architectures`,
targets/sglang_target.py capture_env), a subclass of SGLang's own class with the same name that,
once built, installs the capture hooks (targets/sglang_hooks.py install_capture) for the aux ids in
EAGLE3_CAPTURE_LAYERS, with the file transport's writer on tensor-parallel rank 0 when
EAGLE3_CAPTURE_SINK is set. Weights, forward and sampling are SGLang's own. `EntryClass` is
built when the registry asks for it (PEP 562 module __getattr__; the registry tests
hasattr(module, "EntryClass")), so importing this module imports no sglang.
"""

from __future__ import annotations

import functools
import os

from eagle3_runner.targets.sglang_hooks import Sink, install_capture
from eagle3_runner.targets.sglang_target import ARCHS_ENV, LAYERS_ENV, SINK_ENV


def _layer_ids() -> list[int] | None:
    raw = os.environ.get(LAYERS_ENV, "")
    return [int(x) for x in raw.split(",") if x.strip()] or None


def _sink() -> Sink | None:
    folder = os.environ.get(SINK_ENV)
    if not folder:
        return None
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank
    return Sink(folder) if get_tensor_model_parallel_rank() == 0 else None


def capturing(stock: type) -> type:
    """A subclass of SGLang's model class `stock`, same name, that captures once built."""
    def __init__(self, *args, **kwargs):
        stock.__init__(self, *args, **kwargs)
        install_capture(self, _layer_ids(), _sink())

    return type(stock.__name__, (stock,), {"__init__": __init__, "__module__": __name__})


@functools.lru_cache(maxsize=1)
def entry_classes() -> list[type]:
    """The capturing subclasses of the built-in classes named in EAGLE3_CAPTURE_ARCHS (made
    once: the registry reads EntryClass twice)."""
    # the registry module is still running its last lines when it imports this package, but its
    # ModelRegistry (every built-in class) already exists
    from sglang.srt.models.registry import ModelRegistry
    names = dict.fromkeys(x.strip() for x in os.environ.get(ARCHS_ENV, "").split(","))
    return [capturing(ModelRegistry.models[a]) for a in names if a in ModelRegistry.models]


def __getattr__(name: str):
    if name == "EntryClass":
        return entry_classes()
    raise AttributeError(name)
