"""The turn afmd serves, whatever dialect its body came in: frozen, validated values.

A dialect's parser builds these (OpenAI Chat Completions' in :mod:`afmd.dialects.openai.chat_body`)
after checking every field, so nothing past the edge sees an unchecked value; the pipeline
plans, renders and generates from them alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image part as the client sent it (its base64 payload decoded, the picture not):
    only a vision model pays for decoding it, and an undecodable one is named by ``param``.
    """

    data: bytes
    param: str  # the part itself (``messages[0].content[1].image_url``)
    offset: int  # where it sits in the message's text (its text parts are joined as is)


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    has_images: bool = False
    #: The image parts, in order (``has_images`` is true when there are any).
    images: tuple[ImageInput, ...] = ()
    #: An assistant turn's thinking as the client sent it back (Responses reasoning items);
    #: templates that know ``reasoning_content`` render it, others drop it.
    reasoning: str | None = None
    #: A system message that stays where it stands in the conversation (Anthropic's
    #: ``role: "system"`` inside ``messages``) instead of joining the leading system prompt.
    in_place: bool = False


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool = False
    #: Where the client's body declared what ``parameters`` came from, when the tool's
    #: index among the offered tools does not say it (Responses' namespaces and hosted
    #: tools shift the indexes; a custom tool's parameters are its format's definition).
    declared_at: str | None = None
    #: Where the client's body declared the tool's name, for the same reason.
    named_at: str | None = None
    #: A free-form tool (OpenAI's ``custom``): offered as a function of one string,
    #: ``input``, its call given back to the client as that text, not as arguments.
    custom: bool = False

    def parameters_param(self, index: int) -> str:
        """The param naming this tool's parameters in an error, the tool offered ``index``th."""
        if self.declared_at is not None:
            return self.declared_at
        return f"tools[{index}].function.parameters"

    def name_param(self, index: int) -> str:
        """The param naming this tool's name in an error, the tool offered ``index``th."""
        if self.named_at is not None:
            return self.named_at
        return f"tools[{index}].function.name"

    def as_template_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """What the model may or must do with tools on the first step of this turn.

    ``mode`` is ``none`` (tools hidden), ``auto`` (free; calls constrained once opened) or
    ``required`` (must call one of ``allowed``); a named choice is ``required`` with one
    allowed name.
    """

    mode: str = "auto"
    allowed: tuple[str, ...] | None = None  # None: every tool in `tools`
    named: bool = False  # a named function: forces the first step only, restricts nothing


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    kind: str  # "json_object" | "json_schema"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[Message, ...]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    #: Tokens the repetition penalty looks back over (Ollama's ``repeat_last_n``; None:
    #: mlx-lm's default).
    repetition_context: int | None = None
    #: OpenAI's additive penalties over the tokens generated so far, and its per-token
    #: biases as (token id, bias) pairs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    #: Choices of the same conversation, decoded together (choice ``i`` samples with
    #: ``seed + i`` when a seed is given).
    n: int = 1
    stop: tuple[str, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    #: Most tokens the model may spend thinking before it must answer (None: unbounded);
    #: enforced by the grammar, which closes the thinking block at the budget.
    thinking_budget: int | None = None
    #: Refuse a model that cannot think rather than answer without thinking (Ollama's
    #: ``think: true`` or a level: the client asked for reasoning it would not get).
    require_thinking: bool = False
    #: The last message is the start of the answer, which the model continues rather
    #: than answering anew (Anthropic's prefill, Ollama's final assistant message,
    #: vLLM's ``continue_final_message``); the answer holds only what follows it.
    continue_final: bool = False
    #: ``max_tokens`` is a cap the context window may lower (Anthropic's), not a demand a
    #: prompt too long to leave room for it fails (OpenAI's 400).
    max_tokens_shrinks: bool = False
    #: A context window smaller than the model's, to fit the prompt and the answer in
    #: (Ollama's ``num_ctx``); None, or a larger one: the model's.
    context_window: int | None = None
    #: Drop the oldest turns when the prompt does not fit (Ollama's ``truncate``); None:
    #: the server's ``[context] policy``.
    trim_context: bool | None = None
    has_images: bool = False
    #: Token ids that come before the rendered conversation: an earlier generation's
    #: prompt and answer as the client got them back (Ollama's generate ``context``), so
    #: this turn continues that one exactly. Ids, not text: decoding and re-encoding
    #: them could make other tokens, and the prefix cache resumes only the same ones.
    prompt_prefix: tuple[int, ...] = ()
    #: Report each generated token's log-probability with this many most likely
    #: alternatives (0-20); None: no log-probabilities (``logprobs`` false or absent).
    logprobs: int | None = None
    #: The text the client expects the answer to be close to (OpenAI's Predicted Outputs,
    #: ``prediction``): proposed to the model where the output agrees with it.
    prediction: str | None = None
    #: Seconds the model stays loaded once idle after this request (negative: for good);
    #: None: the model's own keep-alive. Ollama's top-level ``keep_alive``.
    keep_alive: float | None = None
    #: Variables for the model's chat template from the client (``enable_thinking``);
    #: they win over those afmd derives from ``reasoning_effort``.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: At most this many calls of the server's own tools in this request, below ``[tools]
    #: max_calls`` (the Responses API's ``max_tool_calls``, which bounds the tools the
    #: server runs and never the client's); None: the server's budget alone.
    max_server_tool_calls: int | None = None
    #: Top-level fields of the body afmd did not know and ignored, in the body's order
    #: (the response names them in ``X-AFM-Ignored-Fields``).
    ignored_fields: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A legacy Completions turn: raw prompts, tokenized as given (no chat template).

    Each prompt (a text or token ids) is one choice; all of them run as one request.
    """

    prompts: tuple[str | tuple[int, ...], ...]
    model: str | None = None
    suffix: str | None = None  # fill-in-the-middle: the text after the cursor
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context: int | None = None  # as ChatRequest's
    presence_penalty: float = 0.0  # as ChatRequest's
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    n: int = 1  # choices per prompt, as ChatRequest's
    stop: tuple[str, ...] = ()
    echo: bool = False  # the prompt's text (and its tokens' log-probabilities) first
    logprobs: int | None = None  # alternatives per token (0-5); None: none reported
    prediction: str | None = None  # as ChatRequest's
    keep_alive: float | None = None  # as ChatRequest's
    #: ``max_tokens`` is a cap the context window lowers (Ollama's ``num_predict``), not
    #: a demand a prompt too long for it fails.
    max_tokens_shrinks: bool = False
    context_window: int | None = None  # as ChatRequest's
    require_thinking: bool = False  # as ChatRequest's (the prompt is raw: nothing else)
    ignored_fields: tuple[str, ...] = ()  # as ChatRequest's


#: The ``param`` of an error about ``ChatRequest.prompt_prefix`` (``prompt_prefix[3]``
#: for one of its ids): a dialect names its own field.
PROMPT_PREFIX_PARAM = "prompt_prefix"

#: The ``param`` of a context error whose window is the request's own ``context_window``
#: (Ollama's ``options.num_ctx``) rather than the model's: the dialect names its field,
#: so the client learns which of its settings to change.
CONTEXT_WINDOW_PARAM = "context_window"


def context_limit(model_length: int, window: int | None) -> tuple[int, bool]:
    """The context window a request must fit, and whether it is the request's own (a
    ``context_window`` smaller than the model's; a larger one is the model's)."""
    if window is not None and window < model_length:
        return window, True
    return model_length, False
