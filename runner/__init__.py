"""EAGLE-3 drafter pipelines from one validated YAML spec. Importable without torch."""
