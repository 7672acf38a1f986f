"""Wire <-> domain conversion for the Splice RPCs (sessions, directives, op plans).

Shared by the server and the client, like ``sidecar.api.kv``. Packed arrays keep the domain's
dtypes (tokens LE uint32; slots, positions, blocks, cumulative deltas LE int64; rotation counts
LE int32), so encoding is one ``tobytes`` and decoding one ``np.frombuffer`` per array: no
per-element Python on either side. Decoded arrays are read-only views of the received bytes,
as the domain's are.

Caller mistakes raise ``InvalidArgument`` naming the field (``directives[1].replacement: ...``);
server answers that do not decode raise ``ValueError``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sidecar.api.kv import identity_to_wire, layout_to_wire, rope_to_wire, tokens_to_wire
from sidecar.directives import Directive, Edit, EditMode, Layout, Op, OpKind, OpPlan, PlanId, PlanSummary, SessionId
from sidecar.directives import SessionInfo as DomainSessionInfo
from sidecar.directives.layout import arange
from sidecar.errors import InvalidArgument
from sidecar.identity import CacheIdentity, KVLayout
from sidecar.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    from sidecar.rotation import RopeSpec

_U32 = np.dtype("<u4")
_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
MODE_FROM_WIRE = {
    pb.SPLICE_MODE_UNSPECIFIED: EditMode.AMORTIZE,
    pb.SPLICE_MODE_AMORTIZE: EditMode.AMORTIZE,
    pb.SPLICE_MODE_FORGET: EditMode.FORGET,
}
MODE_TO_WIRE = {EditMode.AMORTIZE: pb.SPLICE_MODE_AMORTIZE, EditMode.FORGET: pb.SPLICE_MODE_FORGET}
_KINDS = {int(k): k for k in OpKind}
#: Fields of one ``OpPlan.edits`` record: index, start, end, replacement length, mode.
EDIT_FIELDS = 5
_SUMMARY_FIELDS = tuple(f.name for f in dataclasses.fields(PlanSummary))


def _packed(arr: np.ndarray, dtype: np.dtype) -> bytes:
    return arr.astype(dtype, copy=False).tobytes()


def _unpack(data: bytes, dtype: np.dtype, field: str) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise ValueError(f"{field}: {len(data)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(data, dtype=dtype)


def _ids(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(f"{field}: required")
    return value


def session_id_from_wire(value: str, field: str = "session_id") -> SessionId:
    return SessionId(_ids(value, field))


def plan_id_from_wire(value: str, field: str = "plan_id") -> PlanId:
    return PlanId(_ids(value, field))


# ------------------------------------------------------------------------------- sessions


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class SessionState:
    """A session as the client sees it (``SessionInfo`` on the wire).

    ``block_table`` (int64, read-only): one block id per ``block_size`` positions; the block
    ids are the session's own, bound by the engine to its pool blocks. ``pending_plan_id`` is
    only filled by ``get_session``.
    """

    session_id: SessionId
    version: int
    length: int
    block_size: int
    live_blocks: int
    block_table: np.ndarray
    pending_plan_id: PlanId | None = None

    def __len__(self) -> int:
        return self.length

    @property
    def slots(self) -> np.ndarray:
        """int64 slot of each token: ``block_table[q // B] * B + q % B``."""
        b = self.block_size
        if b == 1:
            return self.block_table
        return (self.block_table[:, None] * b + np.arange(b)).reshape(-1)[: self.length]


def session_to_wire(info: DomainSessionInfo, pending: PlanId | None = None) -> pb.SessionInfo:
    return pb.SessionInfo(
        session_id=info.session_id,
        version=info.version,
        length=len(info.layout),
        block_size=info.block_size,
        live_blocks=info.live_blocks,
        block_table=_packed(info.layout.block_table, _I64),
        pending_plan_id=pending or "",
    )


def session_from_wire(msg: pb.SessionInfo) -> SessionState:
    return SessionState(
        session_id=SessionId(msg.session_id),
        version=msg.version,
        length=msg.length,
        block_size=msg.block_size,
        live_blocks=msg.live_blocks,
        block_table=_unpack(msg.block_table, _I64, "SessionInfo.block_table"),
        pending_plan_id=PlanId(msg.pending_plan_id) if msg.pending_plan_id else None,
    )


def session_tokens_from_wire(data: bytes, field: str = "tokens") -> np.ndarray:
    """Zero-copy uint32 view of packed token bytes; empty is allowed (a session may start empty,
    a deletion has no replacement). Vocabulary and length limits are the session table's."""
    if len(data) % 4:
        raise InvalidArgument(f"{field}: length {len(data)} bytes is not a multiple of 4 (packed little-endian uint32)")
    return np.frombuffer(data, dtype=_U32)


# ----------------------------------------------------------------------------- directives


def directives_from_wire(
    msgs: Sequence[pb.Directive], *, max_directives: int, force_forget: bool = False
) -> list[Directive]:
    """Domain directives of a SpliceRequest (replacements are views of the request bytes).

    Checks what only the wire can get wrong (packing, the mode enum, the count, before decoding
    anything); spans and token ids are checked by the planner, all or nothing. With
    ``force_forget`` every directive is planned as FORGET (a tenant setting).
    """
    if len(msgs) > max_directives:
        raise InvalidArgument(f"directives: {len(msgs)} directives exceed the limit of {max_directives} per splice")
    out: list[Directive] = []
    for i, d in enumerate(msgs):
        mode = MODE_FROM_WIRE.get(d.mode)
        if mode is None:
            raise InvalidArgument(f"directives[{i}].mode: unknown SpliceMode value {d.mode}")
        replacement = session_tokens_from_wire(d.replacement, f"directives[{i}].replacement")
        out.append(Directive(start=d.start, end=d.end, replacement=replacement,
                             mode=EditMode.FORGET if force_forget else mode))
    return out


def request_mode(msgs: Sequence[pb.Directive], force_forget: bool = False) -> EditMode:
    """The metrics label of a request before validation: FORGET if any directive forgets."""
    if force_forget or any(d.mode == pb.SPLICE_MODE_FORGET for d in msgs):
        return EditMode.FORGET
    return EditMode.AMORTIZE


def directives_to_wire(directives: Sequence[Directive | tuple]) -> list[pb.Directive]:
    """Client side: ``Directive`` objects or ``(start, end, replacement[, mode])`` tuples, with
    ``mode`` a ``EditMode`` or ``"amortize"`` / ``"forget"`` (default amortize)."""
    out: list[pb.Directive] = []
    for i, d in enumerate(directives):
        where = f"directives[{i}]"
        if isinstance(d, Directive):
            start, end, replacement, mode = d.start, d.end, d.replacement, d.mode
        elif isinstance(d, tuple) and len(d) in (3, 4):
            start, end, replacement = d[:3]
            mode = d[3] if len(d) == 4 else EditMode.AMORTIZE
        else:
            raise InvalidArgument(f"{where}: expected a Directive or a (start, end, replacement[, mode]) tuple")
        values = []
        for name, v in (("start", start), ("end", end)):
            try:
                v = operator.index(v)
            except TypeError:
                raise InvalidArgument(f"{where}.{name}: must be an integer, got {type(v).__name__}") from None
            if not 0 <= v < 1 << 32:
                raise InvalidArgument(f"{where}.{name}: {v} is not a position (0 <= {name} < 2**32)")
            values.append(v)
        try:
            wire_mode = MODE_TO_WIRE[EditMode(mode)]
        except ValueError:
            raise InvalidArgument(f"{where}.mode: {mode!r} is not one of 'amortize', 'forget'") from None
        try:
            data = tokens_to_wire(replacement)
        except ValueError as exc:
            raise InvalidArgument(f"{where}.replacement: {str(exc).removeprefix('tokens: ')}") from None
        out.append(pb.Directive(start=values[0], end=values[1], replacement=data, mode=wire_mode))
    return out


# ---------------------------------------------------------------------------------- plans


def _op_fields(op: Op) -> dict:
    """An op's wire fields (empty arrays stay unset). Passed straight to ``ops.add(**fields)``:
    the packed bytes are copied once, into the message, not again through a submessage."""
    fields: dict = {"kind": int(op.kind), "delta": op.delta}
    for name, arr, dtype in (("slots", op.slots, _I64), ("positions", op.positions, _I64),
                             ("src_slots", op.src_slots, _I64), ("tokens", op.tokens, _U32),
                             ("blocks", op.blocks, _I64), ("cum_deltas", op.cum_deltas, _I64)):
        if len(arr):
            fields[name] = _packed(arr, dtype)
    return fields


def op_plan_to_wire(plan: OpPlan, ttl_s: float) -> pb.OpPlan:
    lay = plan.layout
    edits = np.array(
        [(e.index, e.start, e.end, len(e.replacement), MODE_TO_WIRE[e.mode]) for e in plan.edits], dtype=_I64
    ).reshape(-1, EDIT_FIELDS)
    s = plan.summary
    msg = pb.OpPlan(
        plan_id=plan.plan_id,
        session_id=plan.session_id,
        base_version=plan.base_version,
        next_version=plan.next_version,
        block_size=plan.block_size,
        edits=edits.tobytes(),
        ttl_s=ttl_s,
    )
    for op in plan.ops:
        msg.ops.add(**_op_fields(op))
    # Fields set in place: a submessage built apart would be copied again into the plan.
    msg.layout.tokens = _packed(lay.tokens, _U32)
    msg.layout.slots = _packed(lay.slots, _I64)
    msg.layout.rotations = _packed(lay.rotations, _I32)
    msg.layout.cum_deltas = _packed(lay.cum_deltas, _I64)
    for f in _SUMMARY_FIELDS:
        setattr(msg.summary, f, getattr(s, f))
    return msg


def _op_from_wire(msg: pb.Op, i: int) -> Op:
    kind = _KINDS.get(msg.kind)
    if kind is None:
        raise ValueError(f"OpPlan.ops[{i}].kind: unknown OpKind value {msg.kind}")
    where = f"OpPlan.ops[{i}]"
    return Op(
        kind=kind,
        slots=_unpack(msg.slots, _I64, f"{where}.slots"),
        positions=_unpack(msg.positions, _I64, f"{where}.positions"),
        src_slots=_unpack(msg.src_slots, _I64, f"{where}.src_slots"),
        tokens=_unpack(msg.tokens, _U32, f"{where}.tokens"),
        blocks=_unpack(msg.blocks, _I64, f"{where}.blocks"),
        delta=msg.delta,
        cum_deltas=_unpack(msg.cum_deltas, _I64, f"{where}.cum_deltas"),
    )


def op_plan_from_wire(msg: pb.OpPlan) -> OpPlan:
    """The client's ``sidecar.directives.OpPlan``: the same ops, layout (positions ``0..n-1``),
    edits (replacements are views of the layout's tokens) and summary as the server's plan."""
    ml = msg.layout
    tokens = _unpack(ml.tokens, _U32, "OpPlan.layout.tokens")
    n = len(tokens)
    layout = Layout(
        block_size=msg.block_size,
        tokens=tokens,
        slots=_unpack(ml.slots, _I64, "OpPlan.layout.slots"),
        positions=arange(n),
        rotations=_unpack(ml.rotations, _I32, "OpPlan.layout.rotations"),
        cum_deltas=_unpack(ml.cum_deltas, _I64, "OpPlan.layout.cum_deltas"),
    )
    if not len(layout.slots) == len(layout.rotations) == len(layout.cum_deltas) == n:
        raise ValueError("OpPlan.layout: arrays are not parallel")
    records = _unpack(msg.edits, _I64, "OpPlan.edits")
    if len(records) % EDIT_FIELDS:
        raise ValueError("OpPlan.edits: not whole records")
    edits: list[Edit] = []
    shift = 0
    for index, start, end, r_len, mode in records.reshape(-1, EDIT_FIELDS).tolist():
        q = start + shift  # the replacement's position in the edited sequence
        edits.append(Edit(index=index, start=start, end=end, replacement=tokens[q : q + r_len],
                          mode=MODE_FROM_WIRE[mode]))
        shift += r_len - (end - start)
    s = msg.summary
    return OpPlan(
        plan_id=PlanId(msg.plan_id),
        session_id=SessionId(msg.session_id),
        base_version=msg.base_version,
        next_version=msg.next_version,
        block_size=msg.block_size,
        ops=tuple(_op_from_wire(op, i) for i, op in enumerate(msg.ops)),
        layout=layout,
        edits=tuple(edits),
        summary=PlanSummary(**{f: getattr(s, f) for f in _SUMMARY_FIELDS}),
    )


# ===================================================================================
# Client-side request builders (the SDK's; sidecar.sdk.rpcs names them in its RPC table).
# ===================================================================================


def open_session_request(
    tokens: np.ndarray | Sequence[int] | bytes = (),
    *,
    block_size: int,
    identity: CacheIdentity | None = None,
    held: bool = False,
) -> pb.OpenSessionRequest:
    """An ``OpenSessionRequest`` (``identity`` required with ``held``; the server checks)."""
    req = pb.OpenSessionRequest(tokens=tokens_to_wire(tokens), block_size=block_size, held=held)
    if identity is not None:
        req.identity.CopyFrom(identity_to_wire(identity))
    return req


def append_session_request(session_id: str, tokens: np.ndarray | Sequence[int] | bytes) -> pb.AppendSessionRequest:
    return pb.AppendSessionRequest(session_id=session_id, tokens=tokens_to_wire(tokens))


def get_session_request(session_id: str) -> pb.GetSessionRequest:
    return pb.GetSessionRequest(session_id=session_id)


def close_session_request(session_id: str) -> pb.CloseSessionRequest:
    return pb.CloseSessionRequest(session_id=session_id)


def splice_request(session_id: str, expected_version: int, directives: Sequence[Directive | tuple]) -> pb.SpliceRequest:
    """A ``SpliceRequest``: ``directives`` as ``Directive`` or ``(start, end, replacement[, mode])``."""
    return pb.SpliceRequest(
        session_id=session_id, expected_version=expected_version, directives=directives_to_wire(directives)
    )


def commit_splice_request(plan_id: str) -> pb.CommitSpliceRequest:
    return pb.CommitSpliceRequest(plan_id=plan_id)


def abort_splice_request(plan_id: str) -> pb.AbortSpliceRequest:
    return pb.AbortSpliceRequest(plan_id=plan_id)


def fetch_session_request(
    session_id: str, start: int, end: int | None, layout: KVLayout, rope: RopeSpec | None, raw: bool = False
) -> pb.FetchSessionRequest:
    """A ``FetchSessionRequest`` for positions ``[start, end)`` (``end`` None: to the session's
    end); no shared-memory buffer named (the SDK names one per attempt)."""
    req = pb.FetchSessionRequest(session_id=session_id, start=start, end=end, layout=layout_to_wire(layout), raw=raw)
    if rope is not None:
        req.rope.CopyFrom(rope_to_wire(rope))
    return req


# The messages of this area's RPCs, for the server's handlers (which import no stubs).
AbortSpliceRequest = pb.AbortSpliceRequest
AppendSessionRequest = pb.AppendSessionRequest
CloseSessionRequest = pb.CloseSessionRequest
CloseSessionResponse = pb.CloseSessionResponse
CommitSpliceRequest = pb.CommitSpliceRequest
FetchSessionRequest = pb.FetchSessionRequest
FetchSessionResponse = pb.FetchSessionResponse
GetSessionRequest = pb.GetSessionRequest
OpPlanMsg = pb.OpPlan  # the domain type is OpPlan
OpenSessionRequest = pb.OpenSessionRequest
SessionInfo = pb.SessionInfo
SpliceRequest = pb.SpliceRequest
