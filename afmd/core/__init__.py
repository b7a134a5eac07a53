"""afmd's own model of a turn, below every wire format.

A dialect adapter (OpenAI Chat Completions today; Completions, Responses and Anthropic
Messages next) parses its body into :mod:`afmd.core.request` and encodes the typed events
of :mod:`afmd.core.events` into its JSON or SSE; the pipeline between them never sees a
wire format.
"""
