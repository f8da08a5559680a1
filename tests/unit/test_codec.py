"""The wire contract: round trips, and every kind of bad input decoding to INVALID_REQUEST."""

from __future__ import annotations

import math
import struct
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from ibex_context.pipeline.assemble import Engine, Policy, assemble
from ibex_context.pipeline.budget.catalog import Catalog
from ibex_context.pipeline.conversation.layout import for_wire
from ibex_context.pipeline.selection.hits import offline_result
from ibex_context.pipeline.types import MemoryHit
from ibex_context.shared.wire.codec import decode_reply, decode_request, encode, encode_error, peek_envelope, unpack
from ibex_context.shared.wire.errors import ErrorCode, Overloaded
from ibex_context.shared.wire.models import AssembleRequest, ErrorReply, Message
from ibex_context.shared.wire.protocol import Envelope, header_mismatch, pack_header, parse_header
from tests.properties import examples

_CATALOG = Catalog.load()


def _req(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "v": 1,
        "request_id": "r-1",
        "org_id": "acme",
        "agent_id": "support-bot",
        "model": "gpt-4o",
        "query": "where is my invoice?",
        "recent_messages": [{"role": "user", "content": "hi"}],
        "tool_schemas": [{"name": "lookup", "parameters": {"type": "object"}}],
        "options": {},
        "deadline_ns": time.time_ns() + 50_000_000,
    }
    base.update(over)
    return base


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def test_round_trip() -> None:
    req = AssembleRequest.model_validate(_req())
    back = decode_request(encode(req))
    assert back == req
    assert isinstance(back, AssembleRequest)
    assert back.recent_messages[0] == Message(role="user", content="hi")


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"org_id": 5}, "org_id"),
        ({"org_id": "a:b"}, "org_id"),  # a ':' would escape the tenant key namespace
        ({"deadline_ns": "soon"}, "deadline_ns"),
        ({"deadline_ns": -1}, "deadline_ns"),
        ({"recent_messages": [{"role": "wizard", "content": "x"}]}, "recent_messages.0.role"),
        ({"options": {"max_memories": -3}}, "options.max_memories"),
        ({"options": {"min_score": math.nan}}, "options.min_score"),
        ({"options": {"min_score": math.inf}}, "options.min_score"),
        ({"tool_schemas": [{"x": math.nan}]}, "tool_schemas[0].x"),
        ({"v": 2}, "v"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_fields_are_named(over: dict[str, object], field: str) -> None:
    out = decode_request(_pack(_req(**over)))
    assert isinstance(out, ErrorReply)
    assert out.code == ErrorCode.INVALID_REQUEST
    assert out.field == field, out.message
    assert out.request_id == "r-1"


@pytest.mark.parametrize("missing", ["request_id", "org_id", "agent_id", "model", "query", "deadline_ns"])
def test_missing_fields(missing: str) -> None:
    body = _req()
    del body[missing]
    out = decode_request(_pack(body))
    assert isinstance(out, ErrorReply) and out.field == missing


def test_garbage_and_limits() -> None:
    for data in [b"", b"\xc1", b"\x92\x01", b"\xd9\x05abc", _pack([1, 2, 3]), _pack("str")]:
        out = decode_request(data)
        assert isinstance(out, ErrorReply) and out.code == ErrorCode.INVALID_REQUEST
    big = _pack(_req(query="x" * 5000))
    out = decode_request(big, max_bytes=1024)
    assert isinstance(out, ErrorReply) and "exceeds" in out.message
    # non-UTF-8 text in a str field
    raw = _pack(_req()).replace(b"acme", b"\xff\xfe\xfd\xfc")
    out = decode_request(raw)
    assert isinstance(out, ErrorReply) and out.code == ErrorCode.INVALID_REQUEST
    nested: object = 1
    for _ in range(200):
        nested = [nested]
    out = decode_request(_pack(_req(tool_schemas=[{"deep": nested}])))
    assert isinstance(out, ErrorReply) and "nest" in out.message


@given(st.binary(max_size=512))
def test_decode_never_raises(data: bytes) -> None:
    out = decode_request(data)
    assert isinstance(out, (AssembleRequest, ErrorReply))
    assert isinstance(unpack(data), object)


def test_error_reply_round_trip() -> None:
    data = encode_error(Overloaded("queue full (1024)"), request_id="r-9")
    out = decode_reply(data)
    assert isinstance(out, ErrorReply)
    assert out.code == ErrorCode.OVERLOADED and out.request_id == "r-9" and "queue full" in out.message


# ------------------------------------------------------------------ the broker's envelope check

_envelope_values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(),
    st.text(max_size=140), st.text(alphabet="abcXYZ019_.-:/ \n", max_size=70), st.binary(max_size=10),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=2),
)


@given(field=st.sampled_from(["v", "request_id", "org_id", "agent_id", "deadline_ns", "model"]),
       value=_envelope_values)
def test_envelope_never_accepts_what_the_worker_refuses_on_its_fields(field: str, value: object) -> None:
    """The broker routes and authorizes on the envelope; the worker validates the whole model.
    Whatever the broker accepts must carry the very fields the worker's model will hold, and any
    envelope field the model refuses must be refused by the broker too."""
    data = _pack(_req(**{field: value}))
    env, full = peek_envelope(data), decode_request(data)
    if isinstance(full, AssembleRequest):
        assert isinstance(env, Envelope)
        assert env == (full.request_id, full.org_id, full.agent_id, full.deadline_ns)
    elif isinstance(env, Envelope):  # refused by the worker for a field the broker does not check
        assert full.field not in {"v", "request_id", "org_id", "agent_id", "deadline_ns"}, full
    else:
        assert env.code == ErrorCode.INVALID_REQUEST and env.field == full.field, (env, full)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"org_id": "acme:other"}, "org_id"),
        ({"agent_id": "a\n"}, "agent_id"),
        ({"request_id": ""}, "request_id"),
        ({"deadline_ns": True}, "deadline_ns"),
        ({"deadline_ns": 1.5}, "deadline_ns"),
        ({"v": 2}, "v"),
    ],
)
def test_envelope_names_the_bad_field(over: dict[str, object], field: str) -> None:
    env = peek_envelope(_pack(_req(**over)))
    assert isinstance(env, ErrorReply) and env.field == field and field in env.message


def test_envelope_refuses_garbage_and_oversize() -> None:
    assert isinstance(peek_envelope(b"\xc1"), ErrorReply)
    assert isinstance(peek_envelope(_pack([1, 2])), ErrorReply)
    big = _pack(_req(query="x" * 2000))
    err = peek_envelope(big, max_bytes=1000)
    assert isinstance(err, ErrorReply) and "exceeds" in err.message


@pytest.mark.parametrize(
    ("schemas", "field"),
    [
        ([{"": b""}], "tool_schemas[0]."),  # found by the fuzz test: used to crash the worker (INTERNAL)
        ([{"a": {"b": [1, bytearray(b"x")]}}], "tool_schemas[0].a.b[1]"),
        ([{"a": {b"k": 1}}], "tool_schemas[0].a"),
        ([{"a": math.inf}], "tool_schemas[0].a"),
    ],
)
def test_tool_schemas_must_be_json(schemas: list[dict[object, object]], field: str) -> None:
    err = decode_request(_pack(_req(tool_schemas=schemas)))
    assert isinstance(err, ErrorReply) and err.code == ErrorCode.INVALID_REQUEST
    assert err.field == field, err


# ------------------------------------------------------------------ the routing header


def _header(**over: object) -> Envelope:
    fields: dict[str, object] = {"request_id": "r-1", "org_id": "acme", "agent_id": "support-bot",
                                 "deadline_ns": time.time_ns() + 10**9, **over}
    return Envelope(**fields)  # type: ignore[arg-type]


_header_values = {
    "request_id": st.text(max_size=140) | st.text(alphabet="é€😀ab", min_size=120, max_size=130),
    "org_id": st.text(max_size=70) | st.text(alphabet="abcXYZ019_.-:/ \n", max_size=70),
    "agent_id": st.text(max_size=70) | st.text(alphabet="abcXYZ019_.-:/ \n", max_size=70),
    "deadline_ns": st.integers(min_value=-5, max_value=2**64 - 1),
}


@given(data=st.data(), field=st.sampled_from(sorted(_header_values)))
def test_header_accepts_exactly_what_the_model_accepts(data: st.DataObject, field: str) -> None:
    """The broker routes and authorizes on the header; whatever it accepts carries the very values
    the worker's model holds, and a value the model refuses in one of these fields is refused."""
    env = _header(**{field: data.draw(_header_values[field])})
    full = decode_request(_pack(_req(**env._asdict())))
    try:
        parsed = parse_header(pack_header(env))
    except ValueError:  # cannot even be carried: the model must refuse it too
        assert isinstance(full, ErrorReply)
        return
    if isinstance(full, AssembleRequest):
        assert parsed == (full.request_id, full.org_id, full.agent_id, full.deadline_ns)
    else:
        assert isinstance(parsed, ErrorReply) and parsed.field == full.field == field, (parsed, full)


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (b"", "<header>", "shorter"),
        (b"\x01" * 12, "<header>", "shorter"),
        (pack_header(_header())[:-1], "<header>", "lengths say"),
        (pack_header(_header()) + b"x", "<header>", "lengths say"),
        (pack_header(_header(org_id="acme")).replace(b"acme", b"ac\xffe"), "<header>", "UTF-8"),
        (b"\x07" + pack_header(_header())[1:], "v", "protocol version"),
        (pack_header(_header(org_id="ac:me")), "org_id", "org_id"),
        (pack_header(_header(agent_id="a b")), "agent_id", "agent_id"),
        (pack_header(_header(request_id="")), "request_id", "request_id"),
        (struct.pack("<BQHBB", 1, 0, 1, 1, 1) + b"rab", "deadline_ns", "deadline_ns"),
    ],
    ids=["empty", "short", "truncated", "trailing-byte", "bad-utf8", "version", "org_id", "agent_id",
         "request_id", "deadline"],  # stable ids: the headers carry the time, and test processes must agree
)
def test_header_refusals_name_the_problem(data: bytes, field: str, words: str) -> None:
    err = parse_header(data)
    assert isinstance(err, ErrorReply) and err.code == ErrorCode.INVALID_REQUEST
    assert err.field == field and words in err.message, err


@pytest.mark.parametrize("field", ["request_id", "org_id", "agent_id", "deadline_ns"])
def test_a_payload_that_disagrees_with_its_header_is_refused(field: str) -> None:
    env = _header()
    other = {"request_id": "r-2", "org_id": "globex", "agent_id": "other-bot", "deadline_ns": env.deadline_ns + 1}
    req = AssembleRequest.model_validate(_req(**{**env._asdict(), field: other[field]}))
    err = header_mismatch(env, req)
    assert err is not None and err.field == field and "must agree" in err.message
    assert err.request_id == env.request_id  # answered under the id the broker routed on
    assert header_mismatch(env, AssembleRequest.model_validate(_req(**env._asdict()))) is None


def _dumped(model: BaseModel) -> bytes:
    """The reference encoding: the model's dump, packed by msgpack."""
    return msgpack.packb(model.model_dump(mode="python"), use_bin_type=True)  # type: ignore[no-any-return]


_TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=40)


@settings(max_examples=examples(60), deadline=None)
@given(contents=st.lists(_TEXT.filter(str.strip), min_size=1, max_size=6), query=_TEXT.filter(str.strip),
       chat=st.booleans(), similarity=st.floats(0.0, 1.0), components=st.booleans())
def test_encode_writes_the_bytes_of_the_models_dump(contents: list[str], query: str, chat: bool,
                                                     similarity: float, components: bool) -> None:
    """Requests and whole replies (decisions, branches, a chat target's messages) encode to exactly
    the bytes msgpack makes of their dump: the fast path changes the CPU, never the wire."""
    hits = [MemoryHit(memory_id=f"m{i}", content=c, category="note", similarity=similarity, confidence=0.5,
                      rank=i + 1, source="hot", components=(similarity, 0.5, 0.5, 0.5, 1.0) if components else None)
            for i, c in enumerate(contents)]
    base = {"request_id": "r", "org_id": "acme", "agent_id": "support-bot", "model": "gpt-4o", "query": query,
            "deadline_ns": 1}
    req = AssembleRequest.model_validate(
        {**base, "format": "openai", "messages": [{"role": "user", "content": query}]} if chat
        else {**base, "recent_messages": [{"role": "user", "content": query}]})
    resp = assemble(req, offline_result(directive="Be brief.", hot=hits, cold=[]), Engine(_CATALOG, Policy()))
    for model in (req, resp, for_wire(resp), ErrorReply(code=ErrorCode.INVALID_REQUEST, message=query)):
        assert encode(model) == _dumped(model)


def test_encode_refuses_what_msgpack_refuses_the_same_way() -> None:
    """Text that is not UTF-8 cannot go on the wire: the error is msgpack's, whichever encoder ran first."""
    bad = ErrorReply(code=ErrorCode.INTERNAL, message="lone \ud800 surrogate")
    with pytest.raises(UnicodeEncodeError):
        _dumped(bad)
    with pytest.raises(UnicodeEncodeError):
        encode(bad)
