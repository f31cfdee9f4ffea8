"""The Batch API (/v1/files, /v1/batches) with OpenAI's own client against a
real loopback server, and ``trioserve run-batch`` as a subprocess.

Waiting for a batch awaits the server's own ``BatchService.wait_for`` on its
trio loop (no sleeps); each wait has a timeout.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import openai
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import MODEL, server_config, server_in_thread

from trioserve.web.app import create_app
from trioserve.web.batch_lines import LineError, RequestLine, read_lines
from trioserve.web.batch_runner import LineRunner, ServerStopping
from trioserve.web.batch_service import EXTENSION
from trioserve.web.batch_store import BatchStore, LineLog, read_complete_lines

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
WAIT_TIMEOUT = 120.0
# Small enough that the 413 test uploads little; larger than every test's file.
MAX_UPLOAD = 1 << 16
# Few sequences: the engine warms its kernels up for each batch size, and a
# test batch runs a handful of lines at a time.
ENGINE = {"max_num_seqs": 8}


def chat_line(custom_id: str, content: str, max_tokens: int = 6, **body) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def jsonl(*lines) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


# The batch a server's shutdown cuts off: a short line, a longer one that
# is running when the server stops, a short one.
RESUMED = [
    chat_line("r0", "Tell me about rivers.", max_tokens=2),
    chat_line("r1", "Tell me about lakes.", max_tokens=24, ignore_eos=True),
    chat_line("r2", "Tell me about seas.", max_tokens=2),
]


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def interrupted(default_loaded, batch_dir):
    """A batch whose server stopped after its first line finished: its id
    and its output file's lines then. The module's server resumes it."""
    config = server_config(engine=ENGINE, batch_dir=str(batch_dir), batch_max_in_flight=1)
    with server_in_thread(create_app(config, loaded=default_loaded)) as first:
        with openai.OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0) as client:
            batch_id = submit(client, jsonl(*RESUMED)).id
        wait_for(first, batch_id, lambda b: b["request_counts"]["completed"] >= 1)
    stopped = BatchStore(batch_dir).batch(batch_id)
    assert stopped["status"] == "in_progress" and stopped["request_counts"]["completed"] < len(RESUMED)
    before = (batch_dir / "files" / f"file-{batch_id}-output.data").read_text().splitlines()
    return batch_id, [json.loads(line) for line in before]


@pytest.fixture(scope="module")
def server(default_loaded, batch_dir, interrupted):
    config = server_config(engine=ENGINE, batch_dir=str(batch_dir), max_upload_size=MAX_UPLOAD, batch_max_in_flight=2)
    with server_in_thread(create_app(config, loaded=default_loaded)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as sync_client:
        yield sync_client


def wait_for(server, batch_id: str, done=lambda batch: batch["status"] in ("completed", "cancelled", "failed")) -> dict:
    """Await ``done(batch)`` on the server's loop (BatchService.wait_for)."""
    service = server.app.extensions[EXTENSION]

    async def wait() -> dict:
        with trio.fail_after(WAIT_TIMEOUT):
            return dict(await service.wait_for(batch_id, done))

    return trio.from_thread.run(wait, trio_token=server.token)


def submit(client, data: bytes, endpoint: str = CHAT):
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def read_file(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_completes_with_what_each_line_answers_interactively(server, client):
    lines = [chat_line(f"q{i}", content) for i, content in enumerate(["Name a river.", "Say hi."])]
    batch = submit(client, jsonl(*lines))
    assert batch.status == "validating" and batch.endpoint == CHAT
    wait_for(server, batch.id)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 2 and batch.request_counts.completed == 2 and batch.request_counts.failed == 0
    assert batch.error_file_id is None and batch.in_progress_at and batch.completed_at
    outputs = {line["custom_id"]: line for line in read_file(client, batch.output_file_id)}
    assert sorted(outputs) == ["q0", "q1"]
    for line in lines:
        out = outputs[line["custom_id"]]
        assert out["error"] is None and out["response"]["status_code"] == 200 and out["response"]["request_id"]
        interactive = client.chat.completions.create(**line["body"])
        assert out["response"]["body"]["choices"][0]["message"]["content"] == interactive.choices[0].message.content
        assert out["response"]["body"]["usage"] == interactive.usage.model_dump(exclude_none=True) | out["response"]["body"]["usage"]
    assert batch.id in [b.id for b in client.batches.list()]
    output_file = client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes > 0
    assert {batch.output_file_id, batch.input_file_id} <= {f.id for f in client.files.list()}
    assert client.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(batch.input_file_id)


def test_bad_lines_go_to_the_error_file_and_the_rest_complete(server, client):
    data = jsonl(
        chat_line("ok1", "Say yes."),
        b"{not json",
        chat_line("ok1", "Say no."),  # a duplicate custom_id
        {**chat_line("m", "Hi."), "method": "GET"},
        {**chat_line("u", "Hi."), "url": "/v1/completions"},  # not the batch's endpoint
        chat_line("t", "Hi.", temperature=-1),  # the endpoint refuses it: 400
        chat_line("ok2", "Say maybe."),
    )
    batch = submit(client, data)
    wait_for(server, batch.id)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (7, 2, 5)
    assert sorted(line["custom_id"] for line in read_file(client, batch.output_file_id)) == ["ok1", "ok2"]
    errors = read_file(client, batch.error_file_id)
    by_line = {e["error"]["line"]: e for e in errors if e["error"] is not None}
    assert by_line[2]["custom_id"] is None and by_line[2]["error"]["code"] == "invalid_json"
    assert by_line[3]["custom_id"] == "ok1" and by_line[3]["error"]["param"] == "custom_id"
    assert by_line[4]["error"]["param"] == "method" and by_line[5]["error"]["param"] == "url"
    refused = next(e for e in errors if e["custom_id"] == "t")
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"]["error"]["param"] == "temperature"


def test_cancel_keeps_the_finished_lines_and_aborts_the_rest(server, client):
    lines = [chat_line(f"c{i}", f"Write a story about the number {i}.", max_tokens=16, ignore_eos=True) for i in range(8)]
    batch = submit(client, jsonl(*lines))
    wait_for(server, batch.id, lambda b: b["request_counts"]["completed"] >= 1)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    wait_for(server, batch.id)
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    finished = read_file(client, batch.output_file_id)
    assert 1 <= len(finished) == batch.request_counts.completed < 8
    assert len({line["custom_id"] for line in finished}) == len(finished)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(client.batches.list().data[-1].id)  # the first, completed batch


def test_refusals_name_the_field(server, client):
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(chat_line("a", "Hi.")))), purpose="batch")
    cases = [
        (dict(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h"), "endpoint", openai.BadRequestError),
        (dict(input_file_id=uploaded.id, endpoint=CHAT, completion_window="1h"), "completion_window", openai.BadRequestError),
        (dict(input_file_id="file-nope", endpoint=CHAT, completion_window="24h"), "input_file_id", openai.NotFoundError),
    ]
    for body, field, error in cases:
        with pytest.raises(error) as refused:
            client.batches.create(**body)
        assert refused.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_UPLOAD + 1))), purpose="batch")
    assert refused.value.status_code == 413 and refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as refused:
        client.batches.retrieve("batch_nope")
    assert refused.value.body["param"] == "batch_id"


LINE = st.one_of(
    st.builds(lambda i: chat_line(f"id{i}", "Hi.", max_tokens=1), st.integers(0, 3)),  # duplicates likely
    st.just(b"[1, 2"),
    st.builds(lambda i: {**chat_line(f"id{i}", "Hi.", max_tokens=1), "url": "/v1/nope"}, st.integers(0, 3)),
    st.builds(lambda i: chat_line(f"id{i}", "Hi.", max_tokens=1, top_p=2), st.integers(0, 3)),
)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(LINE, min_size=1, max_size=5))
def test_every_line_leaves_exactly_one_line(server, client, lines):
    batch = submit(client, jsonl(*lines))
    wait_for(server, batch.id)
    batch = client.batches.retrieve(batch.id)
    written = read_file(client, batch.output_file_id) + read_file(client, batch.error_file_id)
    assert len(written) == len(lines) == batch.request_counts.total
    assert batch.request_counts.completed + batch.request_counts.failed == len(lines)
    # The first line of each custom_id runs (or is refused) once; its
    # duplicates are each recorded as duplicates.
    ran = [w["custom_id"] for w in written if w["error"] is None or w["error"]["code"] != "duplicate_custom_id"]
    named = {w["custom_id"] for w in written if w["custom_id"] is not None}
    assert sorted(c for c in ran if c is not None) == sorted(named)


def test_a_restart_resumes_a_batch_without_losing_or_repeating_lines(server, client, interrupted):
    batch_id, before = interrupted
    assert before  # the first line had finished when the server stopped
    wait_for(server, batch_id)
    batch = client.batches.retrieve(batch_id)
    written = read_file(client, batch.output_file_id)
    assert batch.status == "completed" and batch.request_counts.completed == len(RESUMED)
    assert sorted(line["custom_id"] for line in written) == ["r0", "r1", "r2"]
    assert written[: len(before)] == before  # kept as they were


def test_run_batch_writes_every_line_in_order(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(chat_line("a", "Say hi."), b"nope", chat_line("b", "Say bye.")))
    args = ["run-batch", "-i", str(source), "-o", str(out), "--max-model-len", "512", "--kv-cache-memory", "128M", "--max-num-seqs", "4"]
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", *args, "--batch-dir", str(tmp_path / "unused")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in written] == ["a", None, "b"]
    assert written[0]["response"]["status_code"] == 200 and written[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert written[1]["error"]["code"] == "invalid_json" and written[1]["error"]["line"] == 2
    assert "3/3" in result.stderr  # the progress bar


# -- the parts, without a model ---------------------------------------------


def scripted_app(answers: list[tuple[int, dict]]):
    """An app whose chat endpoint echoes the body it got, answering with
    ``answers``' statuses and headers in turn (then 200)."""
    from quart import request
    from quart_trio import QuartTrio

    app = QuartTrio(__name__)
    seen: list[dict] = []

    @app.post(CHAT)
    async def chat():
        body = await request.get_json()
        seen.append(body)
        status, headers = answers.pop(0) if answers else (200, {})
        return body, status, headers

    return app, seen


async def test_lines_run_at_the_low_priority_class_or_lower(autojump_clock):
    app, seen = scripted_app([])
    runner = LineRunner(app, priority=5, max_in_flight=2)
    lines = [RequestLine(1, "a", CHAT, {}), RequestLine(2, "b", CHAT, {"priority": 0}), RequestLine(3, "c", CHAT, {"priority": 9})]
    results = {}
    await runner.run(lines, lambda line, out: results.setdefault(line.custom_id, out))
    assert sorted(body["priority"] for body in seen) == [5, 5, 9]
    assert {out["response"]["status_code"] for out in results.values()} == {200}


async def test_a_line_turned_away_for_load_is_tried_again_and_a_drain_stops_the_run(autojump_clock):
    app, seen = scripted_app([(429, {"Retry-After": "3"}), (200, {})])
    runner = LineRunner(app, priority=1, max_in_flight=1)
    start = trio.current_time()
    out = await runner.run_line(RequestLine(1, "a", CHAT, {}))
    assert out["response"]["status_code"] == 200 and len(seen) == 2 and trio.current_time() - start >= 3
    app, _ = scripted_app([(503, {})])
    recorded = []
    with pytest.RaisesGroup(ServerStopping):
        await LineRunner(app, priority=1, max_in_flight=1).run([RequestLine(1, "a", CHAT, {})], lambda *a: recorded.append(a))
    assert recorded == []


def test_a_line_cut_short_by_a_crash_is_cut_off_before_appending(tmp_path):
    log = LineLog(tmp_path / "out.data")
    log.append({"custom_id": "a"})
    log.close()
    with open(log.path, "a") as out:
        out.write('{"custom_id": "b", "resp')
    assert read_complete_lines(log.path) == [{"custom_id": "a"}]
    log.append({"custom_id": "c"})
    log.close()
    assert read_complete_lines(log.path) == [{"custom_id": "a"}, {"custom_id": "c"}]


RAW_LINE = st.one_of(
    st.builds(lambda i: json.dumps(chat_line(f"id{i}", "Hi.")).encode(), st.integers(0, 3)),
    st.binary(max_size=20).filter(lambda raw: b"\n" not in raw),
    st.builds(lambda i, url: json.dumps({**chat_line(f"id{i}", "Hi."), "url": url}).encode(), st.integers(0, 3), st.text(max_size=5)),
)


@given(raws=st.lists(RAW_LINE, max_size=8))
def test_every_nonblank_line_is_read_once_and_custom_ids_run_once(raws):
    items = list(read_lines(b"\n".join(raws), {CHAT}))
    assert [item.number for item in items] == [i + 1 for i, raw in enumerate(raws) if raw.strip()]
    runnable = [item.custom_id for item in items if isinstance(item, RequestLine)]
    assert len(runnable) == len(set(runnable))
    assert all(item.code and item.message for item in items if isinstance(item, LineError))
