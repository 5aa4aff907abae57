"""Scheduler pieces without processes: queue policies, finish checks and the output streamer's cursors."""
from __future__ import annotations

import time

import numpy as np
import torch

from tandem.ipc.messages import LogprobArrays, LogprobParams, SpecCounts, TokenizedGenerateReq
from tandem.runtime.cache.pools import TokenAllocator
from tandem.runtime.cache.radix import RadixCache
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.scheduler.output_streamer import OutputStreamer
from tandem.runtime.scheduler.policy import SchedulePolicy
from tandem.runtime.scheduler.request import Req
from tandem.runtime.scheduler.think import ReasoningState
from tandem.runtime.scheduler.result_processor import (STOP_REGEX_TIMEOUT_S, FinishChecker, apply_new_tokens,
                                                       tail_ids)


def _req(seq: int, ids=(1, 2, 3), priority: int = 0, stream: bool = False, **sp) -> Req:
    msg = TokenizedGenerateReq(rid=f"r{seq}", input_ids=np.asarray(ids, np.int32), sampling_params=SamplingParams(**sp),
                               stream=stream, priority=priority,
                               logprob=LogprobParams(return_logprob=True))
    return Req.from_message(msg, seq, default_seed=seq)


def test_fcfs_priority_and_lpm_ordering():
    tree = RadixCache(TokenAllocator(64))
    a, b, c = _req(1, priority=1), _req(2, priority=9), _req(3, ids=(7, 8, 9, 10), priority=1)
    waiting = [c, b, a]
    SchedulePolicy("fcfs", False, tree).sort(waiting)
    assert waiting == [a, b, c]
    SchedulePolicy("fcfs", True, tree).sort(waiting)
    assert waiting == [b, a, c]
    tree.insert([7, 8, 9], torch.tensor([1, 2, 3]))
    SchedulePolicy("lpm", False, tree).sort(waiting)
    assert waiting[0] is c  # longest cached prefix first
    assert SchedulePolicy("fcfs", True, tree).retract_order([a, b, c])[0] is c  # lowest priority, newest


def test_finish_checks_length_stop_token_and_trimming():
    checker = FinishChecker([2], lambda ids: "".join(chr(97 + i % 26) for i in ids))
    r = _req(1, max_new_tokens=3)
    assert not apply_new_tokens(r, [5], None, None, checker)
    assert apply_new_tokens(r, [6, 7, 8], None, None, checker)  # a multi-token run is trimmed at the limit
    assert r.output_ids == [5, 6, 7] and r.finished_reason.type == "length"
    r = _req(2, max_new_tokens=10)
    assert apply_new_tokens(r, [4, 2, 9], None, None, checker)
    assert r.output_ids == [4, 2] and r.finished_reason.matched == 2
    r = _req(3, max_new_tokens=10, ignore_eos=True, stop=["cd"])
    assert apply_new_tokens(r, [0, 1, 2, 3, 4], None, None, checker) and r.output_ids == [0, 1, 2, 3]
    assert r.finished_reason.matched == "cd"
    r = _req(4, max_new_tokens=10, min_new_tokens=3)
    assert not apply_new_tokens(r, [2], None, None, checker)  # eos before min_new_tokens does not stop


def test_stop_strings_count_inside_min_new_tokens_and_ignore_eos_silences_stop_ids():
    """SGLang's check_finished: a stop string ends the request whenever it is written (only stop
    tokens wait for min_new_tokens, banned by the sampler), and ignore_eos turns off stop token ids
    as well as EOS."""
    checker = FinishChecker([2], lambda ids: "".join(chr(97 + i % 26) for i in ids))
    r = _req(6, max_new_tokens=10, min_new_tokens=5, ignore_eos=True, stop=["cd"])
    assert apply_new_tokens(r, [2, 3, 9], None, None, checker)
    assert r.output_ids == [2, 3] and r.finished_reason.matched == "cd"
    r = _req(7, max_new_tokens=10, ignore_eos=True, stop_token_ids=[7])
    assert not apply_new_tokens(r, [5, 7, 2, 9], None, None, checker) and r.output_ids == [5, 7, 2, 9]
    r = _req(8, max_new_tokens=10, stop_token_ids=[7])
    assert apply_new_tokens(r, [5, 7, 9], None, None, checker) and r.finished_reason.matched == 7


class _CountedList(list):
    """A list that counts the element-by-element reads of it."""

    reads = 0

    def __contains__(self, x: object) -> bool:
        type(self).reads += 1
        return super().__contains__(x)

    def __iter__(self):
        type(self).reads += 1
        return super().__iter__()


def test_stop_token_ids_are_read_once_per_request_not_per_token():
    # a list of the whole vocabulary was scanned at every output token, on the scheduler thread
    checker = FinishChecker([2], lambda ids: "")
    stop_ids = _CountedList(range(100, 49152))
    r = _req(9, max_new_tokens=300, stop_token_ids=stop_ids)
    reads_at_start = _CountedList.reads
    for tok in range(3, 99):
        assert not apply_new_tokens(r, [tok], None, None, checker)
    assert _CountedList.reads == reads_at_start
    assert apply_new_tokens(r, [5000], None, None, checker) and r.finished_reason.matched == 5000


class _CopyCountingList(list):
    """An output list that counts the elements copied out of it by + and slicing."""

    copied = 0

    def __add__(self, other):
        type(self).copied += len(self)
        return list(self) + other

    def __getitem__(self, i):
        got = super().__getitem__(i)
        if isinstance(i, slice):
            type(self).copied += len(got)
        return got


def test_the_stop_checks_copy_only_the_tail_of_a_long_output():
    # joining output and new tokens before cutting the tail copied the whole output every token
    checker = FinishChecker([2], lambda ids: "".join(chr(97 + i % 26) for i in ids))
    r = _req(10, max_new_tokens=20000, ignore_eos=True, stop=["zz"], stop_regex=["q{2}"])
    r.output_ids = _CopyCountingList(range(3, 10003))
    for tok in (4, 5, 6):
        assert checker.finished_len(r, [tok]) == (1, None)
    assert 0 < _CopyCountingList.copied <= 3 * (r.stop_window + r.stop_regex_window)


def test_tail_ids_is_the_tail_of_output_and_new_tokens():
    for n_out in range(5):
        for n_new in range(4):
            for window in range(1, 10):
                out, new = list(range(n_out)), list(range(100, 100 + n_new))
                assert tail_ids(out, new, window) == (out + new)[-window:], (n_out, n_new, window)


def test_stop_regex_ends_at_the_token_that_completes_a_match_and_names_the_pattern():
    """SGLang's stop_regex: re.search over the output's tail each token; `matched` is the pattern.
    An unbounded pattern searches the whole output; a bounded one only the tail it can span."""
    checker = FinishChecker([2], lambda ids: "".join(chr(97 + i % 26) for i in ids))
    r = _req(9, max_new_tokens=20, ignore_eos=True, stop_regex=["z", "c+d"])
    assert not apply_new_tokens(r, [0, 1, 2], None, None, checker)  # "abc": no d yet
    assert apply_new_tokens(r, [2, 3, 4], None, None, checker)  # "abccde": "ccd" ends at the d
    assert r.output_ids == [0, 1, 2, 2, 3] and r.finished_reason.matched == "c+d"
    r = _req(10, max_new_tokens=20, ignore_eos=True, stop_regex=["a.*f"])
    assert apply_new_tokens(r, list(range(6)), None, None, checker) and r.output_ids == list(range(6))
    r = _req(11, max_new_tokens=10, ignore_eos=True, stop_regex=["q"])
    assert not apply_new_tokens(r, [0, 1, 2], None, None, checker) and r.finished_reason is None


def test_a_stop_regex_that_backtracks_catastrophically_ends_its_request_with_a_400():
    # with `re`, each search of "(a|aa)+c" over n a's takes ~1.6x the last: 36 took 13 s of the
    # scheduler thread (60, hours), and every request froze with it
    checker = FinishChecker([2], lambda ids: "a" * len(ids))
    r = _req(12, max_new_tokens=100, ignore_eos=True, stop_regex=["(a|aa)+c"])
    assert not apply_new_tokens(r, [0] * 5, None, None, checker)  # a short tail searches quickly
    t0 = time.monotonic()
    assert apply_new_tokens(r, [0] * 31, None, None, checker)
    assert time.monotonic() - t0 < 20 * STOP_REGEX_TIMEOUT_S  # one timed-out search ends it
    reason = r.finished_reason
    assert (reason.type, reason.status_code, reason.field) == ("abort", 400, "sampling_params.stop_regex")
    assert "backtracks catastrophically" in reason.message and len(r.output_ids) < 36


def test_a_stop_regex_the_scheduler_cannot_compile_ends_its_request_with_a_400():
    # 200 nested groups: validation's shallower stack may compile what the scheduler's cannot; the
    # RecursionError used to kill the scheduler process
    checker = FinishChecker([2], lambda ids: "a" * len(ids))
    r = _req(13, max_new_tokens=10, ignore_eos=True, stop_regex=["(?:" * 200 + "b" + ")" * 200])
    assert apply_new_tokens(r, [0, 0], None, None, checker) and r.output_ids == []
    reason = r.finished_reason
    assert (reason.status_code, reason.field) == (400, "sampling_params.stop_regex")
    assert reason.message.startswith("does not compile: maximum recursion depth exceeded")


def test_the_last_allowed_token_ends_by_length_even_when_it_is_a_stop():
    # SGLang checks the length first: EOS, a stop token or a stop string at max_new_tokens is a length finish
    checker = FinishChecker([2], lambda ids: "".join(chr(97 + i % 26) for i in ids))
    for sp in ({}, {"stop_token_ids": [7]}, {"stop": ["bh"], "ignore_eos": True}):
        for last in (2, 7):
            r = _req(5, max_new_tokens=2, **sp)
            assert apply_new_tokens(r, [1, last], None, None, checker) and r.output_ids == [1, last]
            assert (r.finished_reason.type, r.finished_reason.length) == ("length", 2), (sp, last)


def _lp(token: int) -> LogprobArrays:
    return LogprobArrays(token_logprobs=np.array([-0.5], np.float32), token_ids=np.array([token], np.int32),
                         top_vals=np.zeros((1, 0), np.float32), top_idx=np.zeros((1, 0), np.int32),
                         ids_logprobs=np.zeros((1, 0), np.float32))


def test_streamer_cursors_stay_aligned_across_retraction_and_prefill_only():
    checker = FinishChecker([2], lambda ids: "")
    streamer = OutputStreamer(default_stream_interval=1)
    retracted = _req(1, stream=True, max_new_tokens=5)
    retracted.retract_count = 1  # retracted before it produced anything: nothing to send
    streamer.add(retracted)
    assert streamer.build() is None
    assert (retracted.cursor.tokens, retracted.cursor.logprobs) == (0, 0)
    apply_new_tokens(retracted, [9], [_lp(9)], None, checker)
    streamer.add(retracted)
    out = streamer.build()
    assert out.new_token_ids[0].tolist() == [9] and out.output_logprobs[0].token_ids.tolist() == [9]
    assert (retracted.cursor.tokens, retracted.cursor.logprobs) == (1, 1)
    prefill_only = _req(2, max_new_tokens=0)
    assert apply_new_tokens(prefill_only, [11], [_lp(11)], None, checker)
    streamer.add(prefill_only)
    out = streamer.build()
    assert out.new_token_ids[0].tolist() == [] and out.output_logprobs[0].token_logprobs.tolist() == [-0.5]
    assert (prefill_only.cursor.tokens, prefill_only.cursor.logprobs) == (0, 1)


def test_stream_interval_sends_the_first_token_at_once_then_every_interval():
    """SGLang's stream_output: with stream_interval k the chunks end at tokens 1, 1 + k, 1 + 2k."""
    checker = FinishChecker([2], lambda ids: "")
    streamer = OutputStreamer(default_stream_interval=1)
    r = _req(1, stream=True, max_new_tokens=20, stream_interval=3)
    sent_at = []
    for n, tok in enumerate(range(5, 12), start=1):
        apply_new_tokens(r, [tok], None, None, checker)
        streamer.add(r)
        if streamer.build() is not None:
            sent_at.append(n)
    assert sent_at == [1, 4, 7]


def test_per_request_constants_travel_only_with_the_first_output():
    checker = FinishChecker([2], lambda ids: "")
    streamer = OutputStreamer(default_stream_interval=1)
    r = _req(1, stream=True, max_new_tokens=5, stop=["x" * 1000])
    outs = []
    for tok in (7, 8, 9):
        apply_new_tokens(r, [tok], None, None, checker)
        streamer.add(r)
        outs.append(streamer.build())
    first, *rest = [o.detokenize_params[0] for o in outs]
    assert first is not None and first.stop_strings == ("x" * 1000,)
    assert rest == [None, None]


class _Matcher:
    """Accepts 5 then 6, and is complete after 6."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, tok: int) -> bool:
        if tok != [5, 6][len(self.accepted)]:
            return False
        self.accepted.append(tok)
        return True

    def is_terminated(self) -> bool:
        return self.accepted == [5, 6]


def test_a_complete_grammar_stops_the_request_and_trims_the_run():
    checker = FinishChecker([2], lambda ids: "")
    r = _req(1, max_new_tokens=10)
    r.grammar = _Matcher()
    assert apply_new_tokens(r, [5, 6, 7], None, None, checker)  # a multi-token run ends at the grammar's end
    assert r.output_ids == [5, 6] and r.finished_reason.to_json() == {"type": "stop", "matched": 6}
    r = _req(2, max_new_tokens=10)
    r.grammar = _Matcher()
    assert apply_new_tokens(r, [9], None, None, checker)  # a token the grammar refuses is a server bug: 500
    assert r.output_ids == [] and r.finished_reason.status_code == 500


def test_a_stop_string_ending_in_a_character_split_over_tokens_ends_the_request(smol_tokenizer):
    """An emoji or CJK character spans several byte-level tokens: the text before the last one ends
    in U+FFFD, which must not count as already written, and the window must hold all its tokens."""
    checker = FinishChecker([], smol_tokenizer.decode)
    for text, stop in [("party 🎉 time goes on", "🎉"), ("ok 日本語 then more", "日本語"), ("a 𝄞 b", "𝄞")]:
        ids = smol_tokenizer.encode(text)
        for step in (1, len(ids)):  # one token a step, and the whole run at once (a speculative verify)
            r = _req(8, max_new_tokens=64, ignore_eos=True, stop=[stop])
            for start in range(0, len(ids), step):
                if apply_new_tokens(r, ids[start:start + step], None, None, checker):
                    break
            assert r.finished_reason is not None and r.finished_reason.matched == stop, (text, step)
            assert smol_tokenizer.decode(r.output_ids).endswith(stop)


def test_low_priority_values_first_flips_the_order_and_the_default():
    """SGLang's --schedule-low-priority-values-first: smaller values run first, and a request that
    names no priority gets sys.maxsize (the least urgent) instead of -sys.maxsize - 1."""
    tree = RadixCache(TokenAllocator(64))
    one, nine, none_ = _req(1, priority=1), _req(2, priority=9), _req(3, priority=None)
    very_low = _req(4, priority=-(1 << 63))
    low_first = SchedulePolicy("fcfs", True, tree, low_values_first=True)
    waiting = [none_, nine, one, very_low]
    low_first.sort(waiting)
    assert waiting == [very_low, one, nine, none_]
    assert low_first.retract_order([one, nine, none_])[0] is none_
    waiting = [none_, nine, one, very_low]
    SchedulePolicy("fcfs", True, tree).sort(waiting)
    assert waiting == [nine, one, none_, very_low]  # none and -2**63 tie (SGLang's default): arrival order


def test_a_speculating_server_sends_spec_counts_for_every_request_even_before_a_verify():
    """Every output of a speculating server carries its request's counts, zeros too (the tokenizer
    manager shows them only on a finished answer with a verify, as SGLang); a plain server sends none."""
    checker = FinishChecker([2], lambda ids: "")
    zeros = SpecCounts(verify_ct=0, proposed=0, accepted=0, accept_histogram=[])
    for speculative, want in ((True, zeros), (False, None)):
        streamer = OutputStreamer(default_stream_interval=1, drafts_per_verify=3 if speculative else 0)
        r = _req(1, max_new_tokens=1)
        assert apply_new_tokens(r, [9], None, None, checker)
        streamer.add(r)
        assert [c.spec for c in streamer.build().counters] == [want]


def test_verify_counts_and_the_acceptance_histogram_travel_with_the_output():
    """SGLang's spec_accept_histogram: how many verifies accepted 0, 1, 2, ... drafts."""
    streamer = OutputStreamer(default_stream_interval=1, drafts_per_verify=3)
    r = _req(1, max_new_tokens=50)
    for accepted in (2, 1, 0, 0):
        r.spec.record_verify(accepted)
    streamer.add(r)
    r.finished_reason = FinishChecker([2], lambda ids: "").finished_len(r, [2])[1]
    out = streamer.build()
    assert [c.spec for c in out.counters] == [SpecCounts(verify_ct=4, proposed=12, accepted=3,
                                                        accept_histogram=[2, 1, 1])]


def test_retraction_counts_travel_with_every_output():
    """SGLang's meta_info.num_retractions: each row's counters carry its request's count."""
    checker = FinishChecker([2], lambda ids: "")
    streamer = OutputStreamer(default_stream_interval=1)
    a, b = _req(1, stream=True, max_new_tokens=5), _req(2, stream=True, max_new_tokens=5)
    for r in (a, b):
        apply_new_tokens(r, [9], None, None, checker)
        streamer.add(r)
    assert [c.retractions for c in streamer.build().counters] == [0, 0]
    b.retract_count = 2
    for r in (a, b):
        apply_new_tokens(r, [9], None, None, checker)
        streamer.add(r)
    assert [c.retractions for c in streamer.build().counters] == [0, 2]


def test_reasoning_tokens_count_through_the_think_end_for_require_reasoning():
    """SGLang's Req.update_reasoning_tokens: with require_reasoning, every output token up to and
    including the one that ends the think block counts, also inside one multi-token run."""
    think_end = [9617, 17400, 46]  # "</think>" in SmolLM2's tokenizer
    checker = FinishChecker([2], lambda ids: "")
    streamer = OutputStreamer(default_stream_interval=1)
    r, plain = _req(1, stream=True, max_new_tokens=50), _req(2, stream=True, max_new_tokens=50)
    r.require_reasoning, r.think = True, ReasoningState(tuple(think_end))
    for run in ([5, 9617], [17400, 46, 7, 8], [9617, 17400, 46]):
        apply_new_tokens(r, run, None, None, checker)
        apply_new_tokens(plain, run, None, None, checker)
    assert (r.reasoning_tokens, r.think.over, plain.reasoning_tokens) == (4, True, 0)
    streamer.add(r)
    streamer.add(plain)
    assert [c.reasoning_tokens for c in streamer.build().counters] == [4, 0]
    never_closed = _req(3, max_new_tokens=50)
    never_closed.require_reasoning, never_closed.think = True, ReasoningState(tuple(think_end))
    apply_new_tokens(never_closed, [5, 6, 46], None, None, checker)
    assert never_closed.reasoning_tokens == 3 and not never_closed.think.over


def test_lpm_orders_by_cached_prefix_alone_even_with_priority_scheduling():
    """SGLang's calc_priority sorts by priority only under fcfs: lpm orders by the cached prefix (ties
    by arrival) whatever the priorities, and lpm without a radix cache is fcfs, priority first."""
    tree = RadixCache(TokenAllocator(64))
    tree.insert([7, 8, 9], torch.tensor([1, 2, 3]))
    urgent, cached, later = _req(1, priority=9), _req(2, ids=(7, 8, 9, 10), priority=1), _req(3, priority=1)
    waiting = [later, urgent, cached]
    SchedulePolicy("lpm", True, tree).sort(waiting)
    assert waiting == [cached, urgent, later]
    waiting = [later, urgent, cached]
    SchedulePolicy("lpm", True, RadixCache(TokenAllocator(64), disabled=True)).sort(waiting)
    assert waiting == [urgent, cached, later]
