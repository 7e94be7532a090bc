"""The mixture-of-experts layer every MoE family uses: routing (`routing.py`), the stacked experts and
their checkpoint layouts (`layer.py`, `loading.py`; a GGUF file's stacked blocks: `gguf_experts.py`), and
the decoder layer's MoE block (`block.py`).
The experts' compute is the platform's (`Platform.pack_moe`) or `pagellm.core.moe`'s reference."""
