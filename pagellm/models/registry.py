"""The built-in model architectures, registered through the `models` entry point like any plugin's."""

from pagellm.plugins import hookimpl

PAGELLM_PLUGIN_API = "1.0"


@hookimpl
def pagellm_models() -> dict[str, str]:
    return {
        "LlamaForCausalLM": "pagellm.models.llama:LlamaForCausalLM",
        "MistralForCausalLM": "pagellm.models.llama:MistralForCausalLM",
        "Qwen2ForCausalLM": "pagellm.models.llama:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "pagellm.models.llama:Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM": "pagellm.models.qwen2_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "pagellm.models.qwen3_moe:Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM": "pagellm.models.qwen3_next:Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM": "pagellm.models.qwen3_next:Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM": "pagellm.models.qwen3_next:Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration": "pagellm.models.qwen3_next:Qwen3_5TextOfMultimodal",
        "Qwen3_5MoeForConditionalGeneration": "pagellm.models.qwen3_next:Qwen3_5TextOfMultimodal",
        "GraniteMoeHybridForCausalLM": "pagellm.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
        "BambaForCausalLM": "pagellm.models.bamba:BambaForCausalLM",
        "NemotronHForCausalLM": "pagellm.models.nemotron_h:NemotronHForCausalLM",
        "MixtralForCausalLM": "pagellm.models.mixtral:MixtralForCausalLM",
        "GptOssForCausalLM": "pagellm.models.gpt_oss:GptOssForCausalLM",
        "Phi3ForCausalLM": "pagellm.models.phi3:Phi3ForCausalLM",
        "GraniteForCausalLM": "pagellm.models.granite:GraniteForCausalLM",
        "Olmo2ForCausalLM": "pagellm.models.olmo2:Olmo2ForCausalLM",
        "SmolLM3ForCausalLM": "pagellm.models.smollm3:SmolLM3ForCausalLM",
        "GPT2LMHeadModel": "pagellm.models.gpt2:GPT2LMHeadModel",
        "OPTForCausalLM": "pagellm.models.opt:OPTForCausalLM",
        "Gemma2ForCausalLM": "pagellm.models.gemma:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "pagellm.models.gemma:Gemma3ForCausalLM",
        "DeepseekV2ForCausalLM": "pagellm.models.deepseek:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "pagellm.models.deepseek:DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM": "pagellm.models.glm4_moe:Glm4MoeForCausalLM",
        "LlavaForConditionalGeneration": "pagellm.models.llava:LlavaForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration": "pagellm.models.qwen_vl:Qwen2_5_VLForConditionalGeneration",
        "Gemma3ForConditionalGeneration": "pagellm.models.gemma3_mm:Gemma3ForConditionalGeneration",
        "Qwen3VLForConditionalGeneration": "pagellm.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    }
