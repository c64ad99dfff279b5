"""The SGLang engine's request window (engine/sglang_generate.py): refilled from the call threads
while the caller's host work runs, never above `rows`, with the same answers and records, against
recorded SGLang responses replayed over HTTP at a pace (tests/sglang_target_replay.py: each
result sent after its answer's length in time, so requests finish one by one as on a server)."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_target_replay import Replay, fixtures
from eagle3_runner.runner.engines import GENERATE

PACE = 0.01  # seconds per output token: the recorded answers finish 10-80 ms after their call


@pytest.fixture
def paced(request):
    r = Replay(request.param, pace=PACE)
    yield r
    r.close()


@pytest.mark.parametrize("paced", fixtures("generate"), indirect=True, ids=lambda p: p.name)
def test_the_window_is_refilled_while_on_done_runs(paced):
    """While the caller's thread is held in on_done (its host work: decoding, rendering the next
    turns), the slots that free up are refilled from the requests drawn ahead: the replay holds
    `rows` requests again before on_done returns. Never more than `rows`, every answer as
    recorded, and the host time counted in the window's stats."""
    from eagle3_runner.engine.generate import Request
    from eagle3_runner.engine.sglang_generate import SglangGenerator, window_metrics
    from eagle3_runner.targets.sglang_target import TargetServer
    recs = paced.fx["generate"]
    srv = TargetServer(paced.url, GENERATE, timeout=10.0, per_call=2)
    rows, n = 4, 24
    gen = SglangGenerator(srv, rows=rows, max_new=max(r["sampling_params"]["max_new_tokens"]
                                                      for r in recs))
    got, refilled, held = {}, threading.Event(), [0.0]

    def on_done(results):
        for r in results:
            got[r.key] = r
        if len(got) == len(results):  # the first results: hold the host until the window refills
            t0 = time.perf_counter()
            while paced.live < rows and time.perf_counter() - t0 < 5.0:
                time.sleep(0.002)
            if paced.live == rows:
                refilled.set()
            held[0] = time.perf_counter() - t0
        return None
    reqs = (Request(i, recs[i % len(recs)]["input_ids"],
                    recs[i % len(recs)]["sampling_params"]["max_new_tokens"]) for i in range(n))
    st = gen.run(reqs, on_done)
    assert refilled.is_set(), "the window waited for on_done to return"
    assert paced.max_live == rows and paced.live == 0
    assert sorted(got) == list(range(n))
    for i, r in got.items():
        assert r.tokens == recs[i % len(recs)]["result"]["output_ids"]
    w = st["window"]
    assert w["host_s"] >= held[0] > 0
    assert 0 < w["in_flight_s"] <= rows * st["seconds"] + 1e-6 and w["tail_s"] >= 0
    m = window_metrics([st, None, {"window": None}], st["seconds"])
    assert 0 < m["sglang_in_flight_mean"][0] <= rows
    assert m["sglang_host_share"][0] >= held[0] / st["seconds"]
    assert window_metrics([{"new_tokens": 1}], 1.0) == {}  # the embedded engine's stats


@pytest.mark.parametrize("paced", fixtures("generate"), indirect=True, ids=lambda p: p.name)
def test_regenerate_through_a_paced_server_keeps_its_window_and_writes_the_same_records(
        paced, tmp_path):
    """regenerate() through the paced replay: the same records as through the unpaced one (every
    turn answered as recorded), `batch_size` requests in flight at most and at some point, and
    the window's metrics among the stage's."""
    from eagle3_runner.data.regen_store import read_records
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer
    from eagle3_runner.targets.sglang_target import TargetServer
    meta = paced.fx["meta"]
    tok = load_tokenizer(asset_path("smollm2"))
    stop = end_of_turn_ids(asset_path("smollm2"), tok)
    p = RegenerateStage(**meta["params"])
    out = {}
    for name, pace in (("paced", PACE), ("at_once", 0.0)):
        paced.pace = pace
        srv = TargetServer(paced.url, GENERATE, timeout=10.0, per_call=2)
        m = regenerate(None, tok, meta["conversations"], p, meta["max_length"], tmp_path / name,
                       gen=SglangGenerator(srv, p.batch_size, p.max_new_tokens), progress=False,
                       stop_ids=stop)
        out[name] = (m, sorted(read_records(tmp_path / name), key=lambda r: r["id"]))
        if name == "paced":
            assert paced.max_live == p.batch_size
    (m, recs), (_, ref) = out["paced"], out["at_once"]
    assert recs == ref  # the same conversations, answers and counters
    assert 0 < m["sglang_in_flight_mean"][0] <= p.batch_size
    assert 0 <= m["sglang_short_share"][0] <= 1 and 0 < m["sglang_host_share"][0] < 1
