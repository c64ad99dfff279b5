"""The drafter's attention and MLP geometry, resolved once: each field the spec leaves out comes
from the target's config (as SGLang and our drafter build it), and the combination is checked
before any stage runs (`runner validate`), not in train after an extraction.

`draft_geometry` is the one rule: runner/spec/load.py checks it against the target's config,
models/draft_model.py (DraftConfig.from_spec) builds the drafter from it. No torch.
"""

from __future__ import annotations

from typing import Any

def draft_geometry(drafter: Any, target_cfg: dict | None,
                   target_hidden: int | None) -> tuple[dict, list[tuple[str, str]]]:
    """(values, problems) of the drafter's hidden_size, num_attention_heads,
    num_key_value_heads, head_dim and intermediate_size: each declared drafter field, else the
    target's config value (head_dim: else hidden / heads; kv heads: else heads). A value that
    cannot be known is None. `problems` are (field, message) pairs: heads that do not divide, a
    hidden size the heads do not divide without a head_dim, an odd head_dim (RoPE rotates
    pairs), a field neither declared nor in the target's config. With no target config
    (`target_cfg` None: it could not be read), only what the spec declares is checked."""
    t = target_cfg or {}
    get = (lambda k: drafter.get(k)) if isinstance(drafter, dict) else \
        (lambda k: getattr(drafter, k, None))
    src: dict[str, str] = {}

    def pick(name: str, fallback=None):
        if get(name) is not None:
            src[name] = f"drafter.{name} = {get(name)}"
            return get(name)
        if t.get(name) is not None:
            src[name] = f"the target's {name} = {t[name]} (drafter.{name} not declared)"
            return t[name]
        return fallback

    H = get("hidden_size") or target_hidden
    heads = pick("num_attention_heads")
    kv = pick("num_key_value_heads", heads)
    head_dim = pick("head_dim")
    problems: list[tuple[str, str]] = []
    known = target_cfg is not None
    if head_dim is None and H and heads:
        if H % heads:
            problems.append(("drafter.head_dim", f"not declared, and hidden_size {H} is not a "
                             f"multiple of {src['num_attention_heads']}: declare "
                             "drafter.head_dim (or heads that divide the hidden size)."))
        else:
            head_dim = H // heads
            src["head_dim"] = f"hidden_size / heads = {head_dim}"
    inter = pick("intermediate_size")
    if heads and kv and heads % kv:
        fit = [n for n in range(1, heads + 1) if heads % n == 0]
        problems.append(("drafter.num_key_value_heads",
                         f"{src.get('num_key_value_heads', kv)} must divide "
                         f"{src['num_attention_heads']} (grouped-query attention): use one of "
                         f"{', '.join(map(str, fit))}."))
    if head_dim and head_dim % 2:
        problems.append(("drafter.head_dim", f"{src.get('head_dim', head_dim)} is odd; RoPE "
                         "rotates pairs of dimensions, so head_dim must be even."))
    if known:
        for name, value in (("num_attention_heads", heads), ("intermediate_size", inter)):
            if value is None:
                problems.append((f"drafter.{name}", "unknown: the target's config has no "
                                 f"{name}; declare drafter.{name}."))
    return ({"hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv,
             "head_dim": head_dim, "intermediate_size": inter}, problems)
