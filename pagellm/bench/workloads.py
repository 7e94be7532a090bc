"""The benchmark workloads of shared/bench/README.md and its models, generated the same way every run.

Requests are token ids drawn from fixed `numpy.random.RandomState` seeds, so every engine and every run
sees identical prompts. Model S is the embedded SmolLM2 GGUF; the others (`RANDOM_MODELS`: M, a random Qwen2
shaped like Qwen2.5-0.5B; E, a random Qwen3-MoE shaped like a small Qwen3-30B-A3B; H, a random Qwen3.5 text
hybrid, three Gated DeltaNet layers to one attention layer; M-gemma3, a Gemma 3 text model of M's size; D, a
DeepSeek-V3.2 with its sparse attention's sizes, and D-dense, its checkpoint without the indexer) are random
checkpoints built once (seeded) and cached on disk, with a locally built tokenizer.
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MODEL_M_CONFIG = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151643,
)
MODEL_E_CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=384,
    intermediate_size=3072,  # unused: no dense layers (decoder_sparse_step 1, mlp_only_layers empty)
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    vocab_size=151936,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151643,
)
MODEL_H_CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=16,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_value_heads=16,
    linear_num_key_heads=8,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=3072,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151643,
)
MODEL_M_GEMMA3_CONFIG = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    sliding_window=512,
    layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(24)],
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151643,
    pad_token_id=151643,
)
"""Model M's sizes in Gemma 3's text layout (five 512-token sliding-window layers per global one, q/k norms,
four norms a layer): issue 29's check that per-layer windows cost no speed."""
MODEL_V_CONFIG = dict(
    text_config=dict(
        model_type="qwen2",
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        vocab_size=32064,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
    ),
    vision_config=dict(
        model_type="clip_vision_model",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=448,
        patch_size=14,
        projection_dim=256,
    ),
    image_token_id=32000,
    vision_feature_select_strategy="default",
    vision_feature_layer=-2,
)
"""Model V, I1's vision-language model: LLaVA's layout at a tiny width (a CLIP tower of 448-pixel images in
14-pixel patches, 1024 tokens an image; a Qwen2 decoder of 512 wide, 8 layers), random weights."""
MODEL_D_CONFIG = dict(
    hidden_size=1024,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=512,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    index_n_heads=8,
    index_head_dim=128,
    index_topk=2048,
    intermediate_size=1024,
    first_k_dense_replace=4,  # every layer dense: the experts are not what this model measures
    n_routed_experts=8,
    moe_intermediate_size=256,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    vocab_size=32768,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
    max_position_embeddings=20480,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
)
"""Model D, DeepSeek-V3.2's attention at its own sizes (MLA's latent of 512 + 64, heads of 128 + 64; the
indexer's keys of 128, each query reading its 2,048 best tokens) with an eighth of its heads (16 MLA, 8
indexer) and a small dense rest, so that at long contexts the attention is most of a decode step: issue 50's
check that sparse attention reads the indexer's keys and 2,048 tokens, not the whole context. "D-dense" is
the same checkpoint without the indexer (DeepSeek-V3: MLA over every token)."""
_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
IMAGE_TOKEN = "<image>"


@dataclass
class Workload:
    """A named list of requests: prompt token ids and the exact number of tokens each must generate."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        input_lens = [len(p) for p in self.prompts]
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "input_len_range": [min(input_lens), max(input_lens)],
            "output_len_range": [min(self.output_lens), max(self.output_lens)],
        }


def w1(
    vocab_size: int,
    num_prompts: int = 64,
    input_len: tuple[int, int] = (64, 512),
    output_len: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> Workload:
    """W1 (offline throughput): all input lengths, then all output lengths, then each prompt in turn.

    Lengths are drawn uniformly from the inclusive ranges; token ids from [100, vocab_size - 100)."""
    rng = np.random.RandomState(seed)
    input_lens = rng.randint(input_len[0], input_len[1] + 1, size=num_prompts)
    output_lens = rng.randint(output_len[0], output_len[1] + 1, size=num_prompts)
    prompts = [rng.randint(100, vocab_size - 100, size=int(n)).tolist() for n in input_lens]
    return Workload("W1", prompts, [int(n) for n in output_lens])


@dataclass
class ImageWorkload:
    """Requests of one image and a text prompt each (the image's placeholder, then the text)."""

    name: str
    texts: list[str]
    images: list[Any]  # PIL images
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.texts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        size = self.images[0].size if self.images else None
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "image_size": list(size) if size else None,
            "output_tokens": self.output_tokens,
            "output_len_range": [min(self.output_lens), max(self.output_lens)],
        }


def i1(
    tokenizer: Any,
    num_prompts: int = 64,
    image_size: int = 448,
    input_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (16, 128),
) -> ImageWorkload:
    """I1 (images): one RGB image per request (pixels from RandomState(2), through a PNG round trip) and a
    W1-like text of `input_len` random tokens (RandomState(3): input lengths, output lengths, then the
    tokens), decoded to text after the image's placeholder."""
    from PIL import Image

    pixels = np.random.RandomState(2)
    images = []
    for _ in range(num_prompts):
        buffer = io.BytesIO()
        array = pixels.randint(0, 256, size=(image_size, image_size, 3)).astype(np.uint8)
        Image.fromarray(array).save(buffer, format="PNG")
        images.append(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
    rng = np.random.RandomState(3)
    input_lens = rng.randint(input_len[0], input_len[1] + 1, size=num_prompts)
    output_lens = rng.randint(output_len[0], output_len[1] + 1, size=num_prompts)
    vocab = len(tokenizer) - 100
    texts = [
        IMAGE_TOKEN + "\n" + tokenizer.decode(rng.randint(100, vocab, size=int(n)).tolist())
        for n in input_lens
    ]
    return ImageWorkload("I1", texts, images, [int(n) for n in output_lens])


def w3(
    vocab_size: int,
    num_prompts: int = 64,
    prefix_len: int = 1024,
    suffix_len: int = 64,
    output_len: int = 64,
    seed: int = 1,
) -> Workload:
    """W3 (shared prefix): one prefix drawn first, then each request's unique suffix."""
    rng = np.random.RandomState(seed)
    prefix = rng.randint(100, vocab_size - 100, size=prefix_len).tolist()
    prompts = [
        prefix + rng.randint(100, vocab_size - 100, size=suffix_len).tolist() for _ in range(num_prompts)
    ]
    return Workload("W3", prompts, [output_len] * num_prompts)


COPY_SOURCE = """class LRUCache:
    # A least-recently-used cache of at most `capacity` entries.

    def __init__(self, capacity):
        self.capacity = capacity
        self.cache = {}
        self.order = []

    def get(self, key):
        if key not in self.cache:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.cache[key]

    def put(self, key, value):
        if key in self.cache:
            self.order.remove(key)
        elif len(self.cache) >= self.capacity:
            oldest = self.order.pop(0)
            del self.cache[oldest]
        self.cache[key] = value
        self.order.append(key)


def fibonacci(n, cache=None):
    # The n-th Fibonacci number, remembering earlier results.
    cache = cache if cache is not None else {}
    if n < 2:
        return n
    if n not in cache:
        cache[n] = fibonacci(n - 1, cache) + fibonacci(n - 2, cache)
    return cache[n]
"""
COPY_INSTRUCTIONS = (
    "Repeat the following code exactly, with no other text.",
    "Rewrite the following code, renaming the variable `cache` to `store`. Output only the code.",
    "Rewrite the following code with all comments removed. Output only the code.",
    "Rewrite the following code, renaming the class LRUCache to RecentCache. Output only the code.",
)


def copy_prompts(tokenizer, batch_size: int) -> list[list[int]]:
    """Prompts whose answers copy much of the prompt (code edits, W-spec "copy-friendly"): each asks for
    an edit of the same code (instructions in turn), through the chat template when the tokenizer has one."""
    return [
        chat_ids(tokenizer, f"{COPY_INSTRUCTIONS[i % len(COPY_INSTRUCTIONS)]}\n\n```python\n{COPY_SOURCE}```")
        for i in range(batch_size)
    ]


def chat_ids(tokenizer, text: str) -> list[int]:
    """One user message's prompt: through the chat template when the tokenizer has one, else the text."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in v5
    return tokenizer.encode(text)


CHAT_ASKS = (
    "Explain {} in simple terms.",
    "What are three interesting facts about {}?",
    "Write a short poem about {}.",
    "How would you describe {} to a ten-year-old?",
    "Give me some tips for learning about {}.",
    "What is the history of {}?",
    "Why is {} important?",
    "Write a short story that involves {}.",
    "What are the advantages and disadvantages of {}?",
    "Summarize what you know about {} in one paragraph.",
    "What questions do people often ask about {}?",
    "Write a friendly email to a colleague about {}.",
    "Can you help me plan a weekend around {}?",
    "What would happen if there were no {}?",
    "Compare {} with something from everyday life.",
    "List five words that come to mind when you think of {}.",
    "Tell me a fun story for children about {}.",
    "What are common mistakes people make about {}?",
    "Describe {} in three sentences.",
    "What should a beginner know about {}?",
)
CHAT_SUBJECTS = (
    "the moon", "photosynthesis", "the ocean", "volcanoes", "honey bees", "the internet", "rainbows",
    "electric cars", "the Roman Empire", "chess", "coffee", "gravity", "dinosaurs", "recycling",
    "the human heart", "solar panels", "mountains", "friendship", "music", "the weather", "sleep",
    "bicycles", "libraries", "clouds", "trees", "computers", "the Pyramids of Giza", "vaccines",
    "bread baking", "the French Revolution", "penguins", "earthquakes", "gardening", "the stock market",
    "mathematics", "the solar system", "rivers", "birds", "robots", "cheese", "the Olympic Games",
    "deserts", "airplanes", "languages", "exercise", "climate change", "the printing press", "tea",
    "the Great Wall of China", "owls", "snow", "wind turbines", "the brain", "pizza", "lighthouses",
    "the Amazon rainforest", "telescopes", "butterflies", "the Moon landing", "chocolate", "trains",
    "the immune system", "glaciers", "board games", "smartphones", "whales", "ancient Egypt", "kites",
    "the water cycle", "museums", "elephants", "jazz", "bridges", "the alphabet", "fireworks", "sharks",
    "renewable energy", "the Vikings", "yoga", "maps", "honey", "painting", "the Arctic", "spiders",
)  # fmt: skip
"""Chat questions (`chat_questions`): a task and a subject each, so the prompts read as a chat user's do."""


def chat_questions(n: int, seed: int = 0, avoid: Sequence[str] = ()) -> list[str]:
    """`n` chat questions drawn with a fixed seed: the same for every engine and run; none of `avoid` (a
    head's training set leaves out the questions it will be measured on)."""
    rng, avoided, out = np.random.RandomState(seed), set(avoid), []
    while len(out) < n:
        question = CHAT_ASKS[rng.randint(len(CHAT_ASKS))].format(
            CHAT_SUBJECTS[rng.randint(len(CHAT_SUBJECTS))]
        )
        if question not in avoided:
            out.append(question)
    return out


def chat_prompts(tokenizer, batch_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of a chat user (`chat_questions`), through the chat template when the tokenizer has one:
    the requests an EAGLE-3 head or MTP layer is measured on."""
    return [chat_ids(tokenizer, q) for q in chat_questions(batch_size, seed)]


RANDOM_MODELS = {
    "M": ("Qwen2Config", "MODEL_M_CONFIG"),
    "E": ("Qwen3MoeConfig", "MODEL_E_CONFIG"),
    "H": ("Qwen3_5TextConfig", "MODEL_H_CONFIG"),
    "M-gemma3": ("Gemma3TextConfig", "MODEL_M_GEMMA3_CONFIG"),
    "V": ("LlavaConfig", "MODEL_V_CONFIG"),
    "D": ("DeepseekV32Config", "MODEL_D_CONFIG"),
    "D-dense": ("DeepseekV3Config", "MODEL_D_CONFIG"),
}
"""Name -> (transformers config class, this module's config dict): looked up when built, so a test may
shrink a config by patching the dict."""


def resolve_model(model: str | None) -> str:
    """What `--model` names: S (default) the embedded SmolLM2 GGUF, a name of `RANDOM_MODELS`, else a path."""
    if model in (None, "S"):
        from pagellm.engine.default_model import default_model_path

        return default_model_path()
    if model in RANDOM_MODELS:
        return str(random_model_path(model))
    return model


def model_m_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Model M's directory, built on first use (about 1 GiB of bf16 weights, a minute on 2 cores)."""
    return random_model_path("M", cache_dir)


def random_model_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory of random model `name` (`RANDOM_MODELS`), built on first use: seeded weights in
    bfloat16 and a byte-level tokenizer of its vocabulary (M: about 1 GiB, a minute on 2 cores; E: 3.1 GiB)."""
    root = cache_dir or os.environ.get("PAGELLM_CACHE_DIR") or Path.home() / ".cache" / "pagellm" / "models"
    path = Path(root) / name
    if not (path / "config.json").exists():
        _build_random_model(name, path)
    return path


def _build_random_model(name: str, path: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if name in DENSE_TWINS:
        _dense_twin(random_model_path(DENSE_TWINS[name], path.parent), path)
        return
    config_class, config_name = RANDOM_MODELS[name]
    settings = globals()[config_name]
    partial = path.with_name(path.name + ".partial")
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**settings)
    if "vision_config" in settings:
        model = transformers.AutoModelForImageTextToText.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(partial)
    if "vision_config" in settings:
        _llava_processor(settings).save_pretrained(partial)
    else:
        make_byte_tokenizer(settings["vocab_size"]).save_pretrained(partial)
    partial.rename(path)


DENSE_TWINS = {"D-dense": "D"}
"""A random model made from another's checkpoint with its sparse attention's indexer left out."""


def _dense_twin(sparse: Path, path: Path) -> None:
    """DeepSeek-V3.2 checkpoint `sparse` as DeepSeek-V3 (the same weights, no indexer) at `path`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(sparse, partial, ignore=shutil.ignore_patterns("*.safetensors*", "config.json"))
    tensors = {}
    for file in sorted(sparse.glob("*.safetensors")):
        tensors.update({n: t for n, t in load_file(str(file)).items() if ".indexer." not in n})
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((sparse / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("index_") and k != "layer_types"}
    config.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    partial.rename(path)


def _llava_processor(settings: dict) -> Any:
    """A LLaVA processor for a random model: CLIP's image processor at the tower's size and the byte-level
    tokenizer with the image placeholder after its ids."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    size = settings["vision_config"]["image_size"]
    tokenizer = make_byte_tokenizer(settings["image_token_id"])
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == settings["image_token_id"]
    return LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}
        ),
        tokenizer=tokenizer,
        patch_size=settings["vision_config"]["patch_size"],
        vision_feature_select_strategy=settings["vision_feature_select_strategy"],
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
    )


def make_byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, built without any download.

    Ids: 3 special tokens, the 256 byte symbols, then merges of printable ASCII into pairs and triples,
    so every id decodes to readable text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [chr(c) for c in range(33, 127)] + ["Ġ"]  # "Ġ" is the byte-level symbol for a space
    vocab = {t: i for i, t in enumerate([*_SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    merges = []
    pairs = [(a, b) for a in printable for b in printable]
    triples = ((a + b, c) for a, b in pairs for c in printable)
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) == vocab_size:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=_SPECIAL_TOKENS[0], pad_token=_SPECIAL_TOKENS[0]
    )
