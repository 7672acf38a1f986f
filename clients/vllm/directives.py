"""Span directives riding in a request's ``kv_transfer_params``, turned into Splice calls.

Keys (all optional)::

    "sidecar_session":  "<session id>" | "open"   # "open": mirror this prompt as a new session
    "sidecar_session_version": 3                  # the version the directives address
    "sidecar_directives": [{"start": 120, "end": 180, "replacement": [ids...], "mode": "amortize"},
                           [200, 200, [ids...], "forget"], ...]

What the connector does with them (scheduler side, at the request's first Lookup):

* ``open``: ``OpenSession(prompt, block_size)``; the finished request's
  ``kv_transfer_params["sidecar"]["session"]`` carries ``{"id", "version"}`` for the next call.
* directives + session id: ``Splice(session, version, directives)`` then ``CommitSplice``: the
  sidecar's mirror of the conversation moves to the edited sequence (the request's prompt), and
  the plan's accounting (tokens kept / prefilled) comes back in the output.
* ``forget`` directives: nothing at or after the first forget edit is served from any cache the
  connector controls (the loaded run stops there; no gap-fill beyond it): the removed content's
  downstream KV is prefilled again, as ``forget`` requires.
* ``amortize``: the kept content is reused through Lookup (shifted chunks, rotated once from
  their canonical copies) and the gap-fill plug-in prefills the replacement.

What vLLM's connector API prevents: applying the OpPlan's block operations (MOVE / REINDEX /
ROTATE / FREE) to the engine's live blocks. A connector only writes KV into the blocks vLLM's
scheduler allocated for a request's external range at admission; the previous turn's blocks
are prefix-cache entries keyed by token-hash chains, shared read-only between requests, and
there is no hook to rebind a block to other positions or rotate it in place (doing so would
corrupt every request sharing it). So the plan is realized by *loading* rows (Lookup + Fetch)
into fresh blocks instead of moving them, which costs a copy per reused row (docs/vllm.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.directives import Directive, EditMode

PARAM_SESSION = "sidecar_session"
PARAM_VERSION = "sidecar_session_version"
PARAM_DIRECTIVES = "sidecar_directives"


@dataclass(slots=True)
class SessionRequest:
    session_id: str | None = None
    open: bool = False
    version: int | None = None
    directives: list[Directive] = field(default_factory=list)

    @property
    def forget_from(self) -> int | None:
        starts = [d.start for d in self.directives if d.mode is EditMode.FORGET]
        return min(starts) if starts else None


def parse(params: dict[str, Any] | None) -> SessionRequest | None:
    """The request's session directives, or None. Raises ValueError on a malformed entry."""
    if not params:
        return None
    sid = params.get(PARAM_SESSION)
    raw = params.get(PARAM_DIRECTIVES) or []
    if sid is None and not raw:
        return None
    out = SessionRequest()
    if sid == "open":
        out.open = True
    elif sid is not None:
        out.session_id = str(sid)
    if params.get(PARAM_VERSION) is not None:
        out.version = int(params[PARAM_VERSION])
    for i, d in enumerate(raw):
        if isinstance(d, dict):
            start, end = int(d["start"]), int(d["end"])
            repl, mode = d.get("replacement", []), d.get("mode", "amortize")
        else:
            start, end = int(d[0]), int(d[1])
            repl = d[2] if len(d) > 2 else []
            mode = d[3] if len(d) > 3 else "amortize"
        try:
            m = EditMode(str(mode).lower())
        except ValueError:
            raise ValueError(f"{PARAM_DIRECTIVES}[{i}].mode {mode!r}: expected 'amortize' or 'forget'") from None
        out.directives.append(Directive(start=start, end=end, replacement=np.asarray(repl, dtype=np.uint32), mode=m))
    return out


def apply(link: Any, tenant: str | None, identity: Any, block_size: int, req: SessionRequest,
          tokens: np.ndarray) -> dict[str, Any]:
    """Open or Splice + Commit for ``req`` (through ``link``: errors are counted, never raised).
    Returns what goes into the output's ``kv_transfer_params["sidecar"]["session"]``."""
    info: dict[str, Any] = {}
    if req.open:
        st = link.call("open_session", tenant, lambda c: c.open_session(tokens, block_size=block_size, identity=identity))
        if st is None:
            return {"error": "open_session failed"}
        return {"id": st.session_id, "version": st.version, "length": st.length}
    if req.session_id is None or not req.directives:
        return {"id": req.session_id} if req.session_id else {}
    sid = req.session_id
    version = req.version
    if version is None:
        cur = link.call("get_session", tenant, lambda c: c.get_session(sid))
        if cur is None:
            return {"id": sid, "error": "get_session failed"}
        version = cur.version
    plan = link.call("splice", tenant, lambda c: c.splice(sid, version, req.directives))
    if plan is None:
        return {"id": sid, "error": "splice failed"}
    st = link.call("commit_splice", tenant, lambda c: c.commit_splice(plan.plan_id))
    if st is None:
        link.call("abort_splice", tenant, lambda c: c.abort_splice(plan.plan_id))
        return {"id": sid, "error": "commit_splice failed"}
    s = plan.summary
    info.update({"id": sid, "version": st.version, "length": st.length, "plan_tokens_kept": s.tokens_kept,
                 "plan_tokens_prefilled": s.tokens_prefilled, "forget_from": req.forget_from})
    if st.length != len(tokens):
        info["note"] = f"session holds {st.length} tokens after the splice, the prompt {len(tokens)}"
    return info
