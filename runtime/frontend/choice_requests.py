"""One validated item -> its choices: the ChoiceState the tokenizer manager keeps for each choice
of `sampling_params.n`, and the TokenizedGenerateReq the scheduler gets for it.

Choice i runs as its own request `{group}_{i}` with n = 1; a seeded request's choice i samples
with seed + i (wrapped to int64), so the choices differ and stay reproducible.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
import numpy as np

from tandem.ipc.messages import TokenizedGenerateReq
from tandem.runtime.frontend.request_groups import ChoiceState, RequestGroup
from tandem.runtime.frontend.validation import GenerateItem
from tandem.runtime.sampling.logprob_format import LogprobFormatOptions, LogprobFormatter
from tandem.runtime.sampling.params import SamplingParams
from tandem.runtime.value_checks import INT64_MAX, INT64_MIN


def choice_requests(item: GenerateItem, group: RequestGroup, first_index: int, weight_version: str,
                    decode_tokens: Callable[[list[int]], list[str]], priority: int | None
                    ) -> Iterator[tuple[ChoiceState, TokenizedGenerateReq]]:
    """Each choice of `item` in `group`, numbered in the response from `first_index`, with its request."""
    sp = item.sampling_params
    input_ids = np.asarray(item.input_ids, dtype=np.int32)
    for i in range(sp.n):
        choice = ChoiceState(rid=f"{group.prefix}{i}", group=group, index=first_index + i,
                             prompt_tokens=len(item.input_ids), formatter=_formatter(item, i, decode_tokens),
                             hidden_states=[] if item.return_hidden_states else None,
                             prompt_token_ids=item.input_ids if item.return_prompt_token_ids else None,
                             weight_version=weight_version)
        yield choice, TokenizedGenerateReq(
            rid=choice.rid, input_ids=input_ids, sampling_params=choice_params(sp, i), stream=item.stream,
            logprob=item.logprob, return_hidden_states=item.return_hidden_states, priority=priority,
            extra_key=item.extra_key, require_reasoning=item.require_reasoning)


def choice_params(sp: SamplingParams, choice: int) -> SamplingParams:
    """Choice i of an n>1 request: n=1, and a seeded request uses seed + i (wrapped to int64)."""
    if sp.n == 1:
        return sp
    seed = sp.sampling_seed
    if seed is not None:
        seed = (seed + choice - INT64_MIN) % (INT64_MAX - INT64_MIN + 1) + INT64_MIN
    return msgspec.structs.replace(sp, n=1, sampling_seed=seed)


def _formatter(item: GenerateItem, choice: int, decode_tokens: Callable[[list[int]], list[str]]
               ) -> LogprobFormatter | None:
    lp = item.logprob
    if not lp.return_logprob:
        return None
    options = LogprobFormatOptions(
        top_logprobs_num=lp.top_logprobs_num, token_ids_logprob=lp.token_ids_logprob,
        return_text_in_logprobs=item.return_text_in_logprobs, flat_input_top=item.return_flat_raw_top_logprobs,
        flat_output_top=item.return_flat_raw_output_top_logprobs, flat_b64=item.return_flat_raw_top_logprobs_b64)
    return LogprobFormatter(options, decode_tokens, f"{item.rid}[{choice}]")
