"""Run a pagellm model the way the model runner does: flat batches, a paged KV cache, TORCH_SDPA; the model and
its transformers reference on the session's device (`pytest --device`)."""

from __future__ import annotations

from pathlib import Path

import torch
from session_device import session_device
from transformers import AutoConfig, AutoModelForCausalLM

from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.core.attention import AttentionBatch
from pagellm.engine.setup import decoder_config
from pagellm.models.base import CausalLM, ModelInit
from pagellm.models.context import ImageBatch, set_forward_context
from pagellm.models.loader import iter_checkpoint_weights, load_model, resolve_model_class
from pagellm.models.registry import pagellm_models

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


def load_reference(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(session_device()).eval()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of one sequence: [len(ids), vocab]."""
    return model(torch.tensor([ids], device=model.device)).logits[0].float()


class PagedRunner:
    """Several sequences sharing one paged KV cache; each sequence owns blocks in a scrambled order, so a
    model or backend that ignored the block table would read the wrong context."""

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
        with set_forward_context(TorchSDPABackend.build_metadata(batch), self.caches, images=images):
            hidden = self.model(torch.tensor(ids, **on), torch.tensor(positions, **on))
        logits = self.model.compute_logits(hidden)
        return {s: logits[starts[i] : starts[i + 1]] for i, s in enumerate(seqs)}
