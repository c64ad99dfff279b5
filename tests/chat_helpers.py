"""Tiny HF target folders for tests: the real geometry of a family (config.json), a byte-level
BPE tokenizer without merges (every UTF-8 byte is one token, plus the family's special tokens)
and the family's published chat template (tests/data/templates/, README there). No weights, no
hub access; building one takes ~50 ms."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "templates"

# family -> {"template" (file in TEMPLATES), "bos", "eos", "specials" (the family's special
# tokens), "config" (its config.json: the published geometry of Llama-3.1-8B-Instruct, Qwen3-8B,
# Qwen2.5-7B-Instruct, SmolLM2-135M-Instruct)}
FAMILIES = json.loads((Path(__file__).parent / "data" / "targets.json").read_text())


def template_text(family: str) -> str:
    return (TEMPLATES / FAMILIES[family]["template"]).read_text()


def write_tokenizer(folder: Path, family: str, chat_template: str | None = "auto") -> None:
    """tokenizer.json + tokenizer_config.json of `family` into `folder` (chat_template "auto" =
    the family's published template; None = no template)."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    fam = FAMILIES[family]
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(fam["specials"])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": fam["eos"],
           "bos_token": fam["bos"], "model_max_length": fam["config"]["max_position_embeddings"]}
    if chat_template:
        cfg["chat_template"] = template_text(family) if chat_template == "auto" else chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def make_target(folder: Path, family: str, chat_template: str | None = "auto") -> Path:
    """An HF folder for `family` (FAMILIES): config.json + tokenizer files, no weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(FAMILIES[family]["config"], indent=1))
    write_tokenizer(folder, family, chat_template)
    return folder


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))
