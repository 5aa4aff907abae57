"""The bare model loop's KV bookkeeping: decode slots taken in runs, as the scheduler takes them,
and every slot back in the allocator once a generation ends."""
from __future__ import annotations

import pytest

from tandem.runtime.cache.pools import DECODE_SLOT_RUN
from tandem.launch.bare_loop import BareLoop
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs


@pytest.fixture(scope="module")
def runner(tiny_model_dir) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=tiny_model_dir("llama"), max_total_tokens=400, max_running_requests=4,
                                  dtype="float32"))


def test_decode_slots_come_in_runs_and_go_back(runner):
    loop, prompts = BareLoop(runner), [list(range(300, 310)), list(range(500, 507))]
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    lens = [len(p) for p in prompts]
    ids = loop.prefill(prompts, rows).argmax(-1)
    last_positions = [len(p) + 2 * DECODE_SLOT_RUN for p in prompts]
    for _ in range(DECODE_SLOT_RUN + 2):
        ids = loop.decode(ids, rows, lens, last_positions).argmax(-1)
        lens = [n + 1 for n in lens]
    for row, prompt in zip(rows, prompts):
        run = runner.req_to_token_pool.req_to_token[row, len(prompt):len(prompt) + DECODE_SLOT_RUN].tolist()
        assert run == list(range(run[0], run[0] + DECODE_SLOT_RUN))
    loop.release(rows, lens)  # frees the reserved rest of the second runs too
    assert runner.allocator.available_size() == runner.max_total_tokens


def test_generate_reserves_no_slot_past_its_last_input(runner):
    loop = BareLoop(runner)
    free = runner.allocator.available_size()
    # 10 prompt tokens and 5 outputs: positions 0..13 hold KV, so 14 slots fill 14 of 14 free ones
    hog = runner.allocator.alloc(free - 14)
    try:
        out = loop.generate([list(range(300, 310))], 5).output_ids
    finally:
        runner.allocator.free(hog)
    assert len(out[0]) == 5 and runner.allocator.available_size() == free
