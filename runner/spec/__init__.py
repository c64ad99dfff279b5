"""The spec: one YAML file that declares a drafter pipeline, validated by Pydantic v2.

- runner/spec/base.py: the strict base model (unknown keys are errors) and the name pattern.
- runner/spec/schema.py: the whole spec (`Spec`) and the cross-field rules between its sections;
  `PATH_FIELDS`, the spec's paths.
- runner/spec/sections.py: the sections, each validating itself (target, drafter, data,
  executor, results, variants).
- runner/spec/stage_blocks.py: the stages' blocks (`stages.<name>`); their order and the
  `stages` section come from the stage registry, runner/stages.py. The SGLang layout rules the
  spec applies live in runner/drafts/.
- runner/spec/load.py: YAML (safe loader, no duplicate keys, no alias bombs), `-o a.b=value`
  overrides, variants and reading the target's geometry: `load_spec`, the one entry point.
- runner/spec/messages.py: Pydantic errors -> (field path, message) pairs with "did you mean".

Nothing here imports torch: `runner validate` and `runner plan` stay fast.
"""
