"""Apple's on-device Foundation Model served as the built-in model ``system``.

macOS 26 and later run the model at the core of Apple Intelligence themselves; Apple's
``apple-fm-sdk`` (an optional dependency, macOS only, imported lazily) reaches it from
Python. The model is not loaded, tokenized or sampled by afmd: it is handed a conversation
(instructions, a transcript, a prompt, tools, options) and answers it. So it sits behind
the engine boundary (:mod:`afmd.engine.generation`) as a model kind of its own, and every dialect
reaches it through the same pipeline as an MLX model:

- :mod:`~afmd.engine.apple.framework`: the SDK, imported lazily, and whether the model is
  available (``device_not_eligible`` where the framework is not, as on Linux);
- :mod:`~afmd.engine.apple.schemas`: JSON Schemas as the framework's ``GenerationSchema``
  takes them (and the arguments it generates back into what the schema asked);
- :mod:`~afmd.engine.apple.conversation`: a chat request mapped onto the framework's
  inputs, as plain data, before any slot is taken;
- :mod:`~afmd.engine.apple.tools`: the request's tools as framework tools, whose calls
  afmd captures (the client's) or runs (the operator's server tools);
- :mod:`~afmd.engine.apple.worker`: each generation on threads of its own, read back into
  the engine's events, the framework's errors into afmd's.
"""
