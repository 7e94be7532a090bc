"""How much a one-byte KV cache or quantized weights change a model's outputs: greedy agreement and
log-probability drift.

    python examples/accuracy.py [--model PATH] [--kv-cache-dtype fp8_e4m3] [--quantization int8]

Runs the same greedy requests twice, with the model as it is and with the given settings, and prints the
share of output tokens that agree (up to each request's first divergence), the largest and mean difference
of the chosen tokens' log-probabilities before that point, and how many requests diverged. The default
model is the embedded SmolLM2-135M in bfloat16; prompts are W1's (random token ids).
"""

from __future__ import annotations

import argparse

import numpy as np

from pagellm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    lengths = rng.randint(64, 513, size=args.num_prompts)
    prompts = [{"prompt_token_ids": rng.randint(100, 49052, size=n).tolist()} for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
    variant = {"kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
    runs = []
    for settings in ({}, variant):
        llm = LLM(args.model, dtype="bfloat16", **settings)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    agree = total = diverged = 0
    diffs: list[float] = []
    for base, other in zip(*runs, strict=True):
        total += len(base.token_ids)
        for j, (a, b) in enumerate(zip(base.token_ids, other.token_ids, strict=True)):
            if a != b:
                diverged += 1
                break
            agree += 1
            diffs.append(abs(base.logprobs[j][a].logprob - other.logprobs[j][b].logprob))
    name = ", ".join(f"{k} {v}" for k, v in variant.items() if v not in (None, "auto")) or "nothing changed"
    print(
        f"{name} vs the model as it is: {agree}/{total} greedy tokens agree ({agree / total:.1%}), "
        f"{diverged}/{len(prompts)} requests diverge; chosen-token log-prob difference before divergence: "
        f"max {max(diffs):.4f}, mean {np.mean(diffs):.4f}"
    )


if __name__ == "__main__":
    main()
