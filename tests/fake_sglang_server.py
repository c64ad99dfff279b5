"""Stands in for `python -m sglang.launch_server` in the launcher's CPU test
(tests/test_sglang_target.py): parses --port, writes its argv and the capture environment to
$FAKE_SGLANG_LOG, and serves the recorded responses of $FAKE_SGLANG_FIXTURE (tests/sglang_target_replay.py,
the file transport's rows into $EAGLE3_CAPTURE_SINK) plus /health on that port until killed."""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_target_replay import Replay  # noqa: E402

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
Path(os.environ["FAKE_SGLANG_LOG"]).write_text(json.dumps({
    "argv": args, "env": {k: v for k, v in os.environ.items()
                          if k.startswith(("EAGLE3_CAPTURE", "SGLANG_"))}}))
sink = os.environ.get("EAGLE3_CAPTURE_SINK")
r = Replay(Path(os.environ["FAKE_SGLANG_FIXTURE"]), Path(sink) if sink else None, port=port)
while True:
    time.sleep(1)
