"""Dialect adapters: one API's wire format at the edge, afmd's own model inside.

An adapter parses its dialect's body into the internal request (:mod:`afmd.core.request`),
encodes the run's events (:mod:`afmd.core.events`) into its JSON or SSE, and renders
errors in its envelope (:mod:`afmd.dialects.dialect` says what that takes). The HTTP layer
picks the adapter by route; nothing between the two edges knows which one it serves.
"""
