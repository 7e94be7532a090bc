"""What a CPU start imports before its first request: not triton (0.15-0.3 s for kernels a CPU never runs),
not transformers' weight-loading and distributed modules where the model's config does not need them
(0.8 s; Qwen2's config does not, Llama's does), in the engine not httpx (0.1 s, for image URLs), and in an
eager step not torch._dynamo (1.5-2.5 s). Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

from tiny import make_tiny_checkpoint

HEAVY = ("triton", "torch.distributed.tensor", "transformers.utils.type_validators")


def _imported_after(code: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_engine_process_imports_and_the_plugins_leave_triton_and_the_distributed_modules_out():
    code = (
        "from pagellm.engine.core_process import _import_config_machinery\n"
        "import pagellm.engine.llm_engine\n"
        "_import_config_machinery()\n"
        "from pagellm.plugins.loader import load_plugins\n"
        "load_plugins()"
    )
    assert _imported_after(code, HEAVY + ("httpx",)) == [], "httpx: only where an image URL is fetched"


def test_a_front_ends_preloaded_qwen2_tokenizer_comes_without_the_type_validators(tmp_path):
    model = make_tiny_checkpoint("qwen2", tmp_path / "model")
    code = (
        "from pagellm.core.config import EngineConfig\n"
        "from pagellm.engine.tokenizer import TokenizerPreload\n"
        f"assert TokenizerPreload(EngineConfig(model={str(model)!r})).tokenizer({str(model)!r}) is not None"
    )
    assert _imported_after(code) == []


def test_an_eager_step_of_reference_experts_leaves_dynamo_out(tmp_path):
    """A start that serves eager while the kernels build runs a mixture of experts on the reference: its
    first step imported torch._dynamo through the op's eager path (1.5-2.5 s before model E's first token)."""
    model = make_tiny_checkpoint("qwen3_moe", tmp_path / "model")
    code = (
        "import os\n"
        "os.environ['PAGELLM_CPU_KERNELS'] = '0'\n"
        # set by inductor in this test process: the engine would import inductor to read its default
        "os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None)\n"
        "from pagellm import LLM, SamplingParams\n"
        # a backend named: with no cached choice the backends' timing would compile flex attention
        f"llm = LLM(model={str(model)!r}, enforce_eager=True, dtype='bfloat16', attention_backend='TORCH_SDPA')\n"
        "llm.generate(['hello world'], SamplingParams(max_tokens=3, temperature=0))"
    )
    assert _imported_after(code, ("torch._dynamo",)) == []
