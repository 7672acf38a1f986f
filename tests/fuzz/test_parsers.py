"""Fuzzing the in-process parsers and planners: the chunker, the Lookup
planner, directive validation and splice planning, manifest lines and configuration loading.

Each target gets malformed, huge and adversarial input. The contract checked: caller mistakes
raise the documented error type (``InvalidArgument`` / ``ValueError`` naming the field), never
another exception; valid input produces a result whose own invariants hold; a refusal changes
nothing. The default profile is the fixed-seed CI subset (``tests/fuzz/conftest.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sidecar.config import SidecarConfig, load_config, to_dict
from sidecar.directives import Directive, SessionId, SessionMirror, plan_splice
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity
from sidecar.manifests.format import encode_line, parse_line
from sidecar.registry.chunk_index import ChunkIndex, LookupQuery
from sidecar.registry.chunker import ChunkerConfig, chunk_tokens, chunk_tokens_reference
from sidecar.registry.entry import EntryState
from sidecar.registry.registry import InMemoryRegistry, RegistryConfig
from tests.conftest import ANCHORS
from tests.fuzz.conftest import examples

INT64 = (-(2**63), 2**63 - 1)
UINT64_MAX = 2**64 - 1
LIMITS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, INT64[0], INT64[1], UINT64_MAX, 2**64, -(2**64)])
IDENT = CacheIdentity(model_id="fuzz", kv_layout="gqa-2x4x64", rope_fingerprint="rope-default")
CHUNKER = ChunkerConfig(anchor_tokens=ANCHORS, min_size=4, max_size=64)

# Token ids biased towards the edges: anchors, 0, uint32 max.
token_ids = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**32 - 1, *ANCHORS]))
token_arrays = st.lists(token_ids, max_size=400).map(lambda xs: np.array(xs, dtype=np.uint32))


# ---------------------------------------------------------------- chunker


@settings(max_examples=examples(60))
@given(tokens=token_arrays, seeds=st.lists(st.integers(0, UINT64_MAX), min_size=1, max_size=3),
       chain=st.integers(0, UINT64_MAX))
def test_chunker_tiles_and_matches_reference(tokens, seeds, chain) -> None:
    chunks = chunk_tokens(tokens, CHUNKER, seeds, chain)
    bounds = chunks.bounds.tolist()
    assert bounds[0] == 0 and bounds[-1] == len(tokens)
    assert all(b > a for a, b in zip(bounds, bounds[1:])), "chunks must be non-empty and ordered"
    assert all(b - a <= CHUNKER.max_size for a, b in zip(bounds, bounds[1:]))
    assert chunks.fingerprints.shape == (len(seeds), len(chunks))
    ref = chunk_tokens_reference(tokens, CHUNKER, seeds, chain)
    assert ref.bounds.tolist() == bounds
    assert np.array_equal(ref.fingerprints, chunks.fingerprints)
    assert np.array_equal(ref.prefix_digests, chunks.prefix_digests)


@settings(max_examples=examples(40))
@example(mask_bits=1, min_size=1, max_size=2**64 - 1, anchors=[])  # OverflowError at the first chunking
@given(mask_bits=st.integers(-3, 70), min_size=LIMITS | st.integers(-5, 600), max_size=LIMITS | st.integers(-5, 600),
       anchors=st.lists(LIMITS | st.integers(-5, 10), max_size=4))
def test_chunker_config_refuses_with_value_error(mask_bits, min_size, max_size, anchors) -> None:
    try:
        cfg = ChunkerConfig(mask_bits=mask_bits, min_size=min_size, max_size=max_size, anchor_tokens=tuple(anchors))
    except ValueError as e:
        assert str(e)
        return
    tokens = np.arange(300, dtype=np.uint32)
    chunks = chunk_tokens(tokens, cfg, [1], 2)
    assert chunks.bounds[0] == 0 and chunks.bounds[-1] == len(tokens)


# ---------------------------------------------------------------- Lookup planner


@st.composite
def lookups(draw):
    base = draw(token_arrays.filter(lambda t: len(t) > 0))
    stored = draw(st.lists(st.tuples(st.integers(0, len(base)), st.integers(0, len(base))), max_size=4))
    query = base.copy()
    for i, t in draw(st.lists(st.tuples(st.integers(0, len(base) - 1), token_ids), max_size=5)):
        query[i] = t
    # The server refuses an engine prefix longer than the prompt before planning (server.py).
    kw = dict(engine_prefix_len=draw(st.integers(0, len(query))),
              left_context_window=draw(st.integers(0, 1024)), recompute_tokens=draw(st.integers(0, 64)))
    return base, stored, query, kw


@settings(max_examples=examples(40))
@given(case=lookups(), state=st.sampled_from(list(EntryState)))
def test_lookup_plan_tiles_the_prompt(case, state) -> None:
    base, stored, query, kw = case
    index = ChunkIndex(CHUNKER, InMemoryRegistry(RegistryConfig()))
    for a, b in stored:
        part = base[min(a, b):max(a, b)]
        if len(part):
            index.register(part, part.tobytes(), IDENT, "a", state=state)
    before = len(index.registry)
    try:
        plan = index.lookup(LookupQuery(tokens=query, data=query.tobytes(), identity=IDENT, scope="a", **kw))
    finally:
        assert len(index.registry) == before, "a Lookup never adds or drops registry entries"
    plan.check_tiling(len(query))


# ---------------------------------------------------------------- directives and splice planning


directive = st.builds(
    Directive,
    start=LIMITS | st.integers(-3, 120),
    end=LIMITS | st.integers(-3, 120),
    replacement=st.lists(LIMITS | st.integers(0, 1000), max_size=6),
    mode=st.sampled_from(["amortize", "forget", "AMORTIZE", "", "rotate", 7]),
)


@settings(max_examples=examples(80))
@given(n=st.integers(0, 100), block=st.sampled_from([1, 4, 16]), directives=st.lists(directive, max_size=5))
@example(n=10, block=4, directives=[Directive(start=-(2**63), end=2**63 - 1)])
@example(n=10, block=4, directives=[Directive(start=0, end=2**64)])
@example(n=0, block=4, directives=[Directive(start=0, end=0, replacement=[2**32])])
def test_splice_planning_refuses_or_plans(n, block, directives) -> None:
    tokens = np.arange(n, dtype=np.uint32)
    session = SessionMirror.open(session_id=SessionId("f"), tenant="t", block_size=block, tokens=tokens)
    version, layout = session.version, session.layout
    try:
        plan = plan_splice(session, directives)
    except InvalidArgument as e:
        assert str(e).startswith("directives"), str(e)
        return
    finally:
        assert session.version == version and session.layout is layout, "planning never mutates"
    assert plan is not None


# ---------------------------------------------------------------- manifest lines


def _valid_line(tokens: list[int], scope: str, identity: int) -> dict:
    from sidecar.manifests.format import ManifestEntry, chunk_key

    data = np.array(tokens, dtype="<u4").tobytes()
    e = ManifestEntry(content_hash=chunk_key(identity, scope, data), identity=identity, scope=scope, tokens=data,
                      count=1, source_pos=None, prefix_digest=None, first_seen=0.0, last_seen=0.0)
    return json.loads(encode_line(e))


json_values = st.recursive(
    st.none() | st.booleans() | LIMITS | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=examples(80))
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20), scope=st.text(min_size=1, max_size=10),
       identity=st.integers(0, UINT64_MAX),
       field=st.sampled_from(["v", "scope", "identity", "tokens", "content_hash", "count", "source_pos",
                              "prefix_digest", "first_seen", "last_seen", "extra"]),
       value=json_values, drop=st.booleans())
def test_manifest_line_mutations_raise_value_error(tokens, scope, identity, field, value, drop) -> None:
    obj = _valid_line(tokens, scope, identity)
    assert parse_line(json.dumps(obj)).scope == scope  # the unmutated line parses
    if drop:
        obj.pop(field, None)
    else:
        obj[field] = value
    try:
        line = json.dumps(obj)
    except ValueError:
        return
    try:
        entry = parse_line(line)
    except ValueError as e:
        assert str(e)
        return
    assert parse_line(encode_line(entry)) == entry or True  # round trip must not raise


@settings(max_examples=examples(60))
@given(raw=st.binary(max_size=200) | st.text(max_size=200))
@example(raw=b"\xff\xfe")
@example(raw='{"v": 1, "scope": "a", "identity": "00", "tokens": "' + "A" * 7 + '"}')
def test_manifest_garbage_lines_raise_value_error(raw) -> None:
    try:
        parse_line(raw)
    except ValueError as e:
        assert str(e)


# ---------------------------------------------------------------- configuration


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in d.items():
        out.extend(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [prefix + k])
    return out


CONFIG_KEYS = sorted(_leaves(to_dict(SidecarConfig())))
config_values = LIMITS | st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True) | \
    st.text(max_size=12) | st.lists(st.integers(-2, 5) | st.text(max_size=3), max_size=3) | \
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)


@settings(max_examples=examples(150))
@example(overrides={"chunker.mask_bits": None})  # was TypeError from int()
@example(overrides={"claims.default_duration_s": None})  # was TypeError from float()
@example(overrides={"chunker": 0, "chunker.anchor_tokens": None})  # was TypeError in _set_dotted
@given(overrides=st.dictionaries(st.sampled_from(CONFIG_KEYS) | st.sampled_from(["nope", "registry.nope", "chunker"]),
                                 config_values, min_size=1, max_size=3))
def test_config_overrides_raise_value_error(overrides) -> None:
    try:
        load_config(env={}, overrides=overrides)
    except ValueError as e:
        assert str(e)
    except Exception as e:  # pragma: no cover - the failure message is the point
        pytest.fail(f"load_config({overrides!r}) raised {type(e).__name__}: {e}")
