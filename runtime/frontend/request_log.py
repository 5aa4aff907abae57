"""--log-requests: one log line per finished request choice, at SGLang's --log-requests-level
(0 and 1: what it was and how it ended; 2: with its output text cut at 2048 characters; 3: the
whole output text and ids). SGLang's level 1 adds the sampling parameters, which the answer does
not carry here: tandem logs levels 0 and 1 alike."""
from __future__ import annotations

from typing import Any

import orjson

PARTIAL_CHARS = 2048


def finish_line(c: Any, level: int) -> str:
    """`c`: a finished ChoiceState."""
    meta: dict[str, Any] = {
        "rid": c.group.logical_rid, "index": c.index, "finish_reason": c.finish_reason.to_json() if c.finish_reason else None,
        "prompt_tokens": c.prompt_tokens, "completion_tokens": c.counters.completion_tokens,
        "cached_tokens": c.counters.cached_tokens, "e2e_latency": round(c.finished_at - c.group.created, 6)}
    if level == 2:
        meta["text"] = c.text[:PARTIAL_CHARS] + ("..." if len(c.text) > PARTIAL_CHARS else "")
    elif level >= 3:
        meta["text"], meta["output_ids"] = c.text, list(c.output_ids)
    return "Finish: " + orjson.dumps(meta).decode()
