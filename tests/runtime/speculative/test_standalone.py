"""The STANDALONE drafter on a real (tiny) draft model: it never runs the draft model past its own
positions, whatever the target's context allows, and drafts after a verify that kept fewer tokens
than it had drafted."""
from __future__ import annotations

import json

import pytest
import torch

from tandem.launch.make_tiny_model import build_truncated_model
from tandem.runtime.model.runner import ModelRunner
from tandem.runtime.server_args import ServerArgs
from tandem.runtime.speculative.standalone import StandaloneDrafter

DRAFT_POSITIONS = 64


@pytest.fixture(scope="module")
def drafter(tiny_model_dir, tmp_path_factory) -> StandaloneDrafter:
    target = tiny_model_dir("llama")
    draft = build_truncated_model(target, tmp_path_factory.mktemp("draft") / "short", 1)
    config = json.loads((draft / "config.json").read_text())
    config["max_position_embeddings"] = DRAFT_POSITIONS  # the target has 2048
    (draft / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(ServerArgs(model_path=target, max_total_tokens=512, max_running_requests=2, dtype="float32",
                                    speculative_algorithm="STANDALONE", speculative_draft_model_path=str(draft)))
    req_to_token = runner.req_to_token_pool.req_to_token
    req_to_token[0, :256] = torch.arange(256)  # row 0 owns slots 0..255 at positions 0..255
    return StandaloneDrafter(runner.draft_model, runner.draft_attn_backend, req_to_token, 3, runner.device)


@pytest.mark.parametrize("last, want", [(20, 3), (DRAFT_POSITIONS - 4, 3), (DRAFT_POSITIONS - 3, 2),
                                        (DRAFT_POSITIONS - 2, 1), (DRAFT_POSITIONS - 1, 0), (150, 0)])
def test_drafts_stop_at_the_draft_models_last_position(drafter, last, want):
    """A draft at position p + 1 needs the draft model's KV at p: none past its rotary table (the
    request then verifies without drafts) instead of an error that takes the scheduler down."""
    drafter.start(0, [5 + i % 7 for i in range(last + 1)])
    drafts, lens = drafter.propose([0], [last], [True], [1000])
    assert lens.tolist() == [want]
    assert (drafts[0, want:] == 0).all()


def test_drafts_after_a_verify_that_kept_only_tokens_it_had_fed(drafter):
    """A verify may check fewer drafts than were proposed (min_new_tokens not reached, max_new_tokens
    near): when every token it keeps is one the drafter fed, the draft KV is valid through the new
    last token, which still has to be fed for its logits. Fed nothing, the pass was empty and its
    IndexError took the scheduler down (one greedy request with min_new_tokens on a STANDALONE server)."""
    history = [5 + i % 7 for i in range(21)]
    drafter.start(0, history)
    first, _ = drafter.propose([0], [20], [True], [1000])
    drafter.append(0, 21, [int(first[0, 0])])  # the verify checked no drafts; the target agreed with the first
    drafts, lens = drafter.propose([0], [21], [True], [1000])
    drafter.start(0, history + [int(first[0, 0])])
    fresh, fresh_lens = drafter.propose([0], [21], [True], [1000])
    assert lens.tolist() == fresh_lens.tolist() == [3]
    assert drafts.tolist() == fresh.tolist()
