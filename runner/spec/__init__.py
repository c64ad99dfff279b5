"""The spec: one YAML file that declares a drafter pipeline, validated by Pydantic v2.

- runner/spec/base.py: the strict base model (unknown keys are errors) and the name pattern.
- runner/spec/schema.py: the schema (target, drafter, data, executor, results, variants) and the
  cross-field rules of the whole spec. The stage blocks and their order live in the stage
  registry, runner/stages.py; the SGLang layout rules the spec applies in runner/drafts/.
- runner/spec/load.py: YAML (safe loader, no duplicate keys, no alias bombs), `-o a.b=value`
  overrides, variants and reading the target's geometry: `load_spec`, the one entry point.
- runner/spec/messages.py: Pydantic errors -> (field path, message) pairs with "did you mean".

Nothing here imports torch: `runner validate` and `runner plan` stay fast.
"""
