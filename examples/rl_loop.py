"""A tiny RL loop on CPU: the Engine rolls out with logprobs, a torch trainer takes a policy-gradient
step on the same weights, the new weights go to the Engine over a gloo group
(update_weights_from_distributed), and the next rollout runs on them.

Checks each step: the rollout's logprobs equal the server's own teacher-forced logprobs of the same
tokens (prompt logprobs through /generate) bit for bit, the trainer's forward (transformers, fp32)
agrees with them within float rounding (other kernels sum in another order), and the weights the
server reads back after the update are the trainer's, bit for bit.

    python examples/rl_loop.py            # about half a minute on two cores
"""
from __future__ import annotations

import socket
import tempfile
import threading

import torch

from tandem.launch.make_tiny_model import build_tiny_model
from tandem.runtime.engine import Engine
from tandem.runtime.model.weight_sync import broadcast, flatten, init_weights_group

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44], [100, 200, 300]]
NEW_TOKENS = 8


def rollout(engine: Engine, step: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, sampled tokens, their logprobs) per prompt."""
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True, "sampling_seed": step}
    outs = engine.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True)
    return [(p, o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for p, o in zip(PROMPTS, outs)]


def server_scores(engine: Engine, prompt: list[int], tokens: list[int]) -> list[float]:
    """The server's teacher-forced logprobs of `tokens` after `prompt` (prompt logprobs)."""
    out = engine.generate(input_ids=prompt + tokens, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=len(prompt) - 1)
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]][1:]


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def push_weights(engine: Engine, group, model: torch.nn.Module, version: str) -> None:
    """The trainer broadcasts every weight in one flattened bucket (SGLang's load_format
    "flattened_bucket"; a broadcast per tensor works too, with fewer bytes a second) while the
    Engine receives them."""
    named = [(n, p.detach()) for n, p in model.state_dict().items()]
    sender = threading.Thread(target=lambda: broadcast(group, flatten([t for _, t in named])))
    sender.start()
    ok, message = engine.update_weights_from_distributed([n for n, _ in named], [str(t.dtype) for _, t in named],
                                                         [list(t.shape) for _, t in named], group_name="rl",
                                                         weight_version=version, load_format="flattened_bucket")
    sender.join()
    assert ok, message


def main(steps: int = 3, lr: float = 0.5) -> list[dict]:
    from transformers import AutoModelForCausalLM

    path = str(build_tiny_model(tempfile.mkdtemp(prefix="rl_loop_"), "qwen2"))
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    report = []
    with Engine(path, dtype="float32", max_total_tokens=2000, max_running_requests=4, log_level="warning") as engine:
        joined: dict = {}
        joining = threading.Thread(target=lambda: joined.update(g=init_weights_group("127.0.0.1", port, 0, 2, "rl")))
        joining.start()
        assert engine.init_weights_update_group("127.0.0.1", port, rank_offset=1, world_size=2, group_name="rl")[0]
        joining.join()
        for step in range(steps):
            samples = rollout(engine, step)
            exact = all(server_scores(engine, p, t) == lps for p, t, lps in samples)
            ours = [trainer_logprobs(model, p, t) for p, t, _ in samples]
            gap = max((o - torch.tensor(lps)).abs().max().item() for o, (_, _, lps) in zip(ours, samples))
            rewards = torch.tensor([sum(t) % 7 / 7.0 for _, t, _ in samples])  # a made-up reward
            loss = -sum((r - rewards.mean()) * o.sum() for r, o in zip(rewards, ours)) / len(ours)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            push_weights(engine, joined["g"], model, f"step-{step + 1}")
            served = engine.get_weights_by_name("model.layers.0.mlp.down_proj.weight", truncate_size=4)
            landed = torch.equal(torch.tensor(served), model.model.layers[0].mlp.down_proj.weight[:4].detach())
            report.append({"step": step, "rollout_equals_server_score": exact, "trainer_max_abs_diff": gap,
                           "loss": round(loss.item(), 6), "weights_landed": landed})
            print(report[-1])
    return report


if __name__ == "__main__":
    main()
