"""A request's parameters as the engine takes them: how to sample (:class:`SamplingParams`) and
how to speculate (:class:`SpecParams`), each validated once, where it is made."""

from __future__ import annotations

from dataclasses import dataclass, field

# a temperature below this decodes greedily (as vLLM does: dividing logits by it overflows)
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Engine-side sampling parameters (the HTTP layer converts its request into these)."""

    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    min_p: float = 0.0  # drop tokens below min_p x the most probable one's probability; 0 -> off
    max_tokens: int = 16  # 0: prefill only (with prompt_logprobs: score the prompt)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop token (EOS, stop_token_ids) may end the output before this
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: any)
    # vLLM's bad_words as token sequences: a word's last token may not follow the rest of it
    # in the output (a one-token word never comes) (engine/round/rules.py)
    bad_words: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: plus the top n
    prompt_logprobs: int | None = None  # the same for every prompt token (the model's own)
    # logit processing before temperature (penalties.py): OpenAI's, and repetition (1 = off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    grammar: str | None = None  # an llguidance grammar the output must match (grammar.py)
    # batch-invariant forwards while this request runs (engine/model/invariant.py; the engine's
    # ``deterministic`` mode must be "request" or "always")
    deterministic: bool = False

    def __post_init__(self):
        if self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError("temperature must be >= 0")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # greedy (MIN_TEMPERATURE)
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError("prompt_logprobs must be >= 0")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if any(not w for w in self.bad_words):
            raise ValueError("bad_words must not hold an empty token sequence")

    @property
    def penalized(self) -> bool:
        """Whether any logit processing (bias, penalties) applies to this request."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def ruled(self) -> bool:
        """Whether any sampling rule of engine/round/rules.py (allowed tokens, bad words,
        min_tokens, min_p) applies to this request."""
        return bool(
            self.allowed_token_ids is not None
            or self.bad_words
            or self.min_tokens
            or (self.min_p > 0 and not self.greedy)
        )

    @property
    def multi_token_bad_words(self) -> bool:
        """Whether a bad word has several tokens (its rule reads the drafts before each verified
        position, so such a row verifies chains)."""
        return any(len(w) > 1 for w in self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecParams:
    """Per-request speculation settings (already validated and capped by the server config)."""

    enabled: bool = True
    k: int | None = None  # a fixed K for every round; None: the engine's controller decides
    k_max: int | None = None  # cap on the controller's K for this request (None: engine's k_max)
