"""`tandem bench offline --speculative-algorithm NGRAM`: speculative over plain decoding on a
repetitive workload, at batch 1 and batch 16 (or --spec-batch-sizes), in one run.

The workload is where prompt lookup pays: chat prompts that ask the model to copy or lightly
edit a passage (prose and code), so the answer quotes its prompt. Decoding is greedy with EOS,
and each speculative output must equal the plain one token for token (it is checked), so both
runs produce the same tokens and tokens/s compare like for like. Batch size B: the prompts go
in waves of B concurrent requests (--max-running-requests B), each wave one `generate` call.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the "
    "great lens and wrote the weather in a leather log: wind from the west, sea moderate, two fishing boats "
    "returning late. In forty years the light had never failed, and he meant to keep it that way.",
    "To make the bread, mix four cups of flour with a spoonful of salt and a packet of yeast. Add warm water "
    "slowly until the dough holds together, then knead it for ten minutes. Let it rise in a warm place for an "
    "hour, shape it into a loaf, and bake it at two hundred degrees until the crust is golden brown.",
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, value in enumerate(values):\n"
    "        total += value\n        if i >= window:\n            total -= values[i - window]\n"
    "        if i >= window - 1:\n            result.append(total / window)\n    return result\n",
    "The committee met on Tuesday to review the budget for the new library. Members agreed to fund longer "
    "opening hours, a children's reading room and faster internet access. The proposal to close the branch "
    "on Sundays was rejected, and the final plan will be presented to the council next month.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        if not self.items:\n"
    "            raise IndexError('pop from an empty stack')\n        return self.items.pop()\n",
    "Rivers carry water from the mountains to the sea. Along the way they cut valleys, deposit sand and "
    "silt, and feed the forests and farms on their banks. When heavy rain falls, a river can rise quickly, "
    "so towns near the water build walls and keep watch over the level of the current.",
    "Dear team, thank you for your hard work this quarter. We shipped the new search feature on time, cut the "
    "error rate in half and answered every support ticket within a day. Next quarter we will focus on speed, "
    "reliability and the mobile app. Please send me your ideas before Friday.",
    "The museum opens at nine in the morning and closes at six in the evening. Tickets can be bought at the "
    "entrance or online. Guided tours start every hour from the main hall, and the cafe on the top floor "
    "serves lunch until three. Photography is allowed, but please do not use a flash.",
]
INSTRUCTIONS = ["Repeat the following text exactly, word for word:", "Copy this text without changing anything:",
                "Rewrite the text below exactly as it is:", "Reproduce the following exactly:"]


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True))
    return [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]


def run_waves(args: argparse.Namespace, prompts: list[list[int]], batch: int, speculative: bool
              ) -> tuple[list[list[int]], float, dict[str, Any]]:
    from tandem.runtime.engine import Engine

    spec = dict(speculative_algorithm=args.speculative_algorithm,
                speculative_num_draft_tokens=args.speculative_num_draft_tokens) if speculative else {}
    sp = {"max_new_tokens": args.spec_output_len, "temperature": 0.0}
    with Engine(args.model_path, dtype=args.dtype, max_running_requests=batch, log_level="warning",
                max_total_tokens=batch * (max(map(len, prompts)) + args.spec_output_len + 64) + 256, **spec) as engine:
        engine.generate(input_ids=prompts[:1], sampling_params=[{**sp, "max_new_tokens": 8}])  # warm-up
        engine.flush_cache()
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            wave = prompts[i:i + batch]
            outputs += [o["output_ids"] for o in engine.generate(input_ids=wave, sampling_params=[sp] * len(wave))]
        seconds = time.perf_counter() - t0
        info = engine.server_info()
    return outputs, seconds, info


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model_path)
    rows = []
    for batch in args.spec_batch_sizes:
        waves = max(args.spec_waves, -(-8 // batch))  # at least 8 requests per batch size
        prompts = make_prompts(tokenizer, batch * waves)
        plain, plain_s, _ = run_waves(args, prompts, batch, speculative=False)
        spec, spec_s, info = run_waves(args, prompts, batch, speculative=True)
        if spec != plain:
            raise RuntimeError(f"batch {batch}: speculative outputs differ from plain decoding")
        tokens = sum(map(len, plain))
        rows.append({"batch_size": batch, "requests": len(prompts), "output_tokens": tokens,
                     "plain_tok_s": round(tokens / plain_s, 2), "speculative_tok_s": round(tokens / spec_s, 2),
                     "speedup": round(plain_s / spec_s, 3), "accept_length": info.get("avg_spec_accept_length"),
                     "accept_rate": info.get("spec_accept_rate")})
    return {"algorithm": args.speculative_algorithm, "num_draft_tokens": args.speculative_num_draft_tokens,
            "dtype": args.dtype, "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"speculative decoding: {report['algorithm']}, {report['num_draft_tokens']} tokens per verify "
             f"(the last token + drafts), greedy, dtype {report['dtype']}",
             f"{'batch':>5} {'requests':>8} {'tokens':>7} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} "
             f"{'accept len':>10} {'accept rate':>11}"]
    for r in report["rows"]:
        lines.append(f"{r['batch_size']:>5} {r['requests']:>8} {r['output_tokens']:>7} {r['plain_tok_s']:>12.1f} "
                     f"{r['speculative_tok_s']:>11.1f} {r['speedup']:>7.2f}x {r['accept_length'] or 0:>10.2f} "
                     f"{r['accept_rate'] or 0:>11.2f}")
    return "\n".join(lines)
