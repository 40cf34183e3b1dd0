"""Shapes and metadata of real models (from their published Hugging Face configs) for ``quanta synth``."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quanta.synth import chat_templates

# Token types as stored in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class TokenizerPreset:
    """The kind of tokenizer and its special tokens. ``specials`` are (text, type); ``specials_first`` puts
    them at ids 0.. (SmolLM2), otherwise right after the regular tokens (Llama-3, Qwen2). SPM vocabularies
    (``kind == "llama"``) take their layout from ``specials`` then 256 byte tokens then pieces."""

    kind: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str | None
    specials: tuple[tuple[str, int], ...]
    bos: str
    eos: str
    unk: str | None = None
    pad: str | None = None
    specials_first: bool = False
    add_bos: bool = True
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    pad_tokens: int = 0  # the real vocabulary ends with this many [PADn] (UNUSED) tokens


@dataclass(frozen=True)
class ModelPreset:
    name: str
    arch: str  # GGUF general.architecture: "llama", "qwen2", "gemma3"
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    vocab_size: int
    context_length: int
    rope_freq_base: float
    rms_eps: float
    tokenizer: TokenizerPreset
    head_dim: int | None = None  # default n_embd // n_head
    tied_embeddings: bool = False
    sliding_window: int | None = None
    llama3_rope_scaling: tuple[float, float, float, int] | None = None  # factor, low, high, original context
    qkv_bias: bool = False

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    def with_overrides(self, *, layers: int | None = None, vocab: int | None = None) -> "ModelPreset":
        """A smaller variant for tests: fewer layers and/or a smaller vocabulary (specials are kept)."""
        if layers is not None and not 1 <= layers <= self.n_layers:
            raise ValueError(f"--layers must be between 1 and {self.n_layers} ({self.name} has {self.n_layers}), "
                             f"got {layers}")
        if vocab is not None and not 1 <= vocab <= self.vocab_size:
            raise ValueError(f"--vocab must be between 1 and {self.vocab_size:,} ({self.name}'s vocabulary), "
                             f"got {vocab:,}")
        out = self
        if layers is not None:
            out = replace(out, n_layers=layers)
        if vocab is not None:
            out = replace(out, vocab_size=vocab, tokenizer=replace(out.tokenizer, pad_tokens=0))
        return out


def _smollm_specials() -> tuple[tuple[str, int], ...]:
    names = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
             "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
             "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>")
    return tuple((n, CONTROL) for n in names)


def _llama3_specials() -> tuple[tuple[str, int], ...]:
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>", 6: "<|start_header_id|>",
             7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>", 10: "<|python_tag|>"}
    out, reserved = [], 0
    for i in range(256):
        if i in named:
            out.append((named[i], CONTROL))
        else:
            out.append((f"<|reserved_special_token_{reserved}|>", CONTROL))
            reserved += 1
    return tuple(out)


def _qwen_specials() -> tuple[tuple[str, int], ...]:
    control = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
    user = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
            "<|repo_name|>", "<|file_sep|>")
    return tuple((n, CONTROL) for n in control) + tuple((n, USER_DEFINED) for n in user)


def _gemma_specials() -> tuple[tuple[str, int], ...]:
    """Ids 0..237 of Gemma-3's vocabulary: controls, <unusedN>, turn markers, user-defined newline runs."""
    out = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN), ("<mask>", CONTROL),
           ("[multimodal]", USER_DEFINED)]
    out += [(f"<unused{i}>", CONTROL) for i in range(99)]
    out += [("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
    out += [("\n" * k, USER_DEFINED) for k in range(1, 32)]
    out += [(f"<unused{99 + i}>", CONTROL) for i in range(238 - len(out))]
    return tuple(out)


_SPM_LLAMA = TokenizerPreset("llama", None, (("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)),
                             bos="<s>", eos="</s>", unk="<unk>")

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("smollm2-135m", "llama", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0, 1e-5, TokenizerPreset(
            "gpt2", "smollm", _smollm_specials(), bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>",
            pad="<|im_end|>", specials_first=True, add_bos=False, add_space_prefix=False,
            chat_template=chat_templates.CHATML_SMOLLM),
            tied_embeddings=True),
        ModelPreset("gemma3-270m", "gemma3", 18, 640, 2048, 4, 1, 262144, 32768, 1000000.0, 1e-6, TokenizerPreset(
            "llama", "default", _gemma_specials(), bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>",
            add_space_prefix=False, chat_template=chat_templates.GEMMA),
            head_dim=256, tied_embeddings=True, sliding_window=512),
        ModelPreset("tinyllama-1.1b", "llama", 22, 2048, 5632, 32, 4, 32000, 2048, 10000.0, 1e-5,
                    replace(_SPM_LLAMA, pad="</s>", chat_template=chat_templates.ZEPHYR_TINYLLAMA)),
        ModelPreset("llama-3.2-1b", "llama", 16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, 1e-5, TokenizerPreset(
            "gpt2", "llama-bpe", _llama3_specials(), bos="<|begin_of_text|>", eos="<|eot_id|>",
            chat_template=chat_templates.LLAMA3),
            head_dim=64, tied_embeddings=True, llama3_rope_scaling=(32.0, 1.0, 4.0, 8192)),
        ModelPreset("qwen2.5-0.5b", "qwen2", 24, 896, 4864, 14, 2, 151936, 32768, 1000000.0, 1e-6, TokenizerPreset(
            "gpt2", "qwen2", _qwen_specials(), bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>",
            add_bos=False, chat_template=chat_templates.CHATML_QWEN, pad_tokens=271),
            tied_embeddings=True, qkv_bias=True),
        ModelPreset("qwen2.5-1.5b", "qwen2", 28, 1536, 8960, 12, 2, 151936, 32768, 1000000.0, 1e-6, TokenizerPreset(
            "gpt2", "qwen2", _qwen_specials(), bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>",
            add_bos=False, chat_template=chat_templates.CHATML_QWEN, pad_tokens=271),
            tied_embeddings=True, qkv_bias=True),
        ModelPreset("llama-2-7b", "llama", 32, 4096, 11008, 32, 32, 32000, 4096, 10000.0, 1e-5,
                    replace(_SPM_LLAMA, chat_template=chat_templates.LLAMA2_INST)),
        ModelPreset("llama-2-13b", "llama", 40, 5120, 13824, 40, 40, 32000, 4096, 10000.0, 1e-5,
                    replace(_SPM_LLAMA, chat_template=chat_templates.LLAMA2_INST)),
    )
}


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    return PRESETS[name]
