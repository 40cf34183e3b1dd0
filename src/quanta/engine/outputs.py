"""What the engine hands back: per-step request outputs, finished results and their timing statistics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    completion_tokens: int = 0
    ttft_s: float = 0.0  # request arrival → first generated token (queueing included)
    prefill_s: float = 0.0  # first scheduled → first generated token
    decode_s: float = 0.0  # first token → last token
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_tokens: int = 0  # ... and kept
    verify_steps: int = 0  # steps that verified drafts

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = self.completion_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, with the most likely alternatives (OpenAI's shape)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class RequestOutput:
    """One request's progress in one engine step: the tokens and text it gained, and whether it is done."""

    request_id: int
    new_token_ids: list[int]
    text: str  # the text delta (stop strings held back until they can no longer match)
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None  # why a request ended with "error"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: GenerationStats | None = None  # set when finished


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids, without the end-of-generation token
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)
