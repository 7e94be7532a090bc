"""Run a pagellm model the way the model runner does: flat batches, a paged KV cache, TORCH_SDPA; the model and
its transformers reference on the session's device (`pytest --device`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from session_device import session_device
from transformers import AutoConfig, AutoModelForCausalLM

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionBatch
from pagellm.engine.setup import decoder_config
from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.context import ImageBatch, StateBatch, set_forward_context
from pagellm.models.loader import iter_checkpoint_weights, load_model, resolve_model_class
from pagellm.models.registry import pagellm_models
from pagellm.worker.state_cache import allocate_states

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def load_pagellm(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    **init_kwargs,
) -> CausalLM:
    """The model on `device`, by default the session's; a multimodal checkpoint's with its decoder's config
    as `hf_config` and the whole one as `model_config`, as the engine builds it."""
    config = AutoConfig.from_pretrained(model_dir)
    init = ModelInit(
        decoder_config(config),
        dtype,
        TorchSDPABackend,
        block_size=BLOCK_SIZE,
        model_config=config,
        **init_kwargs,
    )
    weights = iter_checkpoint_weights(model_dir)
    return load_model(
        resolve_model_class(config, pagellm_models()), init, weights, device or session_device()
    )


def set_config_fields(model_dir: Path, fields: dict) -> None:
    """Write `fields` into the checkpoint's config.json as they stand, past what the config class would keep
    or check: how a released config's own fields reach pagellm."""
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(config | fields))


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(session_device()).eval()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of one sequence: [len(ids), vocab]."""
    return model(torch.tensor([ids], device=model.device)).logits[0].float()


def assert_decode_matches(
    model: CausalLM,
    reference: torch.nn.Module,
    prompt: list[int],
    atol: float,
    steps: int = 4,
    split: int | None = None,
) -> None:
    """Logits against transformers' for a prefill of `prompt` (in two chunks, cut at `split`, if given) and
    then `steps` greedy decode steps, one token each, so that both the paged prefill and reading the cache
    back are checked."""
    runner = PagedRunner(model, num_seqs=1)
    ids = list(prompt)
    parts = [ids] if split is None else [ids[:split], ids[split:]]
    got = torch.cat([runner.step({0: part})[0] for part in parts])
    torch.testing.assert_close(got, reference_logits(reference, ids), atol=atol, rtol=0)
    for _ in range(steps):
        ids.append(int(got[-1].argmax()))
        got = runner.step({0: ids[-1:]})[0]
        torch.testing.assert_close(got[-1], reference_logits(reference, ids)[-1], atol=atol, rtol=0)


def assert_bf16_close(model: CausalLM, reference: torch.nn.Module, prompt: list[int], atol: float) -> None:
    """A bfloat16 model's prefill logits (bfloat16, as the sampler gets them) within `atol` of a bfloat16
    transformers model's: how far the two may round apart is each family's own number."""
    got = PagedRunner(model, num_seqs=1).step({0: prompt})[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference_logits(reference, prompt), atol=atol, rtol=0)


class PagedRunner:
    """Several sequences sharing one paged KV cache; each sequence owns blocks in a scrambled order, so a
    model or backend that ignored the block table would read the wrong context. A hybrid model's recurrent
    layers get a state slot per sequence (sequence s in slot num_seqs - 1 - s, so that a model reading the
    wrong slot reads another sequence's state)."""

    def __init__(self, model: CausalLM, num_seqs: int = 2):
        self.model = model
        self.device = next(model.parameters()).device
        self.caches = [
            torch.zeros(
                TorchSDPABackend.layer_cache_shape(a.spec, NUM_BLOCKS, BLOCK_SIZE),
                dtype=a.spec.cache_dtype,
                device=self.device,
            )
            for a in model.attention_layers()
        ]
        order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        self.block_tables = order.view(num_seqs, NUM_BLOCKS // num_seqs)
        self.lens = [0] * num_seqs
        self.states = allocate_states(model.state_layers(), num_seqs, self.device)

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]], images: ImageBatch | None = None) -> dict[int, torch.Tensor]:
        """Run new tokens of several sequences in one flat batch; returns each one's logits [len, vocab].
        `images`: the embeddings that replace image placeholder rows of the flat batch."""
        seqs = sorted(chunks)
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for s in seqs:
            new = chunks[s]
            pos = list(range(self.lens[s], self.lens[s] + len(new)))
            ids += new
            positions += pos
            slots += [int(self.block_tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            self.lens[s] += len(new)
            starts.append(starts[-1] + len(new))
            seq_lens.append(self.lens[s])
        on = {"device": self.device}
        batch = AttentionBatch(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, **on),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, **on),
            block_tables=self.block_tables[seqs].to(self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **on),
            query_start_loc_cpu=torch.tensor(starts, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
            max_query_len=max(len(chunks[s]) for s in seqs),
            max_seq_len=max(seq_lens),
        )
        state = self._state_batch(seqs, starts, seq_lens)
        metadata = TorchSDPABackend.build_metadata(batch)
        with set_forward_context(metadata, self.caches, state=state, images=images):
            hidden = self.model(torch.tensor(ids, **on), torch.tensor(positions, **on))
        logits = self.model.compute_logits(hidden)
        return {s: logits[starts[i] : starts[i + 1]] for i, s in enumerate(seqs)}

    def _state_batch(self, seqs: list[int], starts: list[int], seq_lens: list[int]) -> StateBatch | None:
        """The step's recurrent states, as the runner hands them over (None for a model without)."""
        if not self.states:
            return None
        slots = [len(self.lens) - 1 - s for s in seqs]
        return StateBatch(
            slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
            slot_list=slots,
            query_start_loc=starts,
            fresh=[n == b - a for n, a, b in zip(seq_lens, starts, starts[1:], strict=False)],
            caches=self.states,
        )
