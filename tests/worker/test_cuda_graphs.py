"""CUDA graphs for decode steps, without a GPU: the capture and replay logic against a stand-in graph that
has torch.cuda.CUDAGraph's `replay` (it runs the captured callable again over the same static buffers and
writes the captured output), checked for bucket choice, padding, static inputs, refreshed metadata, and
outputs equal to eager runs of a tiny model through TRITON_ATTN (Triton's interpreter) and FLASH_ATTN (a
stand-in flash_attn with the library's documented semantics)."""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from tiny import make_tiny_checkpoint

from pagellm import LLM, SamplingParams
from pagellm.attention_backends._base import PagedBackend
from pagellm.attention_backends.flash_attn import FlashAttnBackend
from pagellm.attention_backends.torch_sdpa import TorchSDPABackend
from pagellm.attention_backends.triton_attn import TritonAttnBackend
from pagellm.core.attention import AttentionBackend, AttentionBatch
from pagellm.models.context import get_forward_context
from pagellm.platforms.cpu import CpuPlatform
from pagellm.platforms.cuda import CudaPlatform
from pagellm.platforms.rocm import RocmPlatform
from pagellm.platforms.xpu import XpuPlatform
from pagellm.worker import cuda_graphs
from pagellm.worker.cuda_graphs import DecodeGraphs, capture_sizes
from pagellm.worker.step import StepArrays


class FakeGraph:
    """torch.cuda.CUDAGraph's replay: the captured callable runs again and overwrites the captured output."""

    def __init__(self, fn, output: torch.Tensor, size: int):
        self.fn, self.output, self.size = fn, output, size
        self.replays = 0

    def replay(self) -> None:
        self.output.copy_(self.fn())
        self.replays += 1


class FakeCapture:
    """`TorchCapture`'s interface; every graph it made, by batch size."""

    made: dict[int, FakeGraph] = {}

    def __init__(self, device: torch.device | None = None):
        FakeCapture.made = {}
        self.warm_ups = 0

    def warm_up(self, fn) -> None:
        fn()
        self.warm_ups += 1

    def capture(self, fn):
        output = fn()
        graph = FakeGraph(fn, output, output.shape[0])
        FakeCapture.made[graph.size] = graph
        return graph, output


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-1] == cuda_graphs.MAX_CAPTURE_SIZE


def test_platforms_and_backends_declare_it():
    assert CudaPlatform.supports_cuda_graphs() and RocmPlatform.supports_cuda_graphs()
    assert not CpuPlatform.supports_cuda_graphs() and not XpuPlatform.supports_cuda_graphs()
    assert TritonAttnBackend.cuda_graph_decode and FlashAttnBackend.cuda_graph_decode
    assert not TorchSDPABackend.cuda_graph_decode and not AttentionBackend.cuda_graph_decode


def _decode_step(seq_lens: list[int], block_size: int = 4, width: int | None = None) -> StepArrays:
    """A decode-only step: request i at position seq_lens[i] - 1, its blocks 10 * (i + 1) + j."""
    n = len(seq_lens)
    lens = np.array(seq_lens, dtype=np.int32)
    width = width or int(-(-lens.max() // block_size))
    tables = np.array([[10 * (i + 1) + j for j in range(width)] for i in range(n)], dtype=np.int32)
    positions = lens.astype(np.int64) - 1
    return StepArrays(
        input_ids=np.arange(100, 100 + n, dtype=np.int64),
        positions=positions,
        query_start_loc=np.arange(n + 1, dtype=np.int32),
        seq_lens=lens,
        block_tables=tables,
        slot_mapping=tables[np.arange(n), positions // block_size].astype(np.int64) * block_size
        + positions % block_size,
    )


def _probe(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 'model' whose output rows are what it read: its inputs and the step's attention batch."""
    batch = get_forward_context().metadata
    return torch.stack(
        [
            input_ids,
            positions,
            batch.seq_lens.long(),
            batch.slot_mapping,
            batch.block_tables[:, 0].long(),
            batch.block_tables[:, 1].long(),
            batch.query_start_loc[1:].long(),
        ],
        dim=1,
    ).float()


def _graphs(forward=_probe, backend=AttentionBackend, sizes=(1, 2, 4, 8)) -> DecodeGraphs:
    graphs = DecodeGraphs(forward, backend, [], [], list(sizes), 64, 4, torch.device("cpu"))
    graphs.capture(FakeCapture())
    return graphs


def _expected(step: StepArrays) -> np.ndarray:
    n = step.seq_lens.shape[0]
    tables = np.zeros((n, 2), dtype=np.int64)
    tables[:, : min(2, step.block_tables.shape[1])] = step.block_tables[:, :2]
    return np.stack(
        [
            step.input_ids,
            step.positions,
            step.seq_lens,
            step.slot_mapping,
            tables[:, 0],
            tables[:, 1],
            np.arange(1, n + 1),
        ],
        axis=1,
    )


def test_replay_picks_the_smallest_bucket_and_reads_the_new_inputs():
    graphs = _graphs()
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    for seq_lens in ([5, 9, 2], [7, 3, 12, 6, 1], [17]):
        step = _decode_step(seq_lens)
        before = {size: g.replays for size, g in FakeCapture.made.items()}
        hidden = graphs.run(step)
        size = graphs.bucket(len(seq_lens))
        assert {s: g.replays - before[s] for s, g in FakeCapture.made.items()} == {
            s: int(s == size) for s in (1, 2, 4, 8)
        }
        np.testing.assert_array_equal(hidden.numpy(), _expected(step))
        # padding rows: token 0 at position 0, one token of context, stored in the null block
        pad = slice(len(seq_lens), size)
        for buffer in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.block_tables[:, 0]):
            assert buffer[pad].eq(0).all()
        assert graphs.seq_lens[pad].eq(1).all()


def test_steps_that_are_not_decode_only_or_too_large_run_eagerly():
    graphs = _graphs()
    prefill = _decode_step([5, 9])
    prefill.input_ids = np.arange(3, dtype=np.int64)  # request 1 runs two tokens
    prefill.positions = np.array([4, 7, 8], dtype=np.int64)
    assert graphs.run(prefill) is None
    assert graphs.run(_decode_step([3] * 9)) is None
    assert all(g.replays == 0 for g in FakeCapture.made.values())


def test_a_length_dependent_rope_replays_decode_tokens_only():
    """The graphs rotate each token for length position + 1 (models/layers/rotary.py): a decode token's;
    a one-token chunk of a longer prompt (its length is the prompt's) runs eagerly."""
    graphs = _graphs()
    step = _decode_step([5, 9])
    step.rope_lengths = step.positions + 1
    assert graphs.run(step) is not None
    step.rope_lengths = np.array([5, 20], dtype=np.int64)  # request 1: token 9 of a 20-token prompt
    assert graphs.run(step) is None


@dataclass
class _CumsumMetadata:
    batch: AttentionBatch
    cu_seqlens_k: torch.Tensor


class _CumsumBackend(AttentionBackend):
    """Like FLASH_ATTN: its metadata holds a tensor computed from the batch."""

    name = "CUMSUM"

    @classmethod
    def build_metadata(cls, batch: AttentionBatch) -> _CumsumMetadata:
        return _CumsumMetadata(batch, torch.cumsum(batch.seq_lens, 0))


def test_metadata_computed_from_the_batch_is_refreshed_before_each_replay():
    def forward(input_ids, positions):
        return get_forward_context().metadata.cu_seqlens_k.float().unsqueeze(1)

    graphs = _graphs(forward, _CumsumBackend)
    assert graphs.graphs[4].derived == ("cu_seqlens_k",)
    for seq_lens in ([5, 9, 2], [1, 1, 30]):
        hidden = graphs.run(_decode_step(seq_lens))
        assert hidden.squeeze(1).tolist() == np.cumsum(seq_lens).tolist()
    # a paged backend's store slots are the batch's slot mapping: nothing to refresh, no metadata rebuilt
    graphs = _graphs(lambda input_ids, positions: input_ids.float().unsqueeze(1), PagedBackend)
    assert graphs.graphs[4].derived == ()


def test_each_kv_cache_group_has_its_own_buffers_and_metadata():
    """Layer 0 in group 0, layer 1 in group 1: each reads its group's block tables and slot mapping."""

    def forward(input_ids, positions):
        ctx = get_forward_context()
        rows = []
        for layer in (0, 1):
            batch = ctx.metadata_of(layer)
            rows += [batch.slot_mapping.float(), batch.block_tables[:, 0].float()]
        return torch.stack(rows, dim=1)

    graphs = DecodeGraphs(forward, AttentionBackend, [], [], [1, 2, 4], 64, 4, torch.device("cpu"), [0, 1])
    graphs.capture(FakeCapture())
    step = _decode_step([5, 9, 2])
    other_tables = step.block_tables + 500
    other_slots = step.slot_mapping + 500 * 4
    step.more_groups = ((other_tables, other_slots),)
    hidden = graphs.run(step).numpy()
    np.testing.assert_array_equal(hidden[:, 0], step.slot_mapping)
    np.testing.assert_array_equal(hidden[:, 1], step.block_tables[:, 0])
    np.testing.assert_array_equal(hidden[:, 2], other_slots)
    np.testing.assert_array_equal(hidden[:, 3], other_tables[:, 0])
    assert graphs.group_slots[1][3].item() == 0  # a padding row stores in the null block in every group


def test_a_failed_capture_runs_eagerly_with_a_warning(monkeypatch, caplog):
    class Broken(FakeCapture):
        def capture(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cuda_graphs, "TorchCapture", Broken)
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        graphs = cuda_graphs.capture_decode_graphs(
            _probe, AttentionBackend, [], [], 4, 64, 4, torch.device("cpu")
        )
    assert graphs is None
    assert "capturing CUDA graphs failed, running eagerly: RuntimeError" in caplog.text


# --- the model runner: a tiny model, graphs against eager runs ---


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("graphs"))


@pytest.fixture
def graphable(monkeypatch):
    """The CPU platform allows graphs (made by FakeCapture) and compiles nothing, and `backend` may run
    here whatever its class facts say."""
    monkeypatch.setattr(CpuPlatform, "supports_cuda_graphs", classmethod(lambda cls: True))
    monkeypatch.setattr(CpuPlatform, "compile_model", classmethod(lambda cls, model: None))
    monkeypatch.setattr(cuda_graphs, "TorchCapture", FakeCapture)

    def allow(backend):
        monkeypatch.setattr(backend, "unsupported_reasons", classmethod(lambda cls, spec, platform: []))

    return allow


PROMPTS = [[5, 9, 33, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], [99] * 3]


def _generate(llm: LLM, prompts=PROMPTS, max_tokens: int = 6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def _assert_same(ours, eager) -> None:
    for (tokens, logprobs), (eager_tokens, eager_logprobs) in zip(ours, eager, strict=True):
        assert tokens == eager_tokens
        for step, eager_step in zip(logprobs, eager_logprobs, strict=True):
            assert step.keys() == eager_step.keys()
            for token, entry in step.items():
                assert entry.rank == eager_step[token].rank
                assert entry.logprob == pytest.approx(eager_step[token].logprob, abs=1e-5)


def _llm(model_dir, backend: str, block_size: int, **kwargs) -> LLM:
    settings = dict(num_kv_blocks=40, max_model_len=512, max_num_seqs=4)
    settings.update(kwargs)
    return LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        block_size=block_size,
        **settings,
    )


@pytest.mark.usefixtures("triton_interpreter")
def test_triton_attn_replays_decode_steps_token_for_token(model_dir, graphable):
    graphable(TritonAttnBackend)
    eager_llm = _llm(model_dir, "TRITON_ATTN", 16, enforce_eager=True)
    llm = _llm(model_dir, "TRITON_ATTN", 16, enforce_eager=False)
    assert llm.engine.runner.graphs is not None and sorted(FakeCapture.made) == [1, 2, 4]
    _assert_same(_generate(llm), _generate(eager_llm))
    # one prefill step, then 5 decode steps of 3 requests in the 4-row graph; the others never replay
    assert {size: g.replays for size, g in FakeCapture.made.items()} == {1: 0, 2: 0, 4: 5}
    # one request: too few programs for the device, so the 1-row graph, planned for the longest context,
    # splits it (split-K) where the eager steps do not
    _assert_same(_generate(llm, PROMPTS[:1], 4), _generate(eager_llm, PROMPTS[:1], 4))
    assert FakeCapture.made[1].replays == 3


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.slow
def test_a_model_with_window_groups_replays_token_for_token(tmp_path, graphable):
    """Qwen3 with 3 window layers : 1 full: four KV cache groups, each captured with its own metadata."""
    graphable(TritonAttnBackend)
    path = make_tiny_checkpoint(
        "qwen3",
        tmp_path,
        num_hidden_layers=4,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    )
    eager_llm = _llm(path, "TRITON_ATTN", 16, enforce_eager=True, num_kv_blocks=130)
    llm = _llm(path, "TRITON_ATTN", 16, enforce_eager=False, num_kv_blocks=130)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.kv_layout.num_groups == 4
    _assert_same(_generate(llm, max_tokens=24), _generate(eager_llm, max_tokens=24))
    assert FakeCapture.made[4].replays == 23


@pytest.fixture
def flash_attn_stand_in(monkeypatch):
    """flash_attn_varlen_func for causal, paged, unwindowed attention, reading every length from the
    device tensors it is given, as the CUDA kernel does."""

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
               window_size, softcap, block_table):  # fmt: skip
        assert causal and window_size == (-1, -1) and not softcap
        out = torch.empty_like(q)
        group, block_size = q.shape[1] // k.shape[2], k.shape[1]
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            seq_len = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            blocks = block_table[i, : -(-seq_len // block_size)].long()
            keys = k[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
            values = v[blocks].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe], keys) * softmax_scale
            query_pos = torch.arange(seq_len - (qe - qs), seq_len)
            scores = scores.masked_fill(query_pos[:, None] < torch.arange(seq_len)[None, :], float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        return out

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn", fake)


@pytest.mark.usefixtures("flash_attn_stand_in")
def test_flash_attn_replays_decode_steps_token_for_token(model_dir, graphable):
    graphable(FlashAttnBackend)
    eager = _generate(_llm(model_dir, "FLASH_ATTN", 256, enforce_eager=True))
    llm = _llm(model_dir, "FLASH_ATTN", 256, enforce_eager=False)
    assert llm.engine.runner.graphs.graphs[4].derived == ("cu_seqlens_k",)
    _assert_same(_generate(llm), eager)
    assert FakeCapture.made[4].replays == 5


def test_graphs_are_off_with_enforce_eager_or_a_backend_that_cannot_be_captured(model_dir, graphable):
    graphable(TorchSDPABackend)
    assert _llm(model_dir, "TORCH_SDPA", 16, enforce_eager=False).engine.runner.graphs is None
    graphable(FlashAttnBackend)
    assert _llm(model_dir, "FLASH_ATTN", 256, enforce_eager=True).engine.runner.graphs is None
