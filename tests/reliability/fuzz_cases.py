"""Hypothesis strategies of bad requests for the fuzz test, each drawn as a
``Case``: what to send, and what the answer must be.

Three families:

- ``field_cases``: a valid body of one route with one to three fields
  replaced. A value of a type the field never takes (a string for ``n``,
  ``NaN`` for ``temperature``, a lone surrogate in any string) must get a 400
  naming that field; a value of the right type but any size (huge, negative,
  empty) may be valid, so it gets a 2xx or a 4xx.
- ``body_cases``: raw bodies: invalid UTF-8, truncated JSON, deep nesting,
  non-objects, oversized, random bytes.
- ``http_cases``: methods, paths, content types, API keys and headers.

Every string the server echoes back is checked by the test, not here.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
from hypothesis import strategies as st

from server_fixtures import MODEL

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 << 10
MAX_JSON_DEPTH = 32  # web/json_body.py
VOCAB_SIZE = 49152

JSON_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
GET_ROUTES = ("/v1/models", "/health", "/version", "/metrics")
OPEN_ROUTES = ("/health", "/version", "/metrics")


@attrs.frozen
class Raw:
    """A JSON token written as it is: ``NaN``, ``Infinity``, ``1e400``."""

    text: str


@attrs.frozen
class Case:
    """One request and the answers it may get.

    ``error``: the answer must be a 4xx (else a 2xx is fine too); ``status``:
    exactly this status; ``fields``: a 400 must name one of these (OpenAI's
    ``param`` starts with it); ``may_time_out``: the request set a deadline,
    so a 504 ``request_timeout`` is a right answer too.
    """

    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = attrs.field(factory=dict)
    error: bool = True
    status: int | None = None
    fields: tuple[str, ...] = ()
    may_time_out: bool = False
    note: str = ""


def encode(body: Any, *, raw_surrogates: bool = False) -> bytes:
    """``body`` as JSON, ``Raw`` values written as they are. Lone surrogates
    become JSON escapes, or with ``raw_surrogates`` their (invalid) UTF-8
    bytes."""
    raws: dict[str, str] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            key = f"@raw{len(raws)}@"
            raws[key] = value.text
            return key
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(body), ensure_ascii=not raw_surrogates)
    for key, token in raws.items():
        text = text.replace(json.dumps(key), token)
    return text.encode("utf-8", "surrogatepass")


# -- values ------------------------------------------------------------------

NON_FINITE = st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400")])
SURROGATE_TEXT = st.builds(
    lambda before, code, after: before + chr(code) + after,
    st.text(max_size=5),
    st.integers(0xD800, 0xDFFF),
    st.text(max_size=5),
)
SMALL_TEXT = st.text(max_size=20)
HUGE_INT = st.integers(min_value=-(2**80), max_value=2**80)
EDGE_INTS = st.sampled_from([-(2**63), -(2**31), -2, -1, 0, 1, 2, 20, 21, 127, 128, 129, 2**31, 2**63, 2**64])
INTS = st.one_of(EDGE_INTS, HUGE_INT, st.integers(-3, 300))
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 0.5, 1.0, 2.0, -2.0, 2.0000001, 100.0, -100.0, 1e300, -1e300]),
    st.floats(allow_nan=False, allow_infinity=False),
)
SCALARS = st.one_of(st.booleans(), INTS, FLOATS, SMALL_TEXT)
ANY_JSON = st.recursive(
    st.one_of(st.none(), SCALARS),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(SMALL_TEXT, inner, max_size=3)),
    max_leaves=8,
)
NOT_INT = st.one_of(NON_FINITE, st.booleans(), SMALL_TEXT, st.floats(allow_nan=False), st.lists(INTS, max_size=2), st.just({}))
NOT_NUMBER = st.one_of(
    NON_FINITE, st.booleans(), SMALL_TEXT, st.lists(FLOATS, max_size=2), st.dictionaries(SMALL_TEXT, INTS, max_size=2)
)
NOT_BOOL = st.one_of(NON_FINITE, INTS, FLOATS, SMALL_TEXT, st.lists(st.booleans(), max_size=2), st.just({}))
NOT_STR = st.one_of(NON_FINITE, st.booleans(), INTS, FLOATS, st.lists(SMALL_TEXT, max_size=2), st.just({}))
# Huge and empty values: long enough to pass the context limit, short
# enough to stay under the body limit (most of the time).
HUGE_TEXT = st.builds(
    lambda text, count: text * count, st.sampled_from(["x", "ab ", "é", "😀", "\n"]), st.integers(500, 20_000)
)
TOKEN_IDS = st.one_of(
    st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), INTS), max_size=40),
    st.integers(100, 10_000).map(lambda count: [1] * count),
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant"]), SMALL_TEXT),
        "content": st.one_of(
            st.text(max_size=200), st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SMALL_TEXT}), max_size=3)
        ),
    }
)

# Values of a type the field never takes: each must get a 400 naming it.
_INT_FIELD = ("int", NOT_INT)
_NUMBER_FIELD = ("number", NOT_NUMBER)
_BOOL_FIELD = ("bool", NOT_BOOL)
_STR_FIELD = ("str", NOT_STR)
_BAD_TOKEN_IDS = st.one_of(
    NOT_STR.filter(lambda v: not isinstance(v, list)),
    st.sampled_from([[-1], [1.5], [True], ["1"], [[1]], [VOCAB_SIZE], [2**70], [None]]),
)
_BAD = {
    "int": NOT_INT,
    "number": NOT_NUMBER,
    "bool": NOT_BOOL,
    "str": NOT_STR,
    "prompt": st.one_of(
        st.sampled_from([[], "", [""], [[]], [-1], [1.5], [True], ["a", "b"], [[1], [2]], [VOCAB_SIZE], {}, 0, 1.5, True]),
        NON_FINITE,
        st.lists(SMALL_TEXT, min_size=2, max_size=3),
    ),
    "text": NOT_STR,
    "messages": st.one_of(
        NOT_STR.filter(lambda v: not isinstance(v, list)),
        st.sampled_from(
            [
                [],
                [1],
                ["Hi"],
                [{"content": "Hi"}],
                [{"role": "user"}],
                [{"role": "bot", "content": "Hi"}],
                [{"role": 1, "content": "Hi"}],
                [{"role": "user", "content": 1}],
                [{"role": "user", "content": {"text": "Hi"}}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                [{"role": "user", "content": [{"type": "text", "text": 1}]}],
                [{"role": "user", "content": ["Hi"]}],
            ]
        ),
    ),
    "stop": st.one_of(NON_FINITE, INTS, st.just(""), st.sampled_from([[""], [1], [None], [[]], {}, True])),
    "token_ids": _BAD_TOKEN_IDS,
    "logit_bias": st.one_of(
        NON_FINITE,
        st.sampled_from(
            [[], "x", 1, True, {"a": 1}, {"1": "x"}, {"1": 101}, {"1": -100.5}, {"-1": 0}, {"1": True}, {"1.5": 1}]
        ),
        st.sampled_from([{str(VOCAB_SIZE): 1}, {"1": Raw("NaN")}, {"1": Raw("Infinity")}]),
    ),
    "stream_options": st.one_of(NOT_STR.filter(lambda v: not isinstance(v, dict)), st.just({"include_usage": "yes"})),
    "echo": st.one_of(SMALL_TEXT, st.integers(1, 5), st.just([])),
    "suffix": st.one_of(SMALL_TEXT.filter(bool), INTS, st.just([])),
    "best_of": st.one_of(SMALL_TEXT, st.just(1.0), st.just(True), st.just([])),
    "response_format": st.one_of(
        SMALL_TEXT,
        INTS,
        st.just([]),
        st.just({}),
        st.just({"type": "xml"}),
        st.just({"type": "json_schema"}),
        st.just({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
    ),
    "tools": st.one_of(SMALL_TEXT.filter(bool), st.integers(1, 5), st.just([{"type": "function"}]), st.just({"a": 1})),
}
# Values of the right type, any size: a 2xx or a 4xx.
_ANY = {
    "int": INTS,
    "number": st.one_of(FLOATS, INTS),
    "bool": st.booleans(),
    "str": st.one_of(st.just(MODEL), st.text(max_size=30)),
    "prompt": st.one_of(st.text(max_size=300), HUGE_TEXT, TOKEN_IDS, st.lists(st.text(max_size=50), min_size=1, max_size=1)),
    "text": st.one_of(st.text(max_size=300), HUGE_TEXT),
    "messages": st.lists(MESSAGE, max_size=4),
    "stop": st.one_of(st.text(max_size=10), HUGE_TEXT, st.lists(st.text(max_size=10), max_size=4)),
    "token_ids": TOKEN_IDS,
    "logit_bias": st.dictionaries(INTS.map(str), st.one_of(FLOATS, INTS), max_size=4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "echo": st.booleans(),
    "suffix": st.just(""),
    "best_of": st.just(1),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tools": st.sampled_from([[], None]),
}

_SAMPLING = {
    "model": "str",
    "n": "int",
    "max_tokens": "int",
    "min_tokens": "int",
    "temperature": "number",
    "top_p": "number",
    "top_k": "int",
    "min_p": "number",
    "presence_penalty": "number",
    "frequency_penalty": "number",
    "repetition_penalty": "number",
    "seed": "int",
    "stop": "stop",
    "stop_token_ids": "token_ids",
    "include_stop_str_in_output": "bool",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "logit_bias": "logit_bias",
    "stream": "bool",
    "stream_options": "stream_options",
    "priority": "int",
    "timeout": "number",
    "best_of": "best_of",
}
# Each route: a valid body, and the kind of each field.
ROUTES: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "/v1/completions": (
        {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        {**_SAMPLING, "prompt": "prompt", "logprobs": "int", "echo": "echo", "suffix": "suffix"},
    ),
    "/v1/chat/completions": (
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        {
            **_SAMPLING,
            "messages": "messages",
            "logprobs": "bool",
            "top_logprobs": "int",
            "max_completion_tokens": "int",
            "response_format": "response_format",
            "tools": "tools",
        },
    ),
    "/tokenize": ({"model": MODEL, "prompt": "Hi"}, {"model": "str", "prompt": "text", "add_special_tokens": "bool"}),
    "/detokenize": ({"model": MODEL, "tokens": [1, 2]}, {"model": "str", "tokens": "token_ids"}),
}
# Fields whose value decides what another one means: a bad value of the
# first may be named by the second (min_tokens > max_tokens, say).
_RELATED = {
    "max_tokens": ("min_tokens",),
    "max_completion_tokens": ("min_tokens",),
    "min_tokens": ("max_tokens", "max_completion_tokens"),
    "n": ("best_of",),
    "stream": ("stream_options",),
    "logprobs": ("top_logprobs",),
}


@st.composite
def field_cases(draw: st.DrawFn) -> Case:
    """A valid body of one route with one to three fields replaced, some by
    values of a wrong type (or holding a lone surrogate)."""
    path = draw(st.sampled_from(JSON_ROUTES))
    base, kinds = ROUTES[path]
    body = dict(base)
    names = draw(st.lists(st.sampled_from(sorted(kinds)), min_size=1, max_size=3, unique=True))
    wrong = []
    for name in names:
        kind = kinds[name]
        how = draw(st.sampled_from(["wrong type", "surrogate", "any"] if kind in _TEXT_KINDS else ["wrong type", "any"]))
        if how == "wrong type":
            body[name] = draw(_BAD[kind])
            wrong.append(name)
        elif how == "surrogate":
            body[name] = _TEXT_KINDS[kind](draw(SURROGATE_TEXT))
            wrong.append(name)
        else:
            body[name] = draw(_ANY[kind])
    unknown = draw(st.one_of(st.none(), st.text(min_size=1, max_size=10).filter(lambda k: k not in kinds)))
    if unknown is not None:  # an unknown field is ignored, unless it is not text
        if draw(st.booleans()):
            body[unknown] = draw(ANY_JSON)
        else:
            body[unknown] = draw(SURROGATE_TEXT)
            wrong.append(unknown)
    # With several fields changed, the first one checked is named: any of
    # them, or one whose meaning depends on them.
    changed = names + ([unknown] if unknown is not None else [])
    fields = tuple(changed) + tuple(related for name in changed for related in _RELATED.get(name, ()))
    unknown_model = "model" in names and "model" not in wrong and body.get("model") != MODEL
    return _sized(
        Case(
            "POST",
            path,
            encode(body),
            dict(AUTH, **{"Content-Type": "application/json"}),
            # An unknown model is a 404, or a 400 when a field is checked
            # before the model is looked up (the parse), or after (token ids).
            error=bool(wrong) or unknown_model,
            status=400 if wrong and not unknown_model else None,
            fields=fields,
            may_time_out="timeout" in body,
            note=f"fields {names}, wrong: {wrong}",
        )
    )


# Kinds that hold text, and where a lone surrogate goes in a value of each.
_TEXT_KINDS = {
    "str": lambda text: text,
    "text": lambda text: text,
    "prompt": lambda text: text,
    "stop": lambda text: [text],
    "messages": lambda text: [{"role": "user", "content": text}],
}


def _sized(case: Case) -> Case:
    """``case``, answered 413 whatever its body says when the body is over the limit."""
    if case.body is not None and len(case.body) > MAX_BODY:
        return attrs.evolve(case, error=True, status=413, fields=(), note=case.note + " (too large)")
    return case


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


INVALID_UTF8 = st.sampled_from(
    [b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xe2\x82", b"\xf8\x88\x80\x80\x80", b"\x80"]
)


@st.composite
def body_cases(draw: st.DrawFn) -> Case:
    """A raw body that is not a valid request body, or only barely one."""
    path = draw(st.sampled_from(JSON_ROUTES))
    base, _ = ROUTES[path]
    valid = encode(base)
    kind = draw(
        st.sampled_from(
            [
                "invalid utf-8",
                "utf-8 surrogate",
                "truncated",
                "deep",
                "deep field",
                "not an object",
                "bom",
                "utf-16",
                "empty",
                "too large",
                "random",
            ]
        )
    )
    status, error, body = 400, True, valid
    if kind == "invalid utf-8":
        at = valid.index(b'"', 1) + 1  # inside the first key
        body = valid[:at] + draw(INVALID_UTF8) + valid[at:]
    elif kind == "utf-8 surrogate":
        name = "prompt" if "prompt" in base else "model"
        body = encode({**base, name: draw(SURROGATE_TEXT)}, raw_surrogates=True)
    elif kind == "truncated":
        body = valid[: draw(st.integers(0, len(valid) - 1))]
    elif kind == "deep":
        depth = draw(st.one_of(st.integers(1, 100), st.integers(100, 30_000)))
        opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        body = opener * depth + b"1" + closer * depth
    elif kind == "deep field":
        # An unknown field is ignored, unless it nests past the limit (the
        # body's own object is the first level, the field's list the second).
        depth = draw(st.integers(1, 3 * MAX_JSON_DEPTH))
        body = encode({**base, "extra": _nested(depth, 0)})
        error = 1 + depth > MAX_JSON_DEPTH
        status = 400 if error else None
    elif kind == "not an object":
        body = encode(draw(st.one_of(st.none(), SCALARS, st.lists(SCALARS, max_size=3))))
    elif kind == "bom":
        body = b"\xef\xbb\xbf" + valid
    elif kind == "utf-16":
        body = valid.decode().encode(draw(st.sampled_from(["utf-16", "utf-16-le", "utf-32"])))
    elif kind == "empty":
        body = b""
    elif kind == "too large":
        body = encode({**base, "pad": "x" * (MAX_BODY + draw(st.integers(0, 4 * MAX_BODY)))})
        status = 413
    else:
        body = draw(st.binary(max_size=200))
        try:
            # Bytes that happen to be a JSON object are a request like any other.
            error = not isinstance(json.loads(body.decode("utf-8")), dict)
        except ValueError:
            error = True
        status = 400 if error else None
    return _sized(
        Case("POST", path, body, dict(AUTH, **{"Content-Type": "application/json"}), error=error, status=status, note=kind)
    )


PATH_SEGMENT = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="?#%/"), min_size=1, max_size=12
).filter(lambda segment: segment not in (".", ".."))
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")


@st.composite
def http_cases(draw: st.DrawFn) -> Case:
    """Wrong methods, unknown paths, other content types, API keys, the
    timeout header."""
    kind = draw(st.sampled_from(["method", "unknown path", "content type", "api key", "timeout header", "get"]))
    json_headers = dict(AUTH, **{"Content-Type": "application/json"})
    if kind == "method":
        path = draw(st.sampled_from(JSON_ROUTES + GET_ROUTES))
        allowed = ("POST",) if path in JSON_ROUTES else ("GET",)
        method = draw(st.sampled_from([m for m in METHODS if m not in allowed]))
        return Case(method, path, None, dict(AUTH), status=405, note=kind)
    if kind == "unknown path":
        path = "/" + "/".join(draw(st.lists(PATH_SEGMENT, min_size=1, max_size=3)))
        if path in JSON_ROUTES + GET_ROUTES:
            path += "/x"
        # Without the key, an unknown path is 401 like any other: a 404
        # would tell who has no key which paths exist.
        keyed = draw(st.booleans())
        return Case(
            draw(st.sampled_from(METHODS)), path, None, dict(AUTH) if keyed else {}, status=404 if keyed else 401, note=kind
        )
    if kind == "content type":
        path = draw(st.sampled_from(JSON_ROUTES))
        base, _ = ROUTES[path]
        content_type = draw(
            st.sampled_from(
                [
                    "text/plain",
                    "application/x-www-form-urlencoded",
                    "multipart/form-data; boundary=x",
                    "application/json; charset=latin-1",
                    "",
                ]
            )
        )
        form = draw(st.booleans())
        # The body decides, whatever it is labelled: JSON is served (curl -d
        # labels it a form), a form is not JSON.
        body = b"prompt=Hi&max_tokens=2" if form else encode(base)
        return Case(
            "POST", path, body, dict(AUTH, **{"Content-Type": content_type}), error=form, status=400 if form else 200, note=kind
        )
    if kind == "api key":
        path = draw(st.sampled_from(JSON_ROUTES + GET_ROUTES))
        header = draw(
            st.one_of(
                st.just({}),
                st.just({"Authorization": "Bearer"}),
                st.just({"Authorization": f"Basic {KEY}"}),
                st.just({"Authorization": f"Bearer {KEY}x"}),
                st.just({"Authorization": f"Bearer {KEY[:-1]}"}),
                st.builds(
                    lambda t: {"Authorization": f"Bearer {t}".strip()},  # HTTP trims header values
                    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20).filter(
                        lambda t: t.strip() != KEY
                    ),
                ),
            )
        )
        is_open = path in OPEN_ROUTES
        body = encode(ROUTES[path][0]) if path in JSON_ROUTES else None
        return Case(
            "POST" if body is not None else "GET",
            path,
            body,
            header,
            error=not is_open,
            status=200 if is_open else 401,
            note=kind,
        )
    if kind == "timeout header":
        value = draw(
            st.one_of(
                st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12),
                FLOATS.map(repr),
                INTS.map(str),
            )
        ).strip()  # HTTP trims header values
        path = draw(st.sampled_from(("/v1/completions", "/v1/chat/completions")))
        try:
            seconds = float(value)
            valid = seconds > 0 and seconds != float("inf")
        except ValueError:
            valid = False
        return Case(
            "POST",
            path,
            encode(ROUTES[path][0]),
            dict(json_headers, **{"X-Request-Timeout": value}),
            error=not valid,
            fields=() if valid else ("timeout",),
            may_time_out=True,
            note=kind,
        )
    path = draw(st.sampled_from(GET_ROUTES))
    query = draw(
        st.one_of(
            st.just(""),
            st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#"), max_size=20),
        )
    )
    return Case("GET", path + ("?" + query if query else ""), None, dict(AUTH), error=False, status=200, note=kind)
