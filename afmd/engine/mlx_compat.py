"""Every mlx-lm and mlx-vlm private afmd's engine depends on, and nothing else.

Written against **mlx-lm 0.32.2** (``mlx_lm/generate.py``, ``mlx_lm/tokenizer_utils.py``)
and **mlx-vlm 0.7.10** (``mlx_vlm/models/qwen2_vl/language.py``). No other afmd module
reaches into either (``tests/meta/test_mlx_compat.py`` checks that too), and
:func:`upstream_problems` names whatever an upgrade moved or rewrote of what is used here;
``tests/meta/test_mlx_compat.py`` fails loudly with its list. MLX's own launcher, the one MLX
private (``mlx._distributed_utils``), has a compat module of its own,
:mod:`afmd.engine.sharded.launcher_compat` (with ``tests/meta/test_launcher_compat.py``):
importing this module imports mlx-lm (and transformers), which the launcher's relay
process, alive as long as the group, has no use for.

What afmd needs from them, and how:

* **The running batch** (:class:`GenerationRows`). ``BatchGenerator`` has no way to take
  another decode step, so afmd's (:class:`~afmd.engine.batch.decode.DecodeBatch`) is a subclass
  of its ``GenerationBatch`` put in place of the generator's own empty one
  (``_generation_batch``). mlx-lm calls the step ``_step`` and keeps each row's state in
  private lists: the tokens each row has handed out (``_num_tokens``), its stop-sequence
  matcher (``_matchers``), the next tokens and what they were sampled with
  (``_next_tokens``, ``_next_logprobs``, made ``_current_*`` when they are fed), and the
  repetition context of the rows with processors (``_token_context``). Its ``extend``,
  ``filter`` and ``next`` read and resize all of them, which is why they stay mlx-lm's
  lists, read and written here under names of afmd's own.
* **Stop sequences** (:func:`stop_sequences`): ``BatchGenerator.insert`` takes a row's own
  stops only as ``StopSequences`` objects, a class mlx-lm does not export.
* **The Hugging Face tokenizer** (:func:`hf_tokenizer`) inside mlx-lm's
  ``TokenizerWrapper`` (``_tokenizer``): the wrapper forwards attributes to it but not
  calls, and batch tokenization and llguidance need the tokenizer itself.
* **Which architectures they have** (:func:`unsupported_model_type`): a model folder
  whose ``model_type`` neither can build is refused before its load unloads other models;
  mlx-lm resolves the name through ``MODEL_REMAPPING`` and ``MODEL_ARCHITECTURE_REMAPPING``
  (``_get_classes``), mlx-vlm through ``get_model_type`` (``get_model_and_args``).
* **A model's folder, then its parts** (:func:`model_path`): ``mlx_lm.load`` finds the
  folder (downloading a Hugging Face repo) with ``_download``, then loads the model and
  the tokenizer from it with the public ``load_model`` and ``load_tokenizer``. afmd takes
  those steps itself, so that it can keep a tokenizer from one load of a model to the next.
  ``mlx_vlm.load`` likewise: the model (:func:`vlm_model`), then its processor
  (:func:`vlm_processor`: the image processor of the model's module, and
  ``load_processor`` with the end ids of the model's config), taken apart so that a vision
  model's processor is kept too.
* **mlx-vlm's rotary state** (:func:`reset_rope_state`): Qwen2-VL-style language models
  keep the multimodal position ids and their offset (``_position_ids``, ``_rope_deltas``)
  from one generation to the next; a request without images would decode at the previous
  request's positions.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, StopSequences
from mlx_lm.tokenizer_utils import TokenizerWrapper

MLX_LM_VERSION = "0.32.2"
MLX_VLM_VERSION = "0.7.10"


class GenerationRows(GenerationBatch):
    """mlx-lm's running batch, reduced to what afmd's decode step uses.

    The subclass supplies :meth:`afmd_step`, which mlx-lm calls as its ``_step``; it and
    the subclass's own code read and write mlx-lm's per-row state through the names
    below, never through mlx-lm's.
    """

    @classmethod
    def attach(cls, generator: BatchGenerator) -> GenerationRows:
        """A new empty batch of ``cls``, put in place of a fresh ``generator``'s (empty)
        running batch: rows the generator moves to decoding join it from now on."""
        batch = cls.empty(generator.model, generator.sampler)
        generator._generation_batch = batch
        return batch

    # -- the hook for the subclass --
    def _step(self) -> tuple[list[int], list[Any]]:
        return self.afmd_step()

    def afmd_step(self) -> tuple[list[int], list[Any]]:
        """One decode step of every row: its tokens (on the host) and what resolves
        each one's log-probabilities."""
        raise NotImplementedError

    # -- mlx-lm's per-row state, under afmd's names --
    @property
    def generated(self) -> list[int]:
        """Tokens each row has handed out so far (0: its first is still to go out); the
        list itself, so a row's count is updated in place."""
        return self._num_tokens

    @property
    def stop_matchers(self) -> list[Any]:
        """Each row's position in its stop sequences (``.advance(token) -> bool``)."""
        return self._matchers

    @property
    def next_tokens(self) -> mx.array:
        """The tokens sampled for each row's next step, not yet fed to the model."""
        return self._next_tokens

    @next_tokens.setter
    def next_tokens(self, tokens: mx.array) -> None:
        self._next_tokens = tokens

    @property
    def next_logprobs(self) -> list[Any]:
        """What resolves the log-probabilities of :attr:`next_tokens`, row by row."""
        return self._next_logprobs

    @next_logprobs.setter
    def next_logprobs(self, logprobs: list[Any]) -> None:
        self._next_logprobs = logprobs

    def take_next(self) -> tuple[mx.array, list[Any]]:
        """The next tokens (and their log-probabilities) become this step's inputs, as
        mlx-lm's own step makes them: ``extend`` reads them there."""
        self._current_tokens = tokens = self._next_tokens  # type: ignore[assignment]  # mlx-lm's GenerationBatch starts it as a bare None
        self._current_logprobs = self._next_logprobs
        return tokens, self._current_logprobs

    def token_context(self, row: int) -> Any:
        """Row ``row``'s recent tokens, as its (non-grammar) logits processors see them:
        ``update_and_fetch(inputs)`` adds this step's token and returns the context."""
        return self._token_context[row]


def stop_sequences(sequences: Iterable[Sequence[int]]) -> StopSequences:
    """One row's stops as ``BatchGenerator.insert`` takes them (``stop_sequences=``)."""
    return StopSequences([list(s) for s in sequences])


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer of mlx-lm's ``TokenizerWrapper`` (``tokenizer`` itself
    when it wraps none)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def model_path(source: str) -> Path:
    """The folder of a model path or Hugging Face repo id, as ``mlx_lm.load`` finds it
    (a repo not on disk yet is downloaded)."""
    from mlx_lm.utils import _download

    return _download(source)


def vlm_model(folder: Path) -> Any:
    """The vision model in ``folder``, loaded as ``mlx_vlm.load`` loads it (its weights
    evaluated, every one required)."""
    from mlx_vlm.utils import load_model

    return load_model(folder, False, strict=True)


def vlm_processor(folder: Path, eos_token_ids: Any) -> Any:
    """The processor ``mlx_vlm.load`` gives the model in ``folder``, whose config's end
    ids are ``eos_token_ids`` (the loaded model's ``config.eos_token_id``)."""
    from mlx_vlm.utils import load_image_processor, load_processor

    image_processor = load_image_processor(folder)
    processor = load_processor(folder, True, eos_token_ids=eos_token_ids)
    if image_processor is not None:
        processor.image_processor = image_processor
    return processor


#: mlx-vlm language models' multimodal rotary state, kept across generations.
ROPE_STATE = ("_position_ids", "_rope_deltas")


def reset_rope_state(language_model: Any) -> None:
    """Forget the previous generation's multimodal positions, as mlx-vlm itself does
    only when the next prompt comes with images."""
    for attribute in ROPE_STATE:
        if hasattr(language_model, attribute):
            setattr(language_model, attribute, None)


def unsupported_model_type(config: dict[str, Any], *, vision: bool = False) -> str | None:
    """Why mlx-lm (``vision``: mlx-vlm) cannot build the model a ``config.json`` describes,
    if it has no module for its ``model_type``; None when it has one. Resolved as mlx-lm's
    ``_get_classes`` (mlx-vlm's ``get_model_and_args``) resolves it, through their
    remapping tables, without importing the model's module."""
    import importlib.util

    if vision:
        try:
            from mlx_vlm.utils import get_model_type
        except ImportError:
            return None  # the load says vision support is not installed
        try:
            model_type = get_model_type(config)
        except (AttributeError, TypeError, ValueError):
            return "its model_type cannot be read"
        packages: tuple[str, ...] = ("mlx_vlm.models", "mlx_vlm.speculative.drafters")
        library = "mlx-vlm"
    else:
        from mlx_lm.utils import MODEL_ARCHITECTURE_REMAPPING, MODEL_REMAPPING

        model_type = config.get("model_type")
        if isinstance(model_type, str):
            architectures = config.get("architectures") or ()
            if isinstance(architectures, str):
                architectures = (architectures,)
            try:
                remapped = next((MODEL_ARCHITECTURE_REMAPPING[(model_type, a)]
                                 for a in architectures
                                 if (model_type, a) in MODEL_ARCHITECTURE_REMAPPING), None)
            except TypeError:  # an architecture that is not a string
                remapped = None
            model_type = remapped or MODEL_REMAPPING.get(model_type, model_type)
        packages = ("mlx_lm.models",)
        library = "mlx-lm"
    if model_type is None:
        return "it has no model_type"
    if not isinstance(model_type, str) or not model_type.isidentifier():
        return f"model_type {model_type!r} is not one {library} supports"
    for package in packages:
        try:
            if importlib.util.find_spec(f"{package}.{model_type}") is not None:
                return None
        except (ImportError, ValueError):
            continue
    return f"model_type '{model_type}' is not one {library} supports (not an architecture it has)"


# ------------------------------------------------------------------------------ upgrades


def _fingerprint(obj: Callable[..., Any] | type) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def _qwen2_vl_language() -> Callable[..., Any]:
    from mlx_vlm.models.qwen2_vl.language import LanguageModel

    return LanguageModel.__call__


def _get_classes() -> Callable[..., Any]:
    from mlx_lm.utils import _get_classes

    return _get_classes


def _download() -> Callable[..., Any]:
    from mlx_lm.utils import _download

    return _download


def _load_tokenizer() -> Callable[..., Any]:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer


def _vlm_get_model_and_args() -> Callable[..., Any]:
    from mlx_vlm.utils import get_model_and_args

    return get_model_and_args


def _vlm_load() -> Callable[..., Any]:
    from mlx_vlm.utils import load

    return load


def _vlm_load_processor() -> Callable[..., Any]:
    from mlx_vlm.utils import load_processor

    return load_processor


def _vlm_load_image_processor() -> Callable[..., Any]:
    from mlx_vlm.utils import load_image_processor

    return load_image_processor


def _vlm_get_model_type() -> Callable[..., Any]:
    from mlx_vlm.utils import get_model_type

    return get_model_type


#: mlx-lm's and mlx-vlm's code this module relies on in detail, with a fingerprint of its
#: source in the versions named above: an upgrade that rewrites any of it must be re-read
#: against this module (and afmd.engine.batch.decode) before its fingerprint is updated here.
#: mlx-vlm is optional at run time, so its entries are looked up when checked.
UPSTREAM_CODE: dict[str, tuple[Callable[[], Callable[..., Any] | type], str]] = {
    # creates every private list GenerationRows names, and steps a non-empty batch
    "GenerationBatch.__init__": (lambda: GenerationBatch.__init__, "dc828c7f63bfb07f"),
    # the step afmd's replaces: what it reads and leaves for extend/filter/next
    "GenerationBatch._step": (lambda: GenerationBatch._step, "d7513c5031029194"),
    # merge the joining rows' lists (the _current_* ones included)
    "GenerationBatch.extend": (lambda: GenerationBatch.extend, "4019e7eaf5d6782f"),
    "GenerationBatch.filter": (lambda: GenerationBatch.filter, "27a2165cf672969f"),
    # counts tokens and advances matchers the way DecodeBatch.account does
    "GenerationBatch.next": (lambda: GenerationBatch.next, "5d2a3d229fba02a9"),
    "GenerationBatch.empty": (lambda: GenerationBatch.empty, "f78c92330652d99b"),
    # builds a plain GenerationBatch for joining rows: their first token is mlx-lm's
    "PromptProcessingBatch.generate": (lambda: PromptProcessingBatch.generate, "1af9ca01578812d3"),
    # creates _generation_batch, which GenerationRows.attach replaces
    "BatchGenerator.__init__": (lambda: BatchGenerator.__init__, "80fdd7d3fc89c375"),
    # steps, extends and filters _generation_batch
    "BatchGenerator._next": (lambda: BatchGenerator._next, "eb3a4e361dc2c19e"),
    "BatchGenerator.remove": (lambda: BatchGenerator.remove, "705e7de06f06d7de"),
    "StopSequences": (lambda: StopSequences, "afd3428ec0111ba8"),
    # keeps the Hugging Face tokenizer as _tokenizer
    "TokenizerWrapper.__init__": (lambda: TokenizerWrapper.__init__, "79f9e5564e8331bb"),
    # mlx-vlm: resets _position_ids/_rope_deltas only for a prompt with images
    "mlx-vlm qwen2_vl LanguageModel.__call__": (_qwen2_vl_language, "b6ee49f7d912faa8"),
    # unsupported_model_type resolves model_type through the same tables, then the
    # module each would import
    "mlx_lm.utils._get_classes": (_get_classes, "c5f60582f151ad98"),
    # model_path is its first step; afmd's load takes the rest (load_model, then
    # load_tokenizer with the config's eos_token_id) as it does
    "mlx_lm.load": (lambda: mlx_lm.load, "3ecfb3a0d2a8a81a"),
    "mlx_lm.utils._download": (_download, "89796073210d7f1c"),
    # afmd.engine.models.kept_tokenizers knows a tokenizer by the files this fetches
    "mlx_lm.utils.load_tokenizer": (_load_tokenizer, "a1832454eb3ab228"),
    "mlx-vlm get_model_and_args": (_vlm_get_model_and_args, "27caa2efb3de4dd8"),
    "mlx-vlm get_model_type": (_vlm_get_model_type, "2168da8285ad58f9"),
    # vlm_model and vlm_processor are its steps (no adapter, no download: the folder is
    # found first); what it sets on the processor, vlm_processor sets
    "mlx-vlm load": (_vlm_load, "de9dfe44dbc77f4c"),
    # kept_tokenizers keeps its processor across loads: it sets nothing per model but the
    # end ids it is given, and reads the files kept_tokenizers knows it by
    "mlx-vlm load_processor": (_vlm_load_processor, "1666c40a4ad42fd1"),
    "mlx-vlm load_image_processor": (_vlm_load_image_processor, "c8569d051c9b156d"),
}

#: What GenerationRows reads of a running batch's instance state.
_BATCH_STATE = ("_num_tokens", "_matchers", "_next_tokens", "_next_logprobs",
                "_current_tokens", "_current_logprobs", "_token_context")


def _installed() -> str:
    try:
        import mlx_vlm

        vlm = mlx_vlm.__version__
    except ImportError:
        vlm = "none"
    return f"mlx-lm {mlx_lm.__version__}, mlx-vlm {vlm}"


def upstream_problems() -> list[str]:
    """What an upgrade of mlx-lm or mlx-vlm changed of what this module relies on; empty
    when nothing did. Each entry names what to re-read."""
    problems = []
    for name, (lookup, fingerprint) in UPSTREAM_CODE.items():
        try:
            seen = _fingerprint(lookup())
        except (ImportError, OSError, TypeError, AttributeError) as exc:
            problems.append(f"{name}: its source cannot be read ({exc})")
            continue
        if seen != fingerprint:
            problems.append(f"{name} is not the one of mlx-lm {MLX_LM_VERSION} and "
                            f"mlx-vlm {MLX_VLM_VERSION} ({_installed()} installed; "
                            f"fingerprint {seen})")
    batch = GenerationBatch.empty(None, None)  # type: ignore[arg-type]
    for attribute in _BATCH_STATE:
        if not hasattr(batch, attribute):
            problems.append(f"mlx-lm GenerationBatch has no {attribute}")
    for attribute in ("generated", "stop_matchers", "next_tokens", "next_logprobs",
                      "take_next", "token_context", "attach", "afmd_step"):
        if hasattr(GenerationBatch, attribute):
            problems.append(f"mlx-lm GenerationBatch now has a {attribute} of its own")
    generator_state = inspect.getsource(BatchGenerator.__init__)
    if "self._generation_batch = GenerationBatch.empty" not in generator_state:
        problems.append("mlx-lm BatchGenerator keeps no _generation_batch")
    return problems
