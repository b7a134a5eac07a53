"""A loaded model run once on its generation thread before it serves (the GPU path).

A GPU backend compiles kernels the first time it meets them: Metal's and CUDA's JIT
kernels (gathers, fused element-wise code, sampling), CUDA's cuBLAS heuristics and cuDNN
handles, and the graphs MLX's CUDA backend captures. Without this a fresh server's first
request paid for all of it, in its time to first token and its decode rate
(bench/results/history.md, "The GPU path", has the numbers). Here that cost is paid while
the model loads, on the generation thread itself (MLX's generation stream is per thread,
and so are cuDNN's attention plans), through the same decode step requests take: two rows
decoded together (one greedy reporting log-probabilities, one sampled), then one alone.

On every path, the model's chat template is compiled here too (Jinja's compile of a
template is a first request's largest host-side cost; transformers keeps it per template).

Nothing of it remains afterwards: no prefix-cache entry, no row, no key of a request.
Shapes a request brings later (its prompt length, the batch size) still meet their own
first time; those are small next to the compilation done here.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from afmd.engine.batch.logprobs import resolve
from afmd.engine.batch.sampler import RowSampler
from afmd.engine.batch.stepper import Stepper
from afmd.engine.generation import SamplingParams

#: Tokens each warm-up row decodes: enough for a first token (mlx-lm's own step), then
#: afmd's step with and without a row joining or leaving.
_TOKENS = 4


def warm_up(stepper: Stepper) -> float:
    """Decode a few tokens through ``stepper`` (freshly reset); seconds it took."""
    started = time.perf_counter()
    vocab = _vocab(stepper)
    prompts = [[(7 * i + 3) % vocab for i in range(12)], [(11 * i + 5) % vocab for i in range(9)]]
    sampler = RowSampler(SamplingParams(temperature=0.7, top_p=0.9, top_k=40), seed=0)
    greedy = stepper.insert(prompts[0], prompts[0], None, max_tokens=_TOKENS, sampler=None,
                            processors=[])
    sampled = stepper.insert(prompts[1], prompts[1], None, max_tokens=_TOKENS,
                             sampler=sampler, processors=[])
    batch = stepper.batch
    if batch is not None:
        batch.logprob_rows[greedy] = 2
    _drain(stepper, {greedy, sampled})
    alone = stepper.insert(prompts[0][:5], prompts[0][:5], None, max_tokens=_TOKENS,
                           sampler=None, processors=[])
    _drain(stepper, {alone})
    for uid in (greedy, sampled, alone):
        stepper.forget(uid)
    mx.clear_cache()
    return time.perf_counter() - started


def compile_template(tokenizer: Any) -> None:
    """Render a one-message conversation, so the template is compiled before a request
    needs it; a template that refuses this conversation is left to the requests."""
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                      add_generation_prompt=True, tokenize=False)
    except Exception:  # a request renders it again and reports what is wrong
        return


def _drain(stepper: Stepper, uids: set[int]) -> None:
    """Step until every row in ``uids`` finished, reading back what a request would."""
    left = set(uids)
    while left:
        for response in stepper.next():
            if response.logprobs is not None:
                resolve(response.logprobs, response.token, 2)
            if response.finish_reason is not None:
                left.discard(response.uid)


def _vocab(stepper: Stepper) -> int:
    args: Any = getattr(stepper.model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if size else max(len(stepper.tokenizer.vocab), 16)
