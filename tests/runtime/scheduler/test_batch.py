"""Batch building without processes: input ids, which spans sample, the prompt rows each extend
pass must report (input logprobs, hidden states), penalties, and what the prefix cache may skip."""
from __future__ import annotations

import torch
from tests.runtime.scheduler.fake_worker import EOS, VOCAB, make_core

from tandem.ipc.messages import LogprobParams
from tandem.runtime.scheduler import batch as batch_module
from tandem.runtime.scheduler.batch import BatchContext, _logit_bias

real_ban_mask = batch_module._ban_mask


def test_prompt_logprob_and_hidden_rows_are_split_over_chunks():
    core = make_core(chunked_prefill_size=4)
    lp = LogprobParams(return_logprob=True, logprob_start_len=3, top_logprobs_num=2, token_ids_logprob=(7,))
    req = core.add("r", 10, logprob=lp, return_hidden_states=True)
    prompt = req.origin_input_ids
    chunks = []
    while (batch := core.plan()) is not None and batch.job.input_ids is not None:
        chunks.append(batch)
        core.rows.on_processed(batch.step_id)  # rows only; the prompt-row cursors move at processing
    lp_tasks = [(t.first_pos, t.n, t.token_offset, t.next_ids) for b in chunks for t in b.job.input_logprob_tasks]
    # logits row i predicts prompt token i + 1: rows [3, 9) report positions [4, 10); position 3,
    # the first reported, is None as in SGLang, so row 2 is not needed
    assert lp_tasks == [(3, 1, 3, prompt[4:5]), (4, 4, 0, prompt[5:9]), (8, 1, 0, prompt[9:10])]
    assert all(t.top_logprobs_num == 2 and t.token_ids_logprob == (7,) for b in chunks for t in b.job.input_logprob_tasks)
    hidden = [(t.first_pos, t.n, t.token_offset) for b in chunks for t in b.job.prompt_hidden_tasks]
    # hidden rows of prompt positions [3, 9); position 9's row samples output 0 and is an output row
    assert hidden == [(3, 1, 3), (4, 4, 0), (8, 1, 0)]
    assert [b.job.sample_indices for b in chunks] == [[], [], [0]]
    assert chunks[-1].job.top_logprobs_nums == [2] and chunks[-1].job.return_hidden == [True]


def test_the_prefix_cache_never_skips_positions_that_must_be_reported():
    core = make_core()
    prompt = list(range(200, 212))
    core.add("warm", prompt, max_new_tokens=1)
    core.run()  # the whole prompt is now cached
    plain = core.add("plain", prompt, max_new_tokens=1)
    lp = core.add("lp", prompt, max_new_tokens=1, logprob=LogprobParams(return_logprob=True, logprob_start_len=5))
    hidden = core.add("hid", prompt, max_new_tokens=1, logprob=LogprobParams(logprob_start_len=7),
                      return_hidden_states=True)
    out_only = core.add("out", prompt, max_new_tokens=1, logprob=LogprobParams(return_logprob=True))
    assert plain.first_uncacheable_position() == 11  # the last token is always computed
    # position 5 is reported as None (SGLang); logits row 5 gives position 6's logprob
    assert lp.first_uncacheable_position() == 5
    assert hidden.first_uncacheable_position() == 7
    assert out_only.first_uncacheable_position() == 11
    batch = core.plan()
    assert {s.req.rid: s.prefix_len for s in batch.spans} == {"plain": 11, "lp": 5, "hid": 7, "out": 11}
    assert plain.cached_tokens == 11 and lp.cached_tokens == 5


def test_penalties_min_new_tokens_bans_and_logit_bias():
    core = make_core()
    a = core.add("a", 3, min_new_tokens=2, stop_token_ids=[9])
    b = core.add("b", 3, logit_bias={5: 1.5}, frequency_penalty=0.5)
    c = core.add("c", 3)
    batch = core.plan()
    pen = batch.job.penalties
    assert pen is not None and pen.counts_active
    # stop ids and EOS are banned until min_new_tokens, even under ignore_eos (the test core's
    # default); rows past it ban nothing
    assert _banned(pen.ban_mask) == [sorted([9, EOS]), [], []]
    assert pen.logit_bias[1, 5] == 1.5 and pen.logit_bias[0].abs().sum() == 0
    assert pen.frequency.tolist() == [0.0, 0.5, 0.0]
    assert [a.kv.req_pool_idx, b.kv.req_pool_idx, c.kv.req_pool_idx] == batch.job.rows


def test_min_new_tokens_bans_eos_with_or_without_ignore_eos():
    # SGLang's min_new_tokens penalizer never looks at ignore_eos: the first tokens are not EOS
    core = make_core()
    core.add("eos", 3, min_new_tokens=1, ignore_eos=False)
    core.add("ignoring", 3, min_new_tokens=1, ignore_eos=True)
    assert _banned(core.plan().job.penalties.ban_mask) == [[EOS], [EOS]]


def test_plain_requests_build_no_penalty_or_logprob_work():
    core = make_core()
    core.add("a", 3)
    job = core.plan().job
    assert job.penalties is None and job.top_logprobs_nums is None and job.return_hidden is None
    assert job.input_logprob_tasks == [] and job.prompt_hidden_tasks == []


def _banned(ban_mask: torch.Tensor) -> list[list[int]]:
    return [sorted(torch.nonzero(row).flatten().tolist()) for row in ban_mask]


def _decode_steps(core, steps: int) -> list:
    batches = []
    for _ in range(steps):
        batch = core.plan()
        batches.append(batch)
        core.process(batch)
    return batches


def test_logit_bias_is_built_once_while_the_batch_keeps_its_requests():
    # rebuilt every step, a full-vocabulary bias was scattered again at every decode step
    core = make_core()
    core.add("biased", 3, max_new_tokens=20, logit_bias={i: 0.5 for i in range(VOCAB)})
    core.add("plain", 3, max_new_tokens=20)
    biases = [b.job.penalties.logit_bias for b in _decode_steps(core, 6)]
    assert all(b is biases[0] for b in biases[1:])
    late = core.add("late", 3, max_new_tokens=20, logit_bias={5: 2.0})
    decode = _decode_steps(core, 3)[-1]  # after the late request's prefill, all three decode
    bias = decode.job.penalties.logit_bias  # a new row: a new bias
    assert bias is not biases[0] and bias.shape[0] == 3 and bias[decode.sampling_reqs.index(late), 5] == 2.0


def test_the_kept_logit_bias_equals_a_fresh_build_as_requests_come_and_go():
    core = make_core()
    ctx = BatchContext(VOCAB, (EOS,), torch.device("cpu"))
    arrivals = {0: [("a", 5, {3: 1.0}), ("b", 9, None)], 2: [("c", 4, {4: -2.0, 6: 0.25})],
                4: [("d", 7, {3: 3.0})], 12: [("e", 3, None)], 14: [("f", 2, {9: 1.5})]}
    checked = 0
    for step in range(40):
        for rid, max_new, bias in arrivals.get(step, []):
            core.add(rid, 3, max_new_tokens=max_new, logit_bias=bias)
        if (batch := core.plan()) is None:
            continue
        reqs, pen = batch.sampling_reqs, batch.job.penalties
        if any(r.logit_bias is not None for r in reqs):
            assert torch.equal(pen.logit_bias, _logit_bias(reqs, ctx)), step
            checked += 1
        else:
            assert pen is None or pen.logit_bias is None
        core.process(batch)
    assert checked > 10 and len(core.finished) == 6


def test_rows_past_min_new_tokens_ban_nothing():
    core = make_core()
    core.add("biased", 3, max_new_tokens=8, logit_bias={5: 1.0}, stop_token_ids=list(range(100, VOCAB)))
    core.add("under", 3, max_new_tokens=8, min_new_tokens=3, stop_token_ids=[9])
    bans = [b.job.penalties.ban_mask for b in _decode_steps(core, 6)]
    assert all(_banned(mask)[0] == [] and _banned(mask)[1] == sorted([9, EOS]) for mask in bans if mask is not None)
    assert any(mask is not None for mask in bans) and any(mask is None for mask in bans)


def test_the_ban_mask_is_built_once_while_the_batch_keeps_its_requests(monkeypatch):
    # rebuilt every step, 8 rows under min_new_tokens with 49k stop_token_ids made each decode step
    # of the tiny server 13x slower (61 s against 4.75 s)
    builds = []
    monkeypatch.setattr(batch_module, "_ban_mask", lambda *a: builds.append(1) or real_ban_mask(*a))
    core = make_core()
    core.add("a", 3, max_new_tokens=20, min_new_tokens=12, stop_token_ids=list(range(100, VOCAB)))
    core.add("b", 3, max_new_tokens=20, min_new_tokens=12)
    masks = [b.job.penalties.ban_mask for b in _decode_steps(core, 8)]
    assert all(m is masks[0] for m in masks[1:]) and len(builds) == 1
    late = core.add("late", 3, max_new_tokens=20, min_new_tokens=4, stop_token_ids=[7])
    decode = _decode_steps(core, 3)[-1]  # after the late request's prefill, all three decode
    mask = decode.job.penalties.ban_mask  # a new row: a new mask
    assert mask is not masks[0] and _banned(mask)[decode.sampling_reqs.index(late)] == sorted([7, EOS])


def test_the_kept_ban_mask_equals_a_fresh_build_as_requests_come_and_go():
    core = make_core()
    ctx = BatchContext(VOCAB, (EOS,), torch.device("cpu"))
    arrivals = {0: [("a", 9, 5, [3]), ("b", 12, 0, [4])], 2: [("c", 6, 4, [6, 8])],
                5: [("d", 10, 7, [])], 9: [("e", 4, 2, [11])]}
    checked = 0
    for step in range(40):
        for rid, max_new, min_new, stops in arrivals.get(step, []):
            core.add(rid, 3, max_new_tokens=max_new, min_new_tokens=min_new, stop_token_ids=stops)
        if (batch := core.plan()) is None:
            continue
        reqs, pen = batch.sampling_reqs, batch.job.penalties
        under = [len(r.output_ids) < r.sampling_params.min_new_tokens for r in reqs]
        if any(under):
            assert torch.equal(pen.ban_mask, real_ban_mask(reqs, under, ctx)), step
            checked += 1
        else:
            assert pen is None or pen.ban_mask is None
        core.process(batch)
    assert checked > 8 and len(core.finished) == 5


