"""`ibex-context` as a newcomer meets it: one-line errors with the right exit status, plain help,
hints, settings that do what the README says, and a `make up` stack that keeps its data.

Here: the checks through running servers; the pure parts are in
tests/unit/test_cli.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import ibex_context.memory.embedded_redis.server as redis_server
import ibex_context.ops.cli as cli
import ibex_context.ops.stack as stack
from ibex_context.ops.launch import up
from ibex_context.ops.stack import LocalStack, free_port
from tests.helpers import cli_in_process, start_stack

# Branch timeouts far above the spec's so a loaded 2-core box does not turn "success" into "timeout".
ENV_FAST = {"IBEX_HEARTBEAT_INTERVAL_MS": "200", "IBEX_DIRECTIVE_TIMEOUT_MS": "1000", "IBEX_HOT_TIMEOUT_MS": "2000",
            "IBEX_COLD_TIMEOUT_MS": "2000", "IBEX_CLIENT_TIMEOUT_MS": "3000", "IBEX_RETRIEVAL_TIMEOUT_MS": "3000",
            "IBEX_CONTEXT_DEADLINE_MS": "3000", "IBEX_POST_RETRIEVAL_RESERVE_MS": "15",
            "IBEX_MAX_REPLY_RESERVE_MS": "30"}
ERROR_SLACK_S = 0.5  # a loaded CI box can stall a process this long
BAD_BYTE = os.fsdecode(b"\xff")  # what Python makes of an argv byte that is not UTF-8


def _env(**extra: str) -> dict[str, str]:
    """No IBEX_* setting but the suite's embedder (tests/conftest.py), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IBEX_")}
    env.update(IBEX_MEMORY_EMBEDDER=os.environ.get("IBEX_MEMORY_EMBEDDER", "hash"), **extra)
    return env


def _cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The command as a process of its own: its exit status, its output, no traceback."""
    return subprocess.run([sys.executable, "-m", "ibex_context.ops.cli", *args], capture_output=True, text=True,
                          errors="backslashreplace", env=env if env is not None else _env(), input=stdin,
                          timeout=60, check=False)


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command's ``main()`` in this process (tests.helpers.cli_in_process): what it says and
    returns; the tests that use ``_cli`` hold a real process to the same."""
    return cli_in_process(*args, env=env if env is not None else _env())


def assert_one_line(out: subprocess.CompletedProcess[str], code: int, prefix: str, *needles: str) -> None:
    """Exit ``code``, exactly one line on stderr starting with ``prefix``, naming every needle."""
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(prefix), out.stderr
    for needle in needles:
        assert needle in out.stderr, (needle, out.stderr)


# ------------------------------------------------------------------------ caller mistakes: exit 2


ASSEMBLE = ("assemble", "--org", "acme", "--agent", "bot", "--query", "q")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--model", ""], "--model"),
        (["--org", "acme:x"], "--org"),
        (["--agent", "a b"], "--agent"),
        (["--org", "ac" + BAD_BYTE + "me"], "--org: not valid UTF-8"),
        (["--query", "q" + BAD_BYTE], "--query: not valid UTF-8"),
        (["--timeout-ms", "nan"], "--timeout-ms"),
        (["--timeout-ms", "inf"], "--timeout-ms"),
        (["--timeout-ms", "-1"], "--timeout-ms"),
        (["--timeout-ms", "0"], "--timeout-ms"),
        (["--timeout-ms", "soon"], "--timeout-ms"),
        (["--query", "x" * 120_000], "--query: String should have at most 100000 characters"),
        (["--message", "hello"], "--message: expected ROLE:TEXT"),
        (["--message", "boss:do it"], "--message"),
        (["--endpoint", "not-an-endpoint"], "--endpoint"),
        (["--endpoint", ""], "--endpoint"),
    ],
)
def test_assemble_mistakes_are_one_line_and_exit_2(extra: list[str], needle: str) -> None:
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: a mistake must be found before sending
    out = _run(*ASSEMBLE, "--timeout-ms", "300", *extra, env=_env(IBEX_BROKER_ENDPOINTS=dead))
    assert_one_line(out, 2, "ibex-context assemble: ", needle)


def test_usage_errors_are_one_line() -> None:
    out = _cli("assemble", "--org", "acme")
    assert_one_line(out, 2, "ibex-context assemble: ", "--agent", "--query")
    out = _run(*ASSEMBLE, "--bogus")  # the same parser's errors: a real process's exit is held above
    assert_one_line(out, 2, "ibex-context: ", "unrecognized arguments: --bogus")
    out = _run("frobnicate")
    assert_one_line(out, 2, "ibex-context: ", "frobnicate")


def test_malformed_setting_is_one_line() -> None:
    # a client command reads the client's settings only: a worker's malformed one is not its concern
    out = _cli(*ASSEMBLE, env=_env(IBEX_CLIENT_TIMEOUT_MS="soon", IBEX_WORKERS="many"))
    assert_one_line(out, 2, "ibex-context assemble: ", "IBEX_CLIENT_TIMEOUT_MS")
    out = _run("status", env=_env(IBEX_WORKERS="many"))  # a real process's exit is held by the first
    assert_one_line(out, 2, "ibex-context status: ", "IBEX_WORKERS")
    out = _run(*ASSEMBLE, env=_env(IBEX_CLIENT_KEY_FILE="/nonexistent/me.key", IBEX_BROKER_PUBLIC_KEY="x"))
    assert_one_line(out, 2, "ibex-context assemble: ", "/nonexistent/me.key")


def test_stopped_broker_is_one_line_exit_1_within_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    # First imports are not what this test times.
    import ibex_context.client.client
    import ibex_context.ops.assemble_cmd
    import ibex_context.shared.wire.models  # noqa: F401

    dead = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    code = cli.main([*ASSEMBLE, "--endpoint", dead, "--timeout-ms", "300"])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("ibex-context assemble: UNAVAILABLE"), err
    assert elapsed < 0.3 + ERROR_SLACK_S


# ------------------------------------------------------------------------------------- live stack


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start_stack(tmp_path_factory.mktemp("cli-stack"), seed=False, workers=1, env=ENV_FAST)
    try:
        out = _cli("directive", "set", "--org", "acme", "--agent", "known", "--text", "Be brief.",
                   "--redis-url", str(s.redis_url))
        assert out.returncode == 0, out.stderr
        yield s
    finally:
        s.stop()


def _live_env(s: LocalStack) -> dict[str, str]:
    return _env(IBEX_BROKER_ENDPOINTS=s.frontend)


def test_unknown_agent_gets_a_hint(live: LocalStack) -> None:
    out = _cli(*ASSEMBLE[:3], "--agent", "nobody", "--query", "invoice", "--timeout-ms", "5000", env=_live_env(live))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ("ibex-context assemble: hint: no directive and no memories for this org/agent: "
                          "check --org/--agent or seed data (ibex-context seed)\n")
    # --json keeps stdout parseable: the hint goes to stderr (main() here: the process is held above)
    out = _run(*ASSEMBLE[:3], "--agent", "nobody", "--query", "invoice", "--timeout-ms", "5000", "--json",
               env=_live_env(live))
    assert out.returncode == 0 and json.loads(out.stdout)["packed"] == [] and "hint" in out.stderr


def test_known_agent_gets_no_hint(live: LocalStack) -> None:
    out = _cli(*ASSEMBLE[:3], "--agent", "known", "--query", "invoice", "--timeout-ms", "5000", "--json",
               env=_live_env(live))
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and json.loads(out.stdout)["branches"]["directive"]["count"] == 1


def test_unknown_model_from_the_worker_is_exit_2(live: LocalStack) -> None:
    out = _cli(*ASSEMBLE[:5], "--model", "no-such-model-9", "--query", "q", "--timeout-ms", "5000",
               env=_live_env(live))
    assert_one_line(out, 2, "ibex-context assemble: ", "no-such-model-9")


def test_broker_stopped_under_a_live_stack_is_exit_1(live: LocalStack) -> None:
    live.stop_broker(0)
    try:
        t0 = time.monotonic()
        out = _cli(*ASSEMBLE, "--timeout-ms", "500", env=_live_env(live))
        assert_one_line(out, 1, "ibex-context assemble: ")
        assert time.monotonic() - t0 < 10  # process start-up included; never a hang
    finally:
        live.start_broker(0)
        live.wait_workers(1)


CHAT_REQUEST = {"org_id": "acme", "agent_id": "known", "model": "gpt-4o", "query": "invoice", "format": "openai",
                "messages": [{"role": "user", "content": "Is invoice #42 mine?"},
                             {"role": "assistant", "content": None, "tool_calls": [{
                                 "id": "c1", "type": "function",
                                 "function": {"name": "lookup", "arguments": "{\"q\": \"42\"}"}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": "invoice #42: 120 EUR"}],
                "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]}


def test_a_chat_request_file_assembles_the_proxys_conversation(live: LocalStack, tmp_path: Path) -> None:
    path = tmp_path / "turn.json"
    path.write_text(json.dumps(CHAT_REQUEST))
    out = _cli("assemble", "--request", str(path), "--timeout-ms", "5000", env=_live_env(live))
    assert out.returncode == 0, out.stderr
    assert "prompt (openai): 4 messages" in out.stdout and "| system    Be brief." in out.stdout
    assert 'tool_calls=[{"id": "c1"' in out.stdout and "| tool      invoice #42: 120 EUR" in out.stdout
    # an option overrides the file's field; --json is the whole response (main() here: the process is held above)
    out = _run("assemble", "--request", str(path), "--agent", "nobody", "--json", "--timeout-ms", "5000",
               env=_live_env(live))
    resp = json.loads(out.stdout)
    assert out.returncode == 0 and resp["branches"]["directive"]["count"] == 0 and resp["format"] == "openai"
    assert [m["role"] for m in resp["messages"]][-2:] == ["assistant", "tool"]
    example = Path(__file__).resolve().parents[2] / "examples" / "chat_request.json"  # the README's
    out = _run("assemble", "--request", str(example), "--timeout-ms", "5000", env=_live_env(live))
    assert out.returncode == 0 and "prompt (openai): 4 messages" in out.stdout, out.stderr


def test_a_chat_request_the_worker_refuses_names_the_message(live: LocalStack, tmp_path: Path) -> None:
    bad = {**CHAT_REQUEST, "messages": [CHAT_REQUEST["messages"][2]]}  # a tool result without its call
    path = tmp_path / "orphan.json"
    path.write_text(json.dumps(bad))
    out = _cli("assemble", "--request", str(path), "--timeout-ms", "5000", env=_live_env(live))
    assert_one_line(out, 2, "ibex-context assemble: ", "messages.0")


@pytest.mark.parametrize(("content", "needle"), [
    (None, "No such file"), ("[1, 2]", "must hold a JSON object"), ("{not json", "not valid JSON"),
    ('{"org_id": "a b", "agent_id": "x", "query": "q"}', "org_id"),
    ('{"org_id": "acme", "agent_id": "x", "query": 5}', "query"), ('{"org_id": "acme"}', "agent_id, query missing"),
])
def test_request_file_mistakes_are_one_line(tmp_path: Path, content: str | None, needle: str) -> None:
    path = tmp_path / "req.json"
    if content is not None:
        path.write_text(content)
    out = _run("assemble", "--request", str(path), "--endpoint", "tcp://127.0.0.1:1")
    assert_one_line(out, 2, "ibex-context assemble: --request", needle)


def test_without_a_request_file_org_agent_and_query_are_required() -> None:
    out = _run("assemble", "--org", "acme")  # a real process: test_usage_errors_are_one_line
    assert_one_line(out, 2, "ibex-context assemble: ", "--agent, --query required")


# ------------------------------------------------------------------------------------ help texts


@pytest.mark.parametrize(
    ("args", "usage"),
    [
        ([], "usage: ibex-context "), (["assemble"], "usage: ibex-context assemble "),
        (["explain"], "usage: ibex-context explain "), (["status"], "usage: ibex-context status"),
        (["up"], "usage: ibex-context up"), (["demo"], "usage: ibex-context demo"),
        (["keys"], "usage: ibex-context keys "), (["directive"], "usage: ibex-context directive "),
        (["directive", "set"], "usage: ibex-context directive set "), (["seed"], "usage: ibex-context seed "),
    ],
)
def test_help_is_plain_text_and_names_the_command(args: list[str], usage: str) -> None:
    out = _run(*args, "-h")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(usage), out.stdout[:200]
    assert "``" not in out.stdout and "python -m" not in out.stdout


def test_every_assemble_option_has_help_and_its_default() -> None:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "cmd")
    assemble = sub.choices["assemble"]  # type: ignore[index]
    for action in assemble._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        assert action.required or "default" in action.help, action.option_strings
    assert "default: 200" in _run("assemble", "-h").stdout.replace("\n", " ").replace("  ", " ")
    assert cli.DEFAULT_TIMEOUT_MS == 200.0


# ------------------------------------------------------------------------------------- status


def test_status_with_the_stack_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(stack, "CONF", tmp_path / "supervisord.conf")  # no .run/ there: nothing runs
    monkeypatch.setenv("IBEX_BROKER_ENDPOINTS", f"tcp://127.0.0.1:{free_port()}")
    assert cli.main(["status"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == "ibex-context: stack is not running (start it with `make up`)\n"


# ------------------------------------------------------------------------------ directive and seed


def test_directive_and_seed_errors_are_one_line(redis_url: str, tmp_path: Path) -> None:
    out = _run("directive", "show", "--org", "ac" + BAD_BYTE, "--agent", "bot", "--redis-url", redis_url)
    assert_one_line(out, 2, "ibex-context directive show: ", "--org: not valid UTF-8")
    out = _run("directive", "set", "--org", "acme", "--agent", "bot", "--text", "", "--redis-url", redis_url)
    assert_one_line(out, 2, "ibex-context directive set: ", "--text", "empty", "delete")
    out = _run("directive", "show", "--org", "acme", "--agent", "bot", "--redis-url", "http://nope")
    assert_one_line(out, 2, "ibex-context directive show: ", "http://nope")
    out = _run("directive", "frobnicate")
    assert_one_line(out, 2, "ibex-context directive: ", "frobnicate")
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"kind": "directive", "org_id": "acme", "agent_id": "bot", "text": "  "}\n')
    out = _run("seed", "--file", str(blank), "--redis-url", redis_url)
    assert_one_line(out, 2, "ibex-context seed: ", "blank.jsonl:1", "empty")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"org_id": "acme", "agent_id": "bot", "content": "\xff"}\n')
    out = _run("seed", "--file", str(binary), "--redis-url", redis_url)
    assert_one_line(out, 2, "ibex-context seed: ", "binary.jsonl", "UTF-8")
    out = _run("seed", "--file", str(tmp_path / "absent.jsonl"), "--redis-url", redis_url)
    assert_one_line(out, 2, "ibex-context seed: ", "absent.jsonl")
    out = _run("seed", "--redis-url", "redis://127.0.0.1:1/0", "--file", str(blank.with_name("ok.jsonl")))
    assert out.returncode == 2  # the missing file is found before any connection
    for unreachable in ("redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1/0"):  # one server, a cluster
        out = _run("seed", "--redis-url", unreachable)
        assert_one_line(out, 1, "ibex-context seed: ", "127.0.0.1:1")
    with redis.Redis.from_url(redis_url) as r:
        assert r.dbsize() == 0  # nothing was written by any of them


# -------------------------------------------------------------- make up / down / up keeps the data


@pytest.fixture
def stack_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A private copy of supervisord.conf (so .run/ is under tmp_path), free ports, one worker, the
    suite's embedder (tests/conftest.py)."""
    embedder = os.environ.get("IBEX_MEMORY_EMBEDDER", "hash")
    for key in list(os.environ):
        if key.startswith("IBEX_"):
            monkeypatch.delenv(key)
    front, back = free_port(), free_port()
    for key, value in {"IBEX_WORKERS": "1", "IBEX_MEMORY_EMBEDDER": embedder, "IBEX_REDIS_PORT": str(free_port()),
                       "IBEX_MEMORY_PORT": str(free_port()), "IBEX_METRICS_PORT": "0",
                       "IBEX_BROKER_FRONTEND": f"tcp://127.0.0.1:{front}",
                       "IBEX_BROKER_BACKEND": f"tcp://127.0.0.1:{back}",
                       "IBEX_BROKER_ENDPOINTS": f"tcp://127.0.0.1:{front}", **ENV_FAST}.items():
        monkeypatch.setenv(key, value)
    conf = tmp_path / "supervisord.conf"
    shutil.copy(stack.CONF, conf)
    monkeypatch.setattr(redis_server, "RUN_DIR", stack.run_dir_of(conf))  # where the CLIs look
    try:
        yield conf
    finally:
        stack.down(conf=conf)


def _up(conf: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code = up(60.0, conf=conf)
    out = capsys.readouterr()
    assert code == 0, out.err + "\n" + "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in (conf.parent / ".run" / "logs").glob("*"))
    return out.out


def test_up_down_up_keeps_data_and_the_cli_finds_the_stack(stack_env: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    conf = stack_env
    printed = _up(conf, capsys)
    assert "metrics off (IBEX_METRICS_PORT=0)" in printed  # an explicit 0 is honoured under up
    run_dir = stack.run_dir_of(conf)
    url = redis_server.stack_redis_url(run_dir)
    assert url == f"redis://127.0.0.1:{os.environ['IBEX_REDIS_PORT']}/0"
    # no --redis-url and no IBEX_REDIS_URL: the CLIs use the running stack's Redis
    assert cli.main(["directive", "set", "--org", "acme", "--agent", "bot", "--text", "Keep me."]) == 0
    assert cli.main(["seed"]) == 0
    capsys.readouterr()
    assert stack.down(conf=conf) == 0
    assert redis_server.stack_redis_url(run_dir) is None  # down forgets the URL ...
    assert cli.main(["directive", "show", "--org", "acme", "--agent", "bot"]) == 2  # ... so no stale default
    assert "no Redis" in capsys.readouterr().err
    assert any((run_dir / "redis").iterdir())  # ... but keeps the data
    _up(conf, capsys)
    assert cli.main(["directive", "show", "--org", "acme", "--agent", "bot"]) == 0
    shown: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert shown["text"] == "Keep me." and shown["version"] == 1
    with redis.Redis.from_url(url) as r:  # the seeded demo data survived too
        assert r.exists("{acme}:directive:support-bot") == 1
    assert not any("metrics on" in p.read_text() for p in (run_dir / "logs").glob("broker*.log"))


# ------------------------------------------------------------------------------------- explain

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_explain_mistakes_are_one_line(tmp_path: Path) -> None:
    cands = str(EXAMPLES / "candidates.json")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"query": "\xff"}')
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for path, needle in [(binary, "not valid UTF-8"), (deep, "nested too deeply"), (tmp_path, "Is a directory")]:
        out = _run("explain", "--request", str(path), "--candidates", cands)
        assert_one_line(out, 2, "ibex-context explain: ", str(path), needle)
    req = str(EXAMPLES / "request.json")
    out = _run("explain", "--request", req, "--candidates", cands, "--nonce", "not-hex")
    assert_one_line(out, 2, "ibex-context explain: --nonce: ", "hex")
    out = _run("explain", "--request", req, "--candidates", cands, "--nonce", "ab" + BAD_BYTE)
    assert_one_line(out, 2, "ibex-context explain: ", "--nonce: not valid UTF-8")
    out = _run("explain", "--request", req, "--candidates", cands, "--format", "yaml")
    assert_one_line(out, 2, "ibex-context explain: ", "--format")
