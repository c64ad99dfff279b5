"""Target families: which of SGLang's layer-id rules a target model gets (docs/eagle3-format.md,
section 3).

SGLang turns the draft's eagle_config layer ids into capture indices in the TARGET's model class,
`set_eagle3_layers_to_capture` (read in the released wheels 0.5.6, 0.5.14, 0.5.23,
sglang/srt/models/*.py). The classes fall into four groups; what each group does per version is a
row field of runner/drafts/rules.py, this module only says which group a target is in:

- "standard": `srt/models/llama.py`'s rule, shared by every other class that has the method
  (Qwen2/2.5/3, Qwen3-MoE/-Next/-VL/3.5, GLM4-MoE, Gemma 3/4, MiniMax-M2/M3, Apertus, Bailing,
  EXAONE-MoE, LongCat, Llama-4, GLM-5-Next, ...): always id + 1.
- "deepseek": `srt/models/deepseek_v2.py` (DeepseekV2/V3/V32ForCausalLM; Kimi-K2 is a
  DeepseekV3ForCausalLM) and the classes built on it: MistralLarge3ForCausalLM
  (mistral_large_3.py), GlmMoeDsaForCausalLM (glm4_moe.py, GLM-5), KimiK25ForConditionalGeneration
  (kimi_k25.py, delegates to its DeepseekV3 language model), and Glm4MoeLiteForCausalLM
  (glm4_moe_lite.py, same rule; GLM-4.7-Flash). Kimi-VL and DeepSeek-VL2 wrap a DeepseekV2 language
  model too (they have no EAGLE-3 capture method in these versions, so SGLang refuses them loudly).
- "gpt_oss": `srt/models/gpt_oss.py` (0.5.23 keeps ids whose maximum is L as they are).
- "minimax_m3_vl": `srt/models/minimax_m3_vl.py` (0.5.23 only), whose DEFAULT ids differ.

Detection reads config.json `architectures` (SGLang dispatches on them), then `model_type`, at the
top level and inside `text_config` (multimodal wrappers such as Kimi-K2.5), and for a GGUF file
its `general.architecture` (runner/target_config.py puts it in `model_type`; llama.cpp names the
DeepSeek-V2/V3/Kimi-K2 graph `deepseek2`). Anything unknown is "standard". No torch, no numpy.
"""

from __future__ import annotations

STANDARD, DEEPSEEK, GPT_OSS, MINIMAX_M3_VL = "standard", "deepseek", "gpt_oss", "minimax_m3_vl"
FAMILIES = (STANDARD, DEEPSEEK, GPT_OSS, MINIMAX_M3_VL)

_ARCHS = {
    DEEPSEEK: ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
               "KimiK25ForConditionalGeneration", "MistralLarge3ForCausalLM",
               "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM", "KimiVLForConditionalGeneration",
               "DeepseekVL2ForCausalLM"),
    GPT_OSS: ("GptOssForCausalLM",),
    MINIMAX_M3_VL: ("MiniMaxM3SparseForConditionalGeneration",),
}
_MODEL_TYPES = {
    DEEPSEEK: ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25",
               "glm4_moe_lite", "glm_moe_dsa", "kimi_vl", "deepseek_vl_v2",
               "deepseek2"),  # the last: GGUF general.architecture of DeepSeek-V2/V3, Kimi-K2
    GPT_OSS: ("gpt_oss", "gpt-oss"),  # HF model_type, GGUF general.architecture
}
FAMILY_NAMES = {STANDARD: "a standard-rule target (Llama, Qwen, Gemma, GLM4-MoE, MiniMax, ...)",
                DEEPSEEK: "a DeepSeek-family target (DeepSeek-V2/V3/V3.2, Kimi-K2/K2.5, "
                          "GLM-4.7-Flash, GLM-5, Mistral-Large-3)",
                GPT_OSS: "a GPT-OSS target", MINIMAX_M3_VL: "a MiniMax-M3-VL target"}


def _strings(v) -> list[str]:
    if isinstance(v, str):
        return [v]
    return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []


def family_evidence(cfg) -> tuple[str, str]:
    """(family, why) for a target config dict: why names the field that decided, e.g.
    "architectures KimiK25ForConditionalGeneration" or "no known architecture or model_type"."""
    if not isinstance(cfg, dict):
        return STANDARD, "no readable target config"
    layers = [cfg] + ([cfg["text_config"]] if isinstance(cfg.get("text_config"), dict) else [])
    for key, table in (("architectures", _ARCHS), ("model_type", _MODEL_TYPES)):
        for c in layers:
            for name in _strings(c.get(key)):
                for fam, names in table.items():
                    if name in names:
                        return fam, f"{key} {name}"
    return STANDARD, "no DeepSeek-family, GPT-OSS or MiniMax-M3-VL architecture or model_type"


def target_family(cfg) -> str:
    """The SGLang layer-id family of a target config.json dict (HF, nested text_config, or the
    dict runner.target_config reads from a GGUF header): one of FAMILIES. Never raises."""
    return family_evidence(cfg)[0]
