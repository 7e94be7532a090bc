"""What a CPU start imports before its first request: not triton (0.15-0.3 s for kernels a CPU never runs),
not transformers' weight-loading and distributed modules where the model's config does not need them
(0.8 s; Qwen2's config does not, Llama's does), and in the engine not httpx (0.1 s, for image URLs). Each
check runs in a fresh interpreter."""

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
