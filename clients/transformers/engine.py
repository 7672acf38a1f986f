"""The reference engine: serve prompts through the sidecar with real transformers forward passes.

One request (``Engine.prefill`` / ``Engine.generate``)::

    own prefix cache ──> longest reusable prefix h (whole 16-token blocks, at most n - 1)
    Lookup(tokens, engine_prefix_len=h)  ──> segments tiling [0, n)
    Fetch(one span item per hit segment: its chunks, first row, length)   (one streaming call)
    fill the cache in position order:
        ENGINE_PREFIX [0, h)     copy from the own prefix cache entry
        CHUNK_HIT     [s, e)     the segment's payload rows (rows in position order), rotated to
                                 s (server, or client for raw fetches; never for the naive control)
        PREFILL       [s, e)     model(tokens[s:e], position_ids = s..e-1) attending to the
                                 whole cache so far (reused chunks included)
    the last prompt token is always prefilled (its logits give the first output token)
    ── TTFT ──
    Store(chunks this request computed exactly, payloads cut at plan.chunk_bounds)
    decode (greedy or seeded sampling); remember the sequence in the own prefix cache

Cache index == position throughout (``SequenceCache``), so transformers' causal mask and
``position_ids`` agree for every segment. A fetch miss (``ok=False``) is prefilled instead.

What is stored: every chunk of ``plan.chunk_bounds`` whose KV this request holds with its true
left context (prefilled, from the own prefix, or an EXACT hit) and that the sidecar does not
already serve whole. Chunks containing APPROXIMATE (shifted, different-context) KV are never
stored: a copy is always canonical.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import torch

from clients.transformers.attention import MIN_ROWS
from clients.transformers.attention import NAME as INVARIANT_ATTENTION
from clients.transformers.cache import SequenceCache
from clients.transformers.kv import KVAdapter
from clients.transformers.models import weights_fingerprint
from clients.transformers.options import (
    ActiveAdmission,
    ActiveRefused,
    Generation,
    PrefillResult,
    ReusePolicy,
    Rotation,
    Sampling,
    Scored,
    Step,
    Timings,
    _as_tokens,
)
from clients.transformers.prefix_cache import PrefixCache
from sidecar.client import FetchedKV, SyncSidecarClient
from sidecar.identity import CacheIdentity
from sidecar.registry.anchors import anchor_token_ids
from sidecar.registry.lookup_plan import Fidelity, LookupPlan, Segment, SegmentKind
from sidecar.rotation import RopeSpec
from sidecar.sdk.kit import is_stacked, store_chunks
from sidecar.sdk.pool import PoolClient


class Engine:
    """A single-sequence serving loop over a transformers causal LM, with the sidecar.

    Args:
      model: any transformers causal LM whose cache ``KVAdapter`` describes (GQA or MLA) and
        whose RoPE ``RopeSpec`` supports. Its device (CPU or CUDA) is used for everything.
      sidecar: a ``SyncSidecarClient`` (None: the engine runs with its own prefix cache only).
      model_id / namespace: identity fields (the weights digest, KV layout and RoPE fingerprint
        are filled in from the model; pass ``weights_hash`` to skip hashing the weights again
        when several engines share one model).
      reuse: the default ``ReusePolicy``.
      prefix_cache: the engine's own exact-prefix cache (a new 2 GiB one by default).
      rope: override the ``RopeSpec`` (for families ``from_hf_config`` does not verify).
      deterministic: pad short forward passes to ``MIN_ROWS`` rows and always compute the last
        ``MIN_ROWS`` logits rows, so that, with the ``kvs_invariant`` attention, results do not
        depend on how the sequence was split. Default: on when the model uses that attention.
      max_prefill_tokens: chunked prefill, at most this many tokens per forward pass (bounds
        the attention's working memory). Default: 1024 in deterministic mode (that attention
        materialises its scores), unlimited otherwise.
      tokenizer: the model's tokenizer (``load_tokenizer``), optional. With it the engine knows
        its chunker anchors (``anchor_token_ids``: the special tokens that open a chat message
        block, for the sidecar's ``chunker.anchor_tokens``) and its stop tokens (EOS).

    Not thread-safe; one request at a time.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        sidecar: SyncSidecarClient | None = None,
        model_id: str = "",
        namespace: str = "",
        reuse: ReusePolicy = ReusePolicy(),
        prefix_cache: PrefixCache | None = None,
        rope: RopeSpec | None = None,
        deterministic: bool | None = None,
        max_prefill_tokens: int | None = None,
        weights_hash: str | None = None,
        tokenizer: Any | None = None,
        admission: ActiveAdmission | None = None,
    ) -> None:
        self.model = model
        self.admission = admission
        self._requests = 0
        self.tokenizer = tokenizer
        #: chunker anchors for this model's chat template (empty without a tokenizer)
        self.anchor_token_ids: tuple[int, ...] = anchor_token_ids(tokenizer) if tokenizer is not None else ()
        #: EOS ids (for ``generate(stop_tokens=...)``)
        self.stop_token_ids: tuple[int, ...] = _eos_ids(tokenizer, model)
        self.config = model.config.get_text_config(decoder=True)
        self.device = next(model.parameters()).device
        self.adapter = KVAdapter.from_model(model, rope=rope)
        self.sidecar = sidecar
        self._pool: PoolClient | None | bool = None  # the sidecar's shared pool, mapped on first use
        self.reuse = reuse
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        impl = getattr(model.config, "_attn_implementation", None)
        self.deterministic = impl == INVARIANT_ATTENTION if deterministic is None else deterministic
        if max_prefill_tokens is None:
            max_prefill_tokens = 1024 if self.deterministic else 0
        self.max_prefill_tokens = max_prefill_tokens
        name = model_id or f"{self.config.model_type}:{getattr(model.config, 'name_or_path', '') or 'random'}"
        self.identity = CacheIdentity(
            model_id=name,
            weights_hash=weights_hash if weights_hash is not None else weights_fingerprint(model),
            kv_layout=self.adapter.layout.fingerprint(),
            rope_fingerprint=self.adapter.rope.fingerprint,
            namespace=namespace,
        )
        self._base = model.base_model  # the decoder stack without the LM head

    @property
    def layout(self):
        return self.adapter.layout

    @property
    def rope(self) -> RopeSpec:
        return self.adapter.rope

    def warm(self, tokens: Any, *, shared: bool = False) -> int:
        """Prefill ``tokens`` once from position 0 and Store their chunks (into the shared scope
        with ``shared``): one warm-up plan sequence (``SidecarClient.warm_up``, docs/manifests.md).
        Returns the chunks stored."""
        if self.sidecar is None:
            raise ValueError("warm: the engine has no sidecar to Store into")
        reuse = replace(self.reuse, sidecar=True, store=True, store_shared=shared)
        return self.prefill(tokens, reuse=reuse).stored_chunks

    def with_namespace(self, namespace: str) -> None:
        """Switch the identity's namespace (isolates benchmark arms on one sidecar)."""
        self.identity = replace(self.identity, namespace=namespace)

    # ------------------------------------------------------------------ public API

    def prefill(self, tokens: Any, *, reuse: ReusePolicy | None = None, reserve: int = 0) -> PrefillResult:
        """Run a prompt up to its first-token logits (and Store / remember it per ``reuse``).

        ``reserve`` extra positions are preallocated for decoding."""
        reuse = reuse or self.reuse
        res = self._prefill(_as_tokens(tokens), reuse, reserve)
        if reuse.store and reuse.prefix_cache:
            self.prefix_cache.insert(res.tokens, res.cache)
        return res

    def generate(
        self,
        tokens: Any,
        *,
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        reuse: ReusePolicy | None = None,
        stop_tokens: Sequence[int] = (),
        return_logprobs: bool = False,
    ) -> Generation:
        """Prefill, then decode up to ``max_new_tokens`` tokens (stopping after a stop token).
        ``return_logprobs``: keep each step's distribution (the same rows ``score`` returns for
        these tokens, without a second pass)."""
        if max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        reuse = reuse or self.reuse
        prompt = _as_tokens(tokens)
        res = self._prefill(prompt, reuse, max_new_tokens)
        gen = torch.Generator(device="cpu").manual_seed(sampling.seed)
        out = Generation(prompt=res)
        stop = set(int(t) for t in stop_tokens)
        t0 = time.perf_counter()
        logits = res.logits
        pos = len(prompt)
        rows: list[torch.Tensor] = []
        while True:
            tok = _select(logits, sampling, gen)
            out.tokens.append(tok)
            if return_logprobs:
                rows.append(logits)
            if len(out.tokens) >= max_new_tokens or tok in stop:
                break
            logits = self._decode(res.cache, tok, pos)
            pos += 1
        self._sync()
        res.timings.decode_s = time.perf_counter() - t0
        if return_logprobs:
            out.logprobs = torch.log_softmax(torch.stack(rows).float(), dim=-1)
        if reuse.store and reuse.prefix_cache:
            seq = np.concatenate([prompt, np.asarray(out.tokens[:-1], dtype=np.uint32)])
            self.prefix_cache.insert(seq, res.cache)
        return out

    def score(self, tokens: Any, continuation: Sequence[int], *, reuse: ReusePolicy | None = None) -> Scored:
        """Teacher-forced next-token log-probabilities ``float32 [len(continuation), vocab]``:
        row t is the distribution for ``continuation[t]`` given the prompt (built through
        ``reuse``'s cache path) and ``continuation[:t]``, decoded one token at a time. Never
        updates the own prefix cache (the prompt may still be Stored per ``reuse.store``)."""
        reuse = reuse or self.reuse
        prompt = _as_tokens(tokens)
        res = self._prefill(prompt, reuse, len(continuation))
        rows = [res.logits]
        pos = len(prompt)
        for tok in list(continuation)[:-1]:
            rows.append(self._decode(res.cache, int(tok), pos))
            pos += 1
        return Scored(logprobs=torch.log_softmax(torch.stack(rows).float(), dim=-1), prompt=res)

    # ------------------------------------------------------------------ the request path

    def _admit(self, n_tokens: int) -> None:
        """``ActiveAdmission``: AdmitActive before a large prefill (returns once admitted)."""
        adm = self.admission
        if adm is None or self.sidecar is None:
            return
        blocks = -(-n_tokens // adm.block_size)
        if blocks < adm.min_blocks:
            return
        self._requests += 1
        rid = f"{self.identity.namespace or 'engine'}-{self._requests}"
        deferrals = 0
        while True:
            if adm.pool_blocks is not None:
                self.sidecar.report_pool(usable_blocks=adm.pool_blocks, free_blocks=adm.pool_blocks,
                                         block_size=adm.block_size, hard_protection=True, engine_id="transformers")
            resp = self.sidecar.admit_active(rid, blocks)
            decision = resp.decision.value  # sidecar.claims.Admit: "admitted" | "deferred" | "refused"
            if decision == "admitted":
                return
            if decision == "deferred" and deferrals < adm.max_deferrals:
                deferrals += 1
                adm.sleep(resp.retry_after_s)
                continue
            raise ActiveRefused(rid, decision, tuple(resp.blocking_claim_ids), resp.proof, resp.reason)

    def _prefill(self, tokens: np.ndarray, reuse: ReusePolicy, reserve: int) -> PrefillResult:
        self._admit(len(tokens) + reserve)  # raises ActiveRefused: the request is not run
        clock = time.perf_counter
        tm = Timings()
        t_start = clock()
        n = len(tokens)
        use_sidecar = reuse.sidecar and self.sidecar is not None

        entry, h = self.prefix_cache.match(tokens) if reuse.prefix_cache else (None, 0)
        plan: LookupPlan | None = None
        if use_sidecar:
            t0 = clock()
            kw: dict[str, Any] = {"policy": reuse.admission}
            if reuse.admission != "exact":
                kw["left_context_window"] = reuse.left_context_window
                kw["recompute_tokens"] = reuse.recompute_tokens
                kw["repair_scope"] = reuse.repair_scope
            plan = self.sidecar.lookup(tokens, identity=self.identity, engine_prefix_len=h, **kw)
            tm.lookup_s = clock() - t0
            segments = plan.segments
        else:
            segments = ([Segment(SegmentKind.ENGINE_PREFIX, 0, h)] if h else []) + [Segment(SegmentKind.PREFILL, h, n)]

        hits = [s for s in segments if s.kind is SegmentKind.CHUNK_HIT]
        if hits and sum(len(s) for s in hits) < reuse.min_fetch_tokens:
            segments = [Segment(SegmentKind.PREFILL, s.start, s.end) if s.kind is SegmentKind.CHUNK_HIT else s
                        for s in segments]
            hits = []
        fetched: list[FetchedKV] = []
        if hits:
            t0 = clock()
            # One Fetch item per hit segment (a span of chunks, rows in position order); hits are
            # all of the plan's (``min_fetch_tokens`` keeps all or none).
            pool = self._shared_pool(reuse) if reuse.rotation is Rotation.SERVER else None
            if pool is not None:  # rotated here, straight from the sidecar's pool
                fetched = pool.fetch(plan.fetch_spans(), identity=self.identity, layout=self.layout, rope=self.rope)
            else:
                fetched = self.sidecar.fetch(
                    plan.fetch_spans(), identity=self.identity,
                    layout=self.layout, rope=self.rope, raw=reuse.rotation is not Rotation.SERVER,
                )
            tm.fetch_s = clock() - t0
        steps = _schedule(segments, fetched, n)

        cache = self.adapter.new_cache(n + reserve + MIN_ROWS)
        res = PrefillResult(tokens=tokens, cache=cache, logits=None, plan=plan, steps=steps, timings=tm)
        if h:
            t0 = clock()
            cache.extend(h)
            for dst, src in zip(cache.layers, entry.cache.layers):
                dst._kbuf[:, :, :h].copy_(src._kbuf[:, :, :h])
                dst._vbuf[:, :, :h].copy_(src._vbuf[:, :, :h])
            self._sync()
            tm.prefix_s = clock() - t0
        res.prefix_tokens = h

        logits = None
        write = self.adapter.writer(cache)
        for st in steps:
            if st.kind == "hit":
                f = st.fetched
                t0 = clock()
                start = cache.extend(st.end - st.start)
                assert start == st.start, f"cache filled out of order: at {start}, segment starts at {st.start}"
                if reuse.rotation is Rotation.CLIENT and f.delta != 0 and not f.rotated:
                    view = self.adapter.decode(bytearray(f.data), f.num_tokens)
                    t1 = clock()
                    self.adapter.rotate_(view, f.delta)
                    tm.rotate_s += clock() - t1
                    self.adapter.write(cache, view, st.offset, st.start, st.end)
                else:
                    write(f.data, f.num_tokens, st.offset, st.start, st.end)
                tm.assemble_s += clock() - t0
                res.fetch_bytes += len(f.data)
                if st.fidelity is Fidelity.EXACT:
                    res.exact_tokens += st.end - st.start
                else:
                    res.shifted_tokens += st.end - st.start
            else:
                t0 = clock()
                assert cache.length == st.start, f"cache filled out of order: at {cache.length}, prefill at {st.start}"
                step = self.max_prefill_tokens or (st.end - st.start)
                for a in range(st.start, st.end, step):
                    b = min(st.end, a + step)
                    out = self._forward(cache, tokens[a:b], a, want_logits=b == n)
                if st.end == n:
                    logits = out
                self._sync()
                tm.prefill_s += clock() - t0
                res.prefill_tokens += st.end - st.start
        tm.assemble_s -= tm.rotate_s  # assembly was timed around the client-side rotation
        assert cache.length == n and logits is not None, "the schedule must end with a prefill of the last token"
        res.logits = logits
        res.fetch_misses = sum(1 for f in fetched if not f.ok)
        tm.ttft_s = clock() - t_start

        if use_sidecar and reuse.store:
            t0 = clock()
            res.stored_chunks = self._store(tokens, plan, steps, cache, reuse.store_shared)
            tm.store_s = clock() - t0
        return res

    def _store(
        self, tokens: np.ndarray, plan: LookupPlan, steps: list[Step], cache: SequenceCache, shared: bool = False
    ) -> int:
        # not the chunks holding shifted KV (an approximation, never stored as canonical), nor
        # those the sidecar already serves whole (the hits this request loaded)
        approx = [(s.start, s.end) for s in steps if s.kind == "hit" and s.fidelity is not Fidelity.EXACT]
        served = [(s.start, s.end) for s in steps if s.kind == "hit"]
        chunks = store_chunks(plan, n=len(tokens), approximate=approx, served=served)
        if not chunks:
            return 0
        payloads = {a: self.adapter.payload(cache, a, b) for a, b in chunks}
        pool = self._shared_pool(self.reuse)
        res = (pool or self.sidecar).store(
            tokens, identity=self.identity, layout=self.layout, payloads=payloads,
            register_from=int(plan.chunk_bounds[0]),
            shared=shared,
        )
        return res.chunks_stored

    def _shared_pool(self, reuse: ReusePolicy) -> PoolClient | None:
        """The sidecar's shared pool when this engine may use it (on its host, GQA / MHA)."""
        if not reuse.shared_pool or not is_stacked(self.layout):
            return None
        if self._pool is None:
            try:
                self._pool = PoolClient(self.sidecar)
            except Exception:  # noqa: BLE001 - an older sidecar, or none: Fetch and Store
                self._pool = False
        return self._pool if self._pool and self._pool.available else None

    # ------------------------------------------------------------------ forward passes

    def _forward(self, cache: SequenceCache, ids: np.ndarray, start: int, *, want_logits: bool) -> torch.Tensor | None:
        """Prefill ``ids`` at positions ``start ..`` into ``cache``; logits of the last one if wanted.

        Deterministic mode pads passes shorter than ``MIN_ROWS`` with dummy tokens after the
        real ones (causal: the real ones never see them; their KV is dropped again) and always
        computes ``MIN_ROWS`` logits rows, so every matmul runs at a size whose per-row results
        do not depend on the batch.
        """
        q = len(ids)
        pad = max(0, MIN_ROWS - q) if self.deterministic else 0
        x = torch.as_tensor(ids.astype(np.int64), device=self.device)
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        pos = torch.arange(start, start + q + pad, device=self.device)
        with torch.inference_mode():
            if want_logits:
                keep = MIN_ROWS if self.deterministic else 1
                out = self.model(input_ids=x[None], position_ids=pos[None], past_key_values=cache, use_cache=True,
                                 logits_to_keep=keep)
                logits = out.logits[0, keep - 1 - pad].float()
            else:
                self._base(input_ids=x[None], position_ids=pos[None], past_key_values=cache, use_cache=True)
                logits = None
        if pad:
            cache.truncate(start + q)
        return logits

    def _decode(self, cache: SequenceCache, token: int, pos: int) -> torch.Tensor:
        x = torch.tensor([[token]], device=self.device)
        p = torch.tensor([[pos]], device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=x, position_ids=p, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _schedule(segments: list[Segment], fetched: list[FetchedKV], n: int) -> list[Step]:
    """``fetched``: one result per hit segment (span), in order."""
    """Executable steps in position order: ENGINE_PREFIX is already in the cache, hits that
    missed become prefills, adjacent prefills merge, and the last token is always prefilled."""
    steps: list[Step] = []
    it = iter(fetched)

    def add_prefill(s: int, e: int) -> None:
        if e <= s:
            return
        if steps and steps[-1].kind == "prefill" and steps[-1].end == s:
            steps[-1].end = e
        else:
            steps.append(Step("prefill", s, e))

    f: FetchedKV | None = None
    span_start = prev_end = prev_delta = -1
    for seg in segments:
        if seg.kind is SegmentKind.ENGINE_PREFIX:
            continue
        if seg.kind is SegmentKind.CHUNK_HIT:
            if seg.start != prev_end or seg.delta != prev_delta:  # the next hit segment (span)
                f = next(it)
                span_start = seg.start
            prev_end, prev_delta = seg.end, seg.delta
            if f.ok:
                last = steps[-1] if steps else None
                if (last is not None and last.kind == "hit" and last.fetched is f and last.end == seg.start
                        and last.fidelity is seg.fidelity):
                    last.end = seg.end
                else:
                    steps.append(Step("hit", seg.start, seg.end, seg.fidelity, f, seg.start - span_start))
                continue
        add_prefill(seg.start, seg.end)
    last = steps[-1] if steps else None
    if last is None or last.kind == "hit":
        if last is not None and last.end == n:
            last.end = n - 1
            if last.end <= last.start:
                steps.pop()
        add_prefill(n - 1, n)
    return steps


def _eos_ids(tokenizer: Any | None, model: torch.nn.Module) -> tuple[int, ...]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return ()
    return tuple(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids]))


def _select(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> int:
    if sampling.greedy:
        return int(torch.argmax(logits))
    z = logits.float().cpu() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(z, min(sampling.top_k, z.numel())).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1.0:
        order = torch.argsort(z, descending=True)
        probs = torch.softmax(z[order], dim=-1)
        cut = torch.cumsum(probs, 0) - probs > sampling.top_p  # keep the smallest set reaching top_p
        z[order[cut]] = float("-inf")
    probs = torch.softmax(z, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))

