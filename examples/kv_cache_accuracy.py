"""How much a one-byte KV cache changes a model's outputs: greedy agreement and log-probability drift.

    python examples/kv_cache_accuracy.py [--model PATH] [--kv-cache-dtype fp8_e4m3] [--num-prompts 16]

Runs the same greedy requests twice, with the model's own cache dtype and with the one-byte cache, and
prints the share of output tokens that agree (up to each request's first divergence), the largest and mean
difference of the chosen tokens' log-probabilities before that point, and how many requests diverged.
The default model is the embedded SmolLM2-135M in bfloat16; prompts are W1's (random token ids).
"""

from __future__ import annotations

import argparse

import numpy as np

from pagellm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    lengths = rng.randint(64, 513, size=args.num_prompts)
    prompts = [{"prompt_token_ids": rng.randint(100, 49052, size=n).tolist()} for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
    runs = {}
    for kv in ("auto", args.kv_cache_dtype):
        llm = LLM(args.model, dtype="bfloat16", kv_cache_dtype=kv)
        runs[kv] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    agree = total = diverged = 0
    diffs: list[float] = []
    for base, one_byte in zip(runs["auto"], runs[args.kv_cache_dtype], strict=True):
        total += len(base.token_ids)
        for j, (a, b) in enumerate(zip(base.token_ids, one_byte.token_ids, strict=True)):
            if a != b:
                diverged += 1
                break
            agree += 1
            diffs.append(abs(base.logprobs[j][a].logprob - one_byte.logprobs[j][b].logprob))
    print(
        f"{args.kv_cache_dtype} vs the model's dtype: {agree}/{total} greedy tokens agree ({agree / total:.1%}), "
        f"{diverged}/{len(prompts)} requests diverge; chosen-token log-prob difference before divergence: "
        f"max {max(diffs):.4f}, mean {np.mean(diffs):.4f}"
    )


if __name__ == "__main__":
    main()
