"""The SGLang EAGLE-3 draft layout, stated once (docs/eagle3-format.md).

- runner/drafts/layout.py: what a draft directory looks like to SGLang's LlamaForCausalLMEagle3:
  the architecture and algorithm names, the tensor names and shapes for a config.json, tensor-name
  normalisation (training prefixes, `layers.0.` -> `midlayer.`), the eagle_config block, RoPE
  fields, the aux-layer-id conventions (SGLang id k = HF hidden_states index k + 1) and SGLang's
  default ids.
- runner/drafts/rules.py: the checks with their messages, keyed by the SGLang version range they
  hold for: the aux-id range and order rule, the draft-token bound.
- runner/drafts/safetensors.py: safetensors headers and single tensors read (and written)
  without torch.

Spec validation (runner/spec/schema.py, runner/stages.py), `runner inspect`, `runner convert`, the
extract and export stages and the drafter model (jobs/draft_model.py) all call this package. No
torch here (numpy only, in safetensors.py).
"""
