"""Radix-cache backend plug-in: SGLang's RadixCache plus the sidecar's position-independent hits
and Splice plans, at token granularity (docs/sglang.md).

Registered through SGLang's own mechanism: ``register()`` calls
``sglang.srt.mem_cache.registry.register_radix_cache_backend("kv_sidecar", factory)``; expose it
as a general plug-in (entry point group ``sglang.srt.plugins``, loaded by ``load_plugins()``)::

    [project.entry-points."sglang.srt.plugins"]
    kv_sidecar = "clients.sglang.radix:register"

and select it with ``--radix-cache-backend kv_sidecar``. Settings come from
``$KV_SIDECAR_SGLANG`` (JSON: ``target``, ``tenant``, ``token``, ``model_id``, ``namespace``,
``policy``, ``recompute_tokens``, ``left_context_window``, ``rope``: {``theta``,
``rotary_dim``, ``neox``}) or ``$KV_SIDECAR_TARGET``.

What it adds to ``RadixCache`` (SGLang's pools are token-granular: ``req_to_token`` rows of
token slots, block size 1):

* ``match_prefix``: the radix tree's device prefix, then one sidecar Lookup with
  ``engine_prefix_len`` = that prefix. The result is a ``SidecarMatchResult`` (a
  ``MatchResult``): ``host_hit_length`` is the run of sidecar hits directly after the device
  prefix (what SGLang's scheduler loads through ``init_load_back``), and ``sidecar_hits`` lists
  every CHUNK_HIT segment ``[start, end)`` of the prompt, including shifted chunks after a
  prefill gap (which SGLang's prefix-only scheduler cannot express; ``load_hits`` places them).
* ``load_hits``: allocates a token slot per hit token, Fetches the chunks with their rotary
  keys rotated to the new positions (RoPE delta rotation), writes K/V into the device pool's
  per-layer buffers and the slots into ``req_to_token``.
* ``init_load_back``: loads the contiguous run and hangs it under the matched node (the
  FlexKV pattern), so the scheduler sees a longer device prefix.
* ``store_prompt``: Stores a computed prompt's KV (read from the pool rows of its slots) at
  the sidecar's chunk boundaries, so other engines find it at any position.
* ``apply_splice_plan``: applies a Splice ``OpPlan`` opened with ``block_size=1`` to a
  ``req_to_token`` row: ALLOCATE -> allocator slots, MOVE -> row rewrite (and copies where
  ``src != dst``), FREE -> allocator free, ROTATE -> in-place rotation of the pool's K rows;
  PREFILL / REFRESH are returned for the engine's forward pass.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from sidecar.client import SyncSidecarClient
from sidecar.directives import OpPlan
from sidecar.directives.op_plan import OpKind
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.registry.lookup_plan import LookupPlan, Segment
from sidecar.rotation import Pairing, RopeSpec, RotaryLayout, rotate_slots_
from sidecar.sdk.kit import load_item, load_run, stacked_payload, stacked_view

logger = logging.getLogger(__name__)

BACKEND_NAME = "kv_sidecar"

_TORCH_TO_LAYOUT = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def rope_spec(*, head_dim: int, theta: float = 10000.0, rotary_dim: Optional[int] = None, neox: bool = True) -> RopeSpec:
    """The default-RoPE spec of SGLang's ``get_rope`` keys (rotary dims leading)."""
    rd = rotary_dim or head_dim
    inv = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.int64).to(torch.float) / rd))
    return RopeSpec(
        rotary_dim=rd, key_dim=head_dim, layout=RotaryLayout.LEADING, pairing=Pairing.from_neox_style(neox),
        inv_freq=tuple(float(x) for x in inv.tolist()),
    )


def pool_layout(kv_pool) -> KVLayout:
    """The sidecar payload layout of an SGLang MHA token pool (``k_buffer[l]: [slots, H, D]``)."""
    k = kv_pool.k_buffer[0]
    return KVLayout.gqa(num_layers=len(kv_pool.k_buffer), num_kv_heads=k.shape[1], head_dim=k.shape[2],
                        dtype=_TORCH_TO_LAYOUT[k.dtype])


def _with_hits(base: MatchResult, host_hit_length: int, plan: Optional[LookupPlan]) -> MatchResult:
    res = _SidecarMatch(*base._replace(host_hit_length=host_hit_length))
    res.sidecar_plan = plan
    res.sidecar_hits = plan.hits() if plan is not None else []
    return res


class _SidecarMatch(MatchResult):
    """A ``MatchResult`` that also carries the sidecar's plan: ``sidecar_plan`` (LookupPlan)
    and ``sidecar_hits`` (its CHUNK_HIT segments, token ranges of the prompt)."""

    sidecar_plan: Optional[LookupPlan]
    sidecar_hits: list


SidecarMatchResult = _SidecarMatch


@dataclass
class LoadedHits:
    """What ``load_hits`` placed: ``positions[i]`` of the prompt now lives in pool slot
    ``slots[i]``; ``missed`` are hit ranges the sidecar could no longer serve (prefill them)."""

    positions: torch.Tensor
    slots: torch.Tensor
    missed: list = field(default_factory=list)


@dataclass
class SpliceWork:
    """``apply_splice_plan``'s result: the row's new slots (position order) and the compute
    ops the engine runs next (``(kind, positions, tokens, pool slots)``, in plan order)."""

    slots: torch.Tensor
    compute: list
    session_to_pool: dict


class SidecarRadixCache(RadixCache):
    def __init__(
        self,
        params,
        *,
        client: Optional[SyncSidecarClient],
        identity: CacheIdentity,
        rope: Optional[RopeSpec],
        layout: Optional[KVLayout] = None,
        policy: Optional[str] = None,
        recompute_tokens: Optional[int] = None,
        left_context_window: Optional[int] = None,
    ) -> None:
        super().__init__(params)
        self.client = client
        self.kv_pool = params.token_to_kv_pool_allocator.get_kvcache() if params.token_to_kv_pool_allocator else None
        self.layout = layout or (pool_layout(self.kv_pool) if self.kv_pool is not None else None)
        if self.layout is not None and identity.kv_layout != self.layout.fingerprint():
            identity = CacheIdentity(**{**_ident_fields(identity), "kv_layout": self.layout.fingerprint(),
                                        "rope_fingerprint": rope.fingerprint if rope else identity.rope_fingerprint})
        self.identity = identity
        self.rope = rope
        self.lookup_kwargs = {"policy": policy, "recompute_tokens": recompute_tokens,
                              "left_context_window": left_context_window}
        self._markers: dict[Any, tuple] = {}  # request handle -> (tokens, hits, device_len, extra_key, salt)

    # ------------------------------------------------------------------ match / load

    def _lookup(self, tokens: np.ndarray, device_len: int) -> Optional[LookupPlan]:
        if self.client is None:
            return None
        try:
            return self.client.lookup(tokens, identity=self.identity, engine_prefix_len=device_len, **self.lookup_kwargs)
        except Exception as exc:  # noqa: BLE001 - the sidecar is an optimisation: never fail a request
            logger.warning("kv-sidecar lookup failed (%s: %s); serving the radix match only", type(exc).__name__, exc)
            return None

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        base = super().match_prefix(params)
        key = params.key
        if self.disable or key is None or len(key) == 0 or key.is_bigram:
            return base
        tokens = np.asarray(key.raw_token_ids(), dtype=np.int64).astype(np.uint32)
        device_len = base.device_prefix_len
        plan = self._lookup(tokens, device_len) if device_len < len(tokens) else None
        if plan is None:
            return _with_hits(base, base.host_hit_length, None)
        # the hits contiguous with the device prefix (token-granular: no block cut; not capped
        # at n - 1: the caller's key is what may be matched)
        run = load_run(plan, local=device_len, n=len(tokens), bridge_recompute=False, compute_last=False).tokens
        req = params.req
        if req is not None and run:
            handle = getattr(req, "cache_request_handle", None) or id(req)
            hits = [s for s in plan.hits() if s.end <= device_len + run]
            self._markers[handle] = (tokens.copy(), hits, device_len, key.extra_key, key.cache_salt)
        return _with_hits(base, run, plan)

    def load_hits(self, hits: list[Segment], *, req_pool_idx: Optional[int] = None) -> LoadedHits:
        """Place the KV of ``hits`` (CHUNK_HIT segments of a plan) in fresh pool slots, rotary keys
        rotated to the segments' positions; write the slots into ``req_to_token[req_pool_idx]``."""
        empty = torch.empty(0, dtype=torch.int64)
        if not hits or self.client is None or self.kv_pool is None:
            return LoadedHits(empty, empty, list(hits))
        try:
            items = [load_item(s) for s in hits]
            got = self.client.fetch([it.fetch_item for it in items], identity=self.identity, layout=self.layout,
                                    rope=self.rope)
        except Exception as exc:  # noqa: BLE001
            logger.warning("kv-sidecar fetch failed (%s: %s); prefilling instead", type(exc).__name__, exc)
            return LoadedHits(empty, empty, list(hits))
        positions, slots, missed = [], [], []
        k_bufs, v_bufs = self.kv_pool.k_buffer, self.kv_pool.v_buffer
        for seg, it, kv in zip(hits, items, got):
            n = len(it)
            if not kv.ok or kv.num_tokens < it.row + n:
                missed.append(seg)
                continue
            if self.token_to_kv_pool_allocator.available_size() < n:
                self.evict_tokens(n)
            s = self.token_to_kv_pool_allocator.alloc(n)
            if s is None:
                missed.append(seg)
                continue
            data = stacked_view(kv.data, self.layout, kv.num_tokens)  # [L, 2, n, H, D]
            rows = slice(it.row, it.row + n)
            dev = s.to(k_bufs[0].device)
            for layer in range(len(k_bufs)):
                k_bufs[layer][dev] = data[layer, 0, rows].to(k_bufs[layer].device)
                v_bufs[layer][dev] = data[layer, 1, rows].to(v_bufs[layer].device)
            positions.append(torch.arange(it.start, it.end, dtype=torch.int64))
            slots.append(s.to(torch.int64).cpu())
        pos = torch.cat(positions) if positions else empty
        sl = torch.cat(slots) if slots else empty
        if req_pool_idx is not None and len(pos):
            self.req_to_token_pool.req_to_token[req_pool_idx, pos.to(self.req_to_token_pool.req_to_token.device)] = sl.to(
                self.req_to_token_pool.req_to_token.device, self.req_to_token_pool.req_to_token.dtype)
        return LoadedHits(pos, sl, missed)

    def evict_tokens(self, n: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.evict(EvictParams(num_tokens=n))

    def init_load_back(self, params: InitLoadBackParams):
        """SGLang's load-back step for the run reported in ``host_hit_length``: the loaded slots
        become a tree node under ``best_match_node`` (so they are a device prefix from now on)."""
        req = params.req
        handle = getattr(req, "cache_request_handle", None) or id(req)
        marker = self._markers.pop(handle, None)
        last: TreeNode = params.best_match_node
        if marker is None:
            return 0, last
        tokens, hits, device_len, extra_key, cache_salt = marker
        loaded = self.load_hits(hits)
        n = 0
        for seg in hits:  # the contiguous part that really arrived
            if seg in loaded.missed:
                break
            n += len(seg)
        if n < len(loaded.slots):
            self.token_to_kv_pool_allocator.free(loaded.slots[n:])
        if n == 0:
            return 0, last
        node = TreeNode(priority=last.priority)
        node.key = RadixKey(_array(tokens[device_len:device_len + n]), extra_key, cache_salt=cache_salt)
        node.value = loaded.slots[:n].clone()
        node.parent = last
        last.children[node.key.child_key(self.page_size)] = node
        self.evictable_size_ += n
        self._update_leaf_status(last)
        self._update_leaf_status(node)
        return n, node

    def on_release(self, req, *, checkpointed: bool) -> None:
        self._markers.pop(getattr(req, "cache_request_handle", None) or id(req), None)

    # ------------------------------------------------------------------ store

    def store_prompt(self, tokens, slots: torch.Tensor) -> int:
        """Store the KV of a computed prompt (``slots[i]`` holds position ``i``) at the sidecar's
        chunk boundaries. Returns the chunks stored (0 on any failure)."""
        if self.client is None or self.kv_pool is None:
            return 0
        toks = np.asarray(tokens, dtype=np.int64).astype(np.uint32)
        try:
            bounds = self.client.lookup(toks, identity=self.identity, dry_run=True).chunk_bounds.tolist()
            k_bufs, v_bufs = self.kv_pool.k_buffer, self.kv_pool.v_buffer
            payloads = {}
            for a, b in zip(bounds[:-1], bounds[1:]):
                idx = slots[a:b].to(k_bufs[0].device)
                parts = []
                for layer in range(len(k_bufs)):
                    parts += [k_bufs[layer][idx].cpu(), v_bufs[layer][idx].cpu()]
                payloads[int(a)] = stacked_payload(torch.stack(parts))  # [2 * L, n, H, D]
            res = self.client.store(toks, identity=self.identity, layout=self.layout, payloads=payloads)
            return res.chunks_stored + res.chunks_refreshed
        except Exception as exc:  # noqa: BLE001
            logger.warning("kv-sidecar store failed (%s: %s)", type(exc).__name__, exc)
            return 0

    # ------------------------------------------------------------------ Splice

    def apply_splice_plan(self, plan: OpPlan, row_slots: torch.Tensor, session_to_pool: dict,
                          *, req_pool_idx: Optional[int] = None) -> SpliceWork:
        """Apply a ``block_size=1`` Splice plan to a request's row.

        ``session_to_pool`` binds the session's slot ids (= block ids at B = 1) to pool slots
        (for a session opened on the row's tokens: ``{i: row_slots[i]}``); ALLOCATE extends it.
        Returns the row's new slots in position order and the PREFILL/REFRESH work; the caller
        runs the forward pass for it, then ``commit_splice`` (or ``abort_splice``)."""
        if plan.block_size != 1:
            raise ValueError(f"plan.block_size: {plan.block_size}; token pools apply block_size 1 plans")
        m = dict(session_to_pool)
        compute = []
        k_bufs, v_bufs = self.kv_pool.k_buffer, self.kv_pool.v_buffer
        for op in plan.ops:
            if op.kind is OpKind.ALLOCATE:
                fresh = self.token_to_kv_pool_allocator.alloc(len(op.blocks))
                if fresh is None:
                    raise RuntimeError("token pool exhausted while applying a Splice plan (abort it)")
                for b, s in zip(op.blocks.tolist(), fresh.tolist()):
                    m[int(b)] = int(s)
            elif op.kind is OpKind.MOVE:
                src = torch.tensor([m[int(s)] for s in op.src_slots.tolist()], dtype=torch.int64)
                dst = torch.tensor([m[int(s)] for s in op.slots.tolist()], dtype=torch.int64)
                copy = src != dst
                if bool(copy.any()):  # one gather: read all sources before writing
                    for layer in range(len(k_bufs)):
                        k_bufs[layer][dst[copy]] = k_bufs[layer][src[copy]].clone()
                        v_bufs[layer][dst[copy]] = v_bufs[layer][src[copy]].clone()
            elif op.kind is OpKind.FREE:
                freed = torch.tensor([m.pop(int(b)) for b in op.blocks.tolist()], dtype=torch.int64)
                if len(freed):
                    self.token_to_kv_pool_allocator.free(freed)
            elif op.kind is OpKind.ROTATE:
                if op.delta and self.rope is not None:
                    ids = torch.tensor([m[int(s)] for s in op.slots.tolist()], dtype=torch.int64)
                    for layer in range(len(k_bufs)):
                        rotate_slots_(k_bufs[layer], ids.to(k_bufs[layer].device), int(op.delta), self.rope)
            elif op.kind in (OpKind.PREFILL, OpKind.REFRESH):
                compute.append((op.kind.name, op.positions.copy(), op.tokens.copy(),
                                torch.tensor([m[int(s)] for s in op.slots.tolist()], dtype=torch.int64)))
        new_slots = torch.tensor([m[int(s)] for s in plan.layout.slots.tolist()], dtype=torch.int64)
        if req_pool_idx is not None:
            r2t = self.req_to_token_pool.req_to_token
            r2t[req_pool_idx, : len(new_slots)] = new_slots.to(r2t.device, r2t.dtype)
        return SpliceWork(new_slots, compute, m)


def _array(tokens: np.ndarray):
    from array import array

    return array("q", np.asarray(tokens, dtype=np.int64).tolist())


def _ident_fields(ident: CacheIdentity) -> dict:
    return {f: getattr(ident, f) for f in ("model_id", "weights_hash", "tokenizer_hash", "kv_layout",
                                            "rope_fingerprint", "block_size", "namespace")}


# ---------------------------------------------------------------------- SGLang registration


def settings() -> dict:
    raw = os.environ.get("KV_SIDECAR_SGLANG")
    cfg = json.loads(raw) if raw else {}
    cfg.setdefault("target", os.environ.get("KV_SIDECAR_TARGET", "127.0.0.1:50051"))
    return cfg


def sidecar_radix_factory(ctx) -> SidecarRadixCache:
    """``RadixCacheFactory``: builds the cache from SGLang's ``TreeCacheBuildContext``."""
    cfg = settings()
    params = ctx.params
    model_id = cfg.get("model_id") or getattr(getattr(ctx, "model_config", None), "model_path", None) or "sglang-model"
    kv_pool = params.token_to_kv_pool_allocator.get_kvcache()
    head_dim = kv_pool.k_buffer[0].shape[-1]
    rope = None
    hf = getattr(getattr(ctx, "model_config", None), "hf_config", None)
    if "rope" in cfg:
        r = cfg["rope"]
        rope = rope_spec(head_dim=head_dim, theta=float(r.get("theta", 10000.0)), rotary_dim=r.get("rotary_dim"),
                         neox=bool(r.get("neox", True)))
    elif hf is not None:
        rope = RopeSpec.from_hf_config(hf, pairing=Pairing.HALF)
    client = SyncSidecarClient(cfg["target"], tenant=cfg.get("tenant"), token=cfg.get("token"),
                               timeout_s=float(cfg.get("timeout_s", 5.0)))
    ident = CacheIdentity(model_id=str(model_id), namespace=str(cfg.get("namespace", "")),
                          tokenizer_hash=str(cfg.get("tokenizer_hash", "")))
    return SidecarRadixCache(
        params, client=client, identity=ident, rope=rope, policy=cfg.get("policy"),
        recompute_tokens=cfg.get("recompute_tokens"), left_context_window=cfg.get("left_context_window"),
    )


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register ``kv_sidecar`` (idempotent)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, sidecar_radix_factory)


__all__ = ["BACKEND_NAME", "LoadedHits", "SidecarMatchResult", "SidecarRadixCache", "SpliceWork", "pool_layout",
           "register", "rope_spec", "settings", "sidecar_radix_factory"]
