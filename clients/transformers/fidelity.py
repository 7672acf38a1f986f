"""Output consistency of cache paths against full prefill (the seeds' consistency study).

Teacher forcing: the full-prefill greedy trajectory ``y`` (``T`` tokens) is fed through every
cache path, so each path is scored on the same contexts::

    reference   p_full(. | prompt, y[:t])   prompt prefilled from scratch
    arm         p_arm (. | prompt, y[:t])   prompt assembled through the arm's cache path

    KL_t            = sum_v p_full(v) (log p_full(v) - log p_arm(v))      per token, nats
    agreement       = mean_t [argmax p_arm(. | ..., y[:t]) == y_t]         (y_t = argmax p_full)
    first_divergence = the first t where they disagree (None: never)
    bit_identical   = every log-probability equal, bit for bit
    answer_match    = the arm's greedy answer (up to the first stop token) equals full
                      prefill's: argmax agrees on every answer step

Arms (``ARMS``): full prefill; exact-prefix reuse (the engine's own prefix cache); sidecar
position-independent reuse with the sidecar's default guards (``sidecar``); the sidecar's
``exact`` policy without the own prefix cache (``sidecar_exact``: identical-left-context hits
only, which must reproduce full prefill bit for bit); position-independent with explicit
``recompute_tokens`` 0, 8 and 32; with the left-context window guard (W=32); and naive reuse
without rotation (a control that must come out worse). ``SWEEP_ARMS`` is the finer sweep the
real-model benchmark chooses the default from. None of
the arms Store or update the prefix cache (``store=False``), so all see the same cache state.

With random-weight models this is a mechanics check, not a quality claim: it shows that the
cache paths put the right KV at the right positions (prefix reuse bit-identical, rotated reuse
close, unrotated reuse far), not how a trained model's answers change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from clients.transformers.engine import Engine
from clients.transformers.options import ReusePolicy, Rotation, Sampling

DISCLAIMER = (
    "Random-weight models: a mechanics check of the cache paths (right KV at the right positions), "
    "not a quality claim about a trained model."
)

def _pi(k: int, *, window: int = 0, repair: str = "chunk") -> ReusePolicy:
    """Position-independent reuse with explicit guards (recompute k tokens at every stored
    chunk's start, or once per hit segment with ``repair="segment"``; window W)."""
    return ReusePolicy(recompute_tokens=k, left_context_window=window, repair_scope=repair, store=False)


ARMS: Mapping[str, ReusePolicy] = {
    "full_prefill": ReusePolicy(prefix_cache=False, sidecar=False, store=False),
    "exact_prefix": ReusePolicy(prefix_cache=True, sidecar=False, store=False),
    "sidecar": ReusePolicy(store=False),
    "sidecar_exact": ReusePolicy(prefix_cache=False, admission="exact", store=False),
    "sidecar_k0": _pi(0),
    "sidecar_k8": _pi(8),
    "sidecar_k32": _pi(32),
    "sidecar_w32": _pi(0, window=32),
    "naive_no_rotation": ReusePolicy(rotation=Rotation.NONE, recompute_tokens=0, left_context_window=0, store=False),
}

#: The real-model sweep (bench/quality.py): the guards the default is chosen from.
SWEEP_ARMS: Mapping[str, ReusePolicy] = {
    "full_prefill": ARMS["full_prefill"],
    "exact_prefix": ARMS["exact_prefix"],
    "sidecar_exact": ARMS["sidecar_exact"],
    "sidecar_k0": _pi(0),
    "sidecar_k4": _pi(4),
    "sidecar_k8": _pi(8),
    "sidecar_k16": _pi(16),
    "sidecar_k32": _pi(32),
    "sidecar_k4_segment": _pi(4, repair="segment"),
    "sidecar_w32": _pi(0, window=32),
    "naive_no_rotation": ARMS["naive_no_rotation"],
}

#: Warm-up requests go through this policy (they fill the own prefix cache and the sidecar).
WARM = ReusePolicy()


@dataclass(frozen=True, slots=True)
class ArmResult:
    arm: str
    mean_kl: float
    max_kl: float
    agreement: float
    first_divergence: int | None
    bit_identical: bool
    recovered_tokens: int
    shifted_tokens: int
    prefill_tokens: int
    prompt_tokens: int
    #: length of full prefill's greedy answer (up to and including its first stop token)
    answer_tokens: int = 0
    #: the arm's greedy answer equals full prefill's (argmax agrees on every answer step)
    answer_match: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


def kl_per_token(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``KL(p_ref || p)`` per row of two ``[T, V]`` log-probability tensors (nats, float64)."""
    ref = ref_logp.double()
    return (ref.exp() * (ref - logp.double())).sum(-1).clamp_min(0.0)


def compare(ref_logp: torch.Tensor, logp: torch.Tensor, forced: Sequence[int]) -> dict:
    """Per-token metrics of one arm against the reference (see the module docstring)."""
    kl = kl_per_token(ref_logp, logp)
    agree = (logp.argmax(-1).cpu() == torch.as_tensor(list(forced))).numpy()
    bad = np.flatnonzero(~agree)
    return {
        "kl": kl.cpu().numpy(),
        "agree": agree,
        "first_divergence": int(bad[0]) if len(bad) else None,
        "bit_identical": bool(torch.equal(ref_logp, logp)),
    }


def answer_length(forced: Sequence[int], stop_tokens: Sequence[int]) -> int:
    """Tokens of the greedy answer: up to and including the first stop token (all if none)."""
    stop = set(int(t) for t in stop_tokens)
    for i, t in enumerate(forced):
        if int(t) in stop:
            return i + 1
    return len(forced)


def evaluate(
    engine: Engine,
    warm: Sequence[np.ndarray],
    target: np.ndarray,
    *,
    new_tokens: int = 32,
    arms: Mapping[str, ReusePolicy] = ARMS,
) -> list[ArmResult]:
    """Run ``warm`` requests (filling the engine's prefix cache and the sidecar), then score
    ``target`` through every arm against full prefill, teacher-forcing the full-prefill
    greedy continuation of ``new_tokens`` tokens."""
    for w in warm:
        engine.prefill(w, reuse=WARM)
    return evaluate_target(engine, target, new_tokens=new_tokens, arms=arms)


def evaluate_target(
    engine: Engine,
    target: np.ndarray,
    *,
    new_tokens: int = 32,
    arms: Mapping[str, ReusePolicy] = ARMS,
) -> list[ArmResult]:
    """Score ``target`` through every arm against full prefill (caches as they are now: no arm
    changes them). The greedy answer of an arm equals full prefill's exactly when its argmax
    agrees with the forced token on every answer step (before the first disagreement the arm's
    own greedy prefix IS the forced prefix), so one teacher-forced pass gives both."""
    full = arms.get("full_prefill", ARMS["full_prefill"])
    ref_gen = engine.generate(target, max_new_tokens=new_tokens, sampling=Sampling(), reuse=full,
                              return_logprobs=True)
    forced = ref_gen.tokens
    ref = ref_gen.logprobs
    n_answer = answer_length(forced, engine.stop_token_ids)
    out = []
    for name, policy in arms.items():
        if name == "full_prefill":
            logprobs, pre = ref, ref_gen.prompt  # the reference itself
        else:
            scored = engine.score(target, forced, reuse=policy)
            logprobs, pre = scored.logprobs, scored.prompt
        m = compare(ref, logprobs, forced)
        out.append(
            ArmResult(
                arm=name,
                mean_kl=float(m["kl"].mean()),
                max_kl=float(m["kl"].max()),
                agreement=float(m["agree"].mean()),
                first_divergence=m["first_divergence"],
                bit_identical=m["bit_identical"],
                recovered_tokens=pre.recovered_tokens,
                shifted_tokens=pre.shifted_tokens,
                prefill_tokens=pre.prefill_tokens,
                prompt_tokens=len(pre.tokens),
                answer_tokens=n_answer,
                answer_match=bool(m["agree"][:n_answer].all()),
            )
        )
    return out


def format_table(rows: Sequence[ArmResult], title: str = "") -> str:
    head = f"{'arm':<20} {'mean KL':>10} {'max KL':>10} {'argmax agree':>12} {'1st div':>7} {'bit-id':>6} {'reused':>7} {'shifted':>7} {'prefill':>7}"
    lines = [title, head, "-" * len(head)] if title else [head, "-" * len(head)]
    for r in rows:
        fd = "-" if r.first_divergence is None else str(r.first_divergence)
        lines.append(
            f"{r.arm:<20} {r.mean_kl:>10.2e} {r.max_kl:>10.2e} {r.agreement:>12.1%} {fd:>7} {str(r.bit_identical):>6} "
            f"{r.recovered_tokens:>7} {r.shifted_tokens:>7} {r.prefill_tokens:>7}"
        )
    return "\n".join(lines)
