"""Sampling parameters: validation, logits -> probabilities, seeded sampling.

Both sides use :func:`probs_from_logits`, so the distribution the drafter samples from (q) and
the one the verifier checks against (p) are processed exactly the same way: temperature first,
then top-k, then top-p (nucleus), as in vLLM and Hugging Face.
"""

from __future__ import annotations

import hashlib
import secrets

import torch

from shared.protocol import MAX_LOGIT_BIAS, SamplingParams

__all__ = [
    "SamplingError",
    "SamplingParams",
    "hashed_generator",
    "is_greedy",
    "make_generator",
    "probs_from_logit_rows",
    "probs_from_logits",
    "sample",
    "validate",
]


class SamplingError(ValueError):
    """A request's sampling parameters are unusable. ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def validate(params: SamplingParams, prompt_len: int, max_model_len: int) -> None:
    """Raise SamplingError (with the field name) if the request cannot be served as asked."""
    if not 0.0 <= params.temperature <= 2.0:
        raise SamplingError(f"temperature must be in [0, 2], got {params.temperature}", "temperature")
    if not 0.0 < params.top_p <= 1.0:
        raise SamplingError(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if params.top_k < 0:
        raise SamplingError(f"top_k must be >= 0 (0 disables it), got {params.top_k}", "top_k")
    _validate_penalties(params)
    if params.max_tokens < 1:
        raise SamplingError(f"max_tokens must be >= 1, got {params.max_tokens}", "max_tokens")
    if prompt_len >= max_model_len:
        raise SamplingError(
            f"the prompt is {prompt_len} tokens; this model's context is {max_model_len} tokens. "
            "Shorten the prompt.",
            "messages",
        )
    if prompt_len + params.max_tokens > max_model_len:
        raise SamplingError(
            f"max_tokens={params.max_tokens} plus the {prompt_len}-token prompt exceeds the "
            f"{max_model_len}-token context; ask for at most {max_model_len - prompt_len} tokens.",
            "max_tokens",
        )


def _validate_penalties(params: SamplingParams) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise SamplingError(f"{name} must be in [-2, 2], got {value}", name)
    if not 0.0 < params.repetition_penalty <= 10.0:
        raise SamplingError(f"repetition_penalty must be in (0, 10] (1 disables it), got {params.repetition_penalty}",
                            "repetition_penalty")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise SamplingError(f"logit_bias may list at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    if any(not -100.0 <= b <= 100.0 for b in params.logit_bias.values()):
        raise SamplingError("each logit_bias value must be in [-100, 100]", "logit_bias")


#: Temperatures below this are served as greedy: dividing logits by them overflows float32.
GREEDY_BELOW = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits ``[..., V]`` into the exact distribution that is sampled from.

    Greedy (temperature below GREEDY_BELOW) gives a one-hot on the argmax. Computation is in
    float32; the softmax subtracts each row's maximum, so small temperatures cannot overflow.
    """
    logits = logits.float()
    if is_greedy(params):
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    rows = logits.reshape(-1, logits.shape[-1])
    n = rows.shape[0]
    probs = probs_from_logit_rows(rows, [params.temperature] * n, [params.top_k] * n, [params.top_p] * n)
    return probs.view(logits.shape)


#: top-p looks for a row's nucleus among its tokens within this many logits (after temperature) of its
#: largest (each token further below is at most e^-10 as likely as the likeliest); a row whose candidates
#: carry less than its top_p sorts the whole row instead. Sorting SmolLM2's 49,152 logits took 3.4 ms of one
#: core of an AVX512-BF16 EPYC, a sort per verified row (and per raced draft token) of every request that sets
#: top_p; over the Q4_1 copy's logits on held-out answers the candidates numbered 764 (median) and carried at
#: least 0.95 of the mass in every one of 200 rows (2026-12-07).
NUCLEUS_SPAN = 10.0


def probs_from_logit_rows(
    logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """The sampled distribution of each row of ``logits [R, V]``, each row with its own settings.

    Temperature first, then top-k (ties with the k-th logit stay in), then top-p: the smallest
    set of most likely tokens whose mass reaches top_p (a token is dropped when the mass strictly
    before it already reaches top_p; at least one token stays). Rows must not be greedy. Each row's
    result depends on that row alone, never on the others in the batch.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if all(t == 1.0 for t in temperature):  # the OpenAI default: no division over the whole batch
        x = logits
    else:  # softmax subtracts each row's maximum itself; logits / 1e-5 stays far from float32's limit
        x = logits / torch.tensor(temperature, dtype=torch.float32, device=logits.device).unsqueeze(1)
    cut_k = [k if 0 < k < vocab else vocab for k in top_k]
    if min(cut_k) < vocab:  # the k-th largest of each row (ties with it stay in); -inf: no top-k
        most = max(k for k in cut_k if k < vocab)
        tops = x.topk(most, dim=-1).values
        kth = tops.gather(-1, torch.tensor([min(k, most) - 1 for k in cut_k], device=x.device).unsqueeze(1))
        kth[torch.tensor([k == vocab for k in cut_k], device=x.device)] = float("-inf")
        x = x.masked_fill(x < kth, float("-inf"))
    if nucleus_rows := [r for r, p in enumerate(top_p) if p < 1.0]:
        index = torch.tensor(nucleus_rows, device=x.device)
        rows = x.index_select(0, index)
        x = x.index_copy(0, index, rows.masked_fill(~_nucleus(rows, [top_p[r] for r in nucleus_rows]), float("-inf")))
    return x.softmax(-1)


def _nucleus(x: torch.Tensor, limit: list[float]) -> torch.Tensor:
    """Which tokens of each row of ``x [R, V]`` top-p keeps (``limit``: each row's top_p): those whose mass
    before them, most likely first, is below it. The probabilities are the row's softmax, summed in that
    order (on a CPU ``cumsum`` adds one at a time, so a prefix's sums do not depend on what follows it), so
    sorting the candidates within :data:`NUCLEUS_SPAN` of the largest, when they carry the top_p, keeps what
    sorting the whole row does."""
    probs = x.softmax(-1)
    keep = torch.zeros_like(x, dtype=torch.bool)
    for r, (row, top_p) in enumerate(zip(x, limit, strict=True)):
        near = (row >= row.max() - NUCLEUS_SPAN).nonzero().squeeze(1)
        order = near[row[near].argsort(descending=True)]
        ranked = probs[r, order]
        mass = ranked.cumsum(-1)
        if len(order) < len(row) and (not len(order) or float(mass[-1]) < top_p):  # it may reach past them
            order = row.argsort(descending=True)
            ranked = probs[r, order]
            mass = ranked.cumsum(-1)
        keep[r, order] = mass - ranked < top_p
    return keep


#: The independent random streams of one request: the drafter's choices and the verifier's. (A
#: third source, the keyed race of shared.coupling, is shared by both sides on purpose.)
STREAMS = ("draft", "verify")


def make_generator(seed: int | None, stream: str) -> torch.Generator:
    """A CPU generator for one of a request's random streams (``STREAMS``).

    A seeded request is reproducible, and its streams are still independent: each is seeded by a
    hash of (stream, seed), so the drafter's draws never line up with the verifier's acceptance
    uniforms (sharing one seed biased the output by about 1 percentage point). Without a seed,
    fresh entropy.
    """
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r}; one of {', '.join(STREAMS)}")
    if seed is None:
        return torch.Generator(device="cpu").manual_seed(secrets.randbits(63))
    return hashed_generator(f"{stream}:{seed}")


def hashed_generator(label: str) -> torch.Generator:
    """A CPU generator seeded by a hash of ``label``: the same label, the same draws, anywhere."""
    digest = hashlib.blake2b(label.encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """Draw one index from a 1-D vector of probabilities (or weights), by inverting its CDF.

    One uniform from ``gen``, a float64 cumulative sum and a binary search: exact, a zero entry is
    never drawn (the search takes the first index whose cumulative sum exceeds u * total), and
    about 3x cheaper than ``torch.multinomial`` on a large vocabulary.
    """
    cdf = probs.detach().to("cpu", torch.float64).cumsum(0)
    u = torch.rand(1, generator=gen, dtype=torch.float64)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), cdf.shape[0] - 1)
