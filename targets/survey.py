"""What `runner init --data` reads of the user's data before it writes a spec: the records, counted
by the stages' own reader and cleaner (data/records.py, data/conversations.py: malformed,
truncated, too deep, unknown roles, ... and the records cleaned away), and the distinct
SUPERVISED tokens (assistant tokens under the target's own chat template and loss mask,
data/chat.py tokenize_dataset, as extract and train count them; trainer/vocab.py) that size the
draft vocabulary.

runner/init.py (the torch-free ground floor) runs this as a child process,

    python -m eagle3_runner.targets.survey --target T --data D [--template auto] [--max-length N]

which prints one JSON object: the drop report of the first SURVEY_BYTES of the data (the whole
file when it is smaller; "whole" says which), "tokenized" conversations (at most
SURVEY_CONVERSATIONS), "distinct_supervised", "supervised_tokens", "template", and
"tokenizer_error" when the tokenizer could not be read (the records part stands alone), or
{"error": ...} for data that cannot be read at all. Only the tokenizer is loaded (a GGUF's from
its header, targets/load.py tokenizer_only), never the weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3_runner.runner.errors import RunnerError

SURVEY_BYTES = 64 << 20  # of decompressed text: most fine-tuning sets whole, a head of the rest
SURVEY_CONVERSATIONS = 4000  # tokenized for the distinct-token count


def survey(target: Path, data: Path, template: str = "auto", max_length: int = 2048,
           trust_remote_code: bool = False) -> dict:
    """The module docstring's JSON object for `data` under the tokenizer of `target`. Raises
    StageError when the data cannot be read."""
    from eagle3_runner.data.chat import tokenize_dataset
    from eagle3_runner.data.conversations import conversations_from_records
    from eagle3_runner.data.records import read_records_head
    from eagle3_runner.targets.load import tokenizer_only
    records, info = read_records_head(Path(data), SURVEY_BYTES)
    convs, rep = conversations_from_records(records, {"path": str(data), **info})
    out = {k: rep[k] for k in ("records_seen", "records_read", "clean", "dropped", "unusable",
                               "unusable_records", "bad_fraction", "examples", "format",
                               "compression")}
    out["whole"] = info["whole"]
    if not convs:
        return out
    try:
        tok = tokenizer_only(Path(target), trust_remote_code)
        samples, trep = tokenize_dataset(tok, convs[:SURVEY_CONVERSATIONS], template, max_length)
    except RunnerError as e:
        return {**out, "tokenizer_error": str(e)}
    seen = {i for ids, mask in samples for i, m in zip(ids, mask) if m}
    return {**out, "tokenized": trep["tokenized"], "all_tokenized": len(convs) <=
            SURVEY_CONVERSATIONS, "template": trep["template"], "distinct_supervised": len(seen),
            "supervised_tokens": trep["supervised_tokens"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3_runner.targets.survey")
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--template", default="auto")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--trust-remote-code", action="store_true")
    a = ap.parse_args(argv)
    try:
        res = survey(Path(a.target), Path(a.data), a.template, a.max_length, a.trust_remote_code)
    except RunnerError as e:
        res = {"error": str(e)}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
