"""The SGLang EAGLE-3 draft layout and rules, stated once (docs/eagle3-format.md).

- runner/drafts/layout.py: what a draft directory looks like to SGLang's LlamaForCausalLMEagle3:
  the architecture and algorithm names, the tensor names and shapes for a config.json, the typed
  view of config.json (`config_view`), tensor-name normalisation (training prefixes, `layers.0.`
  -> `midlayer.`), the eagle_config block, RoPE fields, the aux-layer-id conventions (SGLang id
  k = HF hidden_states index k + 1).
- runner/drafts/rules.py: the version table (`RULES`, one `SglangRules` row per SGLang release
  read: 0.5.6, 0.5.14, 0.5.23; `rules_for(version)`, `by_rows`), each row's aux-id rules per
  target family (range, what SGLang captures) and draft-token bound.
- runner/drafts/checks.py: the checks on those rows, with the messages of each caller: the
  spec's sglang_version and forward options, draft_vocab_size null, the aux ids (range, order,
  capture, `default_aux_ids(cfg or L, family)`), the draft-token bound.
- runner/drafts/families.py: `target_family(cfg)`: which layer-id rule a target gets (standard,
  deepseek, gpt_oss, minimax_m3_vl) from config.json architectures/model_type or a GGUF arch.
- runner/drafts/forward.py: the forward-changing config flags per version, the parameters each
  version builds and which tensor names load into them, what the embedded engine implements.
- runner/drafts/server.py: the launch_server line (flags and environment) per version.
- runner/drafts/safetensors.py: safetensors headers, a draft directory's files as SGLang loads
  them, bounded reads of values, the verbatim writer; without torch.

Spec validation (runner/spec/), `runner inspect`, `runner convert`, the
extract and export stages, the SGLang bench backend and the drafter model (models/draft_model.py)
all call this package. No torch here (numpy only, in safetensors.py). This __init__ imports
nothing, so a module's cache key follows only the submodules it imports: for `runner init` and
other callers, `runner.drafts.families.target_family(cfg) -> str` and
`runner.drafts.checks.default_aux_ids(cfg or L, family)`.
"""
