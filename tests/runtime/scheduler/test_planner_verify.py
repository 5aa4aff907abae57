"""The planner's speculative path without processes: what each verify may check, the slots it
reserves ahead of positions it cannot know yet, and that accepted runs of any length, retraction
and overlap leave exact outputs and no leaked slot."""
from __future__ import annotations

import pytest

from tests.runtime.scheduler.fake_worker import fake_token, make_core
from tandem.runtime.model.forward_batch import ForwardMode


def test_first_verify_is_planned_before_the_prefill_ran():
    core = make_core(speculative_num_drafts=3)
    req = core.add("a", 10, max_new_tokens=20)
    prefill = core.plan()
    assert prefill.mode == ForwardMode.EXTEND and prefill.job.spec.histories == [req.all_ids()]
    assert req.outputs_in_flight == 1 and req.kv.committed_len == req.kv.alloc_len == 10
    verify = core.plan()  # overlap: the prefill's token is not known yet
    assert verify.mode == ForwardMode.TARGET_VERIFY and verify.spans[0].drafts == 3
    # the last token sits at position 10 at the latest: the run may reach 13
    assert req.kv.alloc_len == 14 and req.kv.committed_len == 10 and req.outputs_in_flight == 5
    core.process(prefill)
    assert req.output_ids == [fake_token(10)] and req.kv.committed_len == 10
    core.process(verify)
    n = len(req.output_ids)
    assert req.output_ids == [fake_token(10 + i) for i in range(n)] and req.kv.committed_len == 10 + n - 1


def test_a_draft_model_gets_slots_past_each_run():
    """STANDALONE drafts write draft KV for K - 1 positions past the last token, right after the
    prefill and after every verify: those slots are reserved with the step, never committed."""
    core = make_core(speculative_num_drafts=3, speculative_draft_ahead=3)
    req = core.add("a", 10, max_new_tokens=20)
    prefill = core.plan()
    assert prefill.job.spec.make_drafts == [True]
    assert req.kv.alloc_len == 13 and req.kv.committed_len == 10
    core.plan()
    assert req.kv.alloc_len == 10 + 1 + 3 + 3 and req.kv.committed_len == 10
    short = make_core(speculative_num_drafts=3, speculative_draft_ahead=3)
    r = short.add("b", 10, max_new_tokens=2)
    short.plan()
    assert r.kv.alloc_len == 12  # never past prompt + max_new_tokens


def test_what_may_draft():
    core = make_core(speculative_num_drafts=4, max_running_requests=8)
    plain = core.add("plain", 6, max_new_tokens=30)
    pen = core.add("pen", 6, max_new_tokens=30, frequency_penalty=0.5)
    min_new = core.add("min", 6, max_new_tokens=30, min_new_tokens=3)
    short = core.add("short", 6, max_new_tokens=3)
    hidden = core.add("hidden", 6, max_new_tokens=30, return_hidden_states=True)
    core.process(core.plan())
    drafts = {s.req.rid: s.drafts for s in core.plan().spans}
    # one output so far; "short" may add at most two more, the last one being the bonus
    assert drafts == {"plain": 4, "pen": 0, "min": 0, "short": 1, "hidden": 0}
    assert plain.outputs_in_flight == 5 and short.outputs_in_flight == 2 and pen.outputs_in_flight == 1
    assert min_new.outputs_in_flight == hidden.outputs_in_flight == 1


def test_above_the_disable_batch_size_nobody_drafts():
    core = make_core(speculative_num_drafts=4, speculative_disable_batch_size=2, max_running_requests=8)
    for i in range(3):
        core.add(f"r{i}", 6, max_new_tokens=30)
    prefill = core.plan()
    assert prefill.job.spec.make_drafts == [False] * 3
    core.process(prefill)
    verify = core.plan()
    assert [s.drafts for s in verify.spans] == [0, 0, 0] and verify.job.spec.max_drafts == [0, 0, 0]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("retract_every", [0, 3])
def test_runs_of_any_length_with_retraction_are_exact_and_leak_nothing(overlap, retract_every):
    core = make_core(max_total_tokens=400, max_running_requests=6, speculative_num_drafts=3,
                     force_retract_every=retract_every)
    reqs = [core.add(f"r{i}", 5 + 3 * i, max_new_tokens=9 + 5 * i) for i in range(6)]
    core.run(overlap=overlap)
    for r in reqs:
        prompt = len(r.origin_input_ids)
        assert r.output_ids == [fake_token(prompt + i) for i in range(r.sampling_params.max_new_tokens)], r.rid
        assert r.outputs_in_flight == 0
    assert any(kept > 1 for _, kept in core.verify_runs)  # multi-token runs happened
    assert all(kept <= drafts + 1 for drafts, kept in core.verify_runs)
    if retract_every:
        assert core.planner.num_retractions > 0
    core.assert_no_leaks()
