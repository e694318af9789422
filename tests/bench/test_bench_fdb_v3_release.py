"""``--fdb-v3-dir``: the benchmark's released world (mock APIs, agent tools and persona) read from its v3 folder.

The folder here is a small stand-in written for the test in the benchmark's layout: ``mock_apis.py`` importing
``latency_injector.py`` from its folder, and an ``lk_agent_tool.py`` that is only ever read (it imports LiveKit).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from cspan.bench.errors import BenchDataError
from cspan.bench.fdb_v3_analysis import PROMPT_VERSION
from cspan.bench.fdb_v3_release import load_release, parse_agent

LATENCY_INJECTOR = """
PROFILES = {"instant": 0.0, "slow": 2.0}


def delay_for(profile):
    return PROFILES[profile]
"""

MOCK_APIS = """
from latency_injector import delay_for


class MockAPIRegistry:
    def __init__(self, latency_profile="slow"):
        self.delay = delay_for(latency_profile)
        self.calls = []

    def call(self, name, **kwargs):
        self.calls.append(name)
        if kwargs.get("order_id") == "0":
            raise KeyError("no order 0")
        if name == "track_order":
            return {"order_id": kwargs["order_id"], "status": "in transit", "call_number": len(self.calls)}
        return {"status": "ok", "tool": name, "args": sorted(kwargs)}
"""

AGENT = '''
from livekit.agents import Agent, llm

registry = None


class AssistantFnc:
    def log_tool_call(self, name):
        pass

    @llm.function_tool(description="Find where a parcel is right now.")
    async def track_order(self, order_id: str):
        """
        Args:
            order_id: The order number, e.g. 'A1'
        """
        return registry.call("track_order", order_id=order_id)

    @llm.function_tool(description="Put a product in the cart.")
    async def add_to_cart(self, product_id: str, quantity: int = 1):
        """
        Args:
            product_id: Product identifier
            quantity: How many to add
        """
        return registry.call("add_to_cart", product_id=product_id, quantity=quantity)

    @llm.function_tool(description="Search the catalogue.")
    async def search_products(self, query: str, max_price: float = None):
        return registry.call("search_products", query=query, max_price=max_price)


class VoiceAgent(Agent):
    def __init__(self) -> None:
        super().__init__(
            instructions=(
                "You are the test agent of the stand-in release. "
                "Call the tools   right away."
            ),
        )
'''


def write_release(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "latency_injector.py").write_text(LATENCY_INJECTOR)
    (root / "mock_apis.py").write_text(MOCK_APIS)
    (root / "lk_agent_tool.py").write_text(AGENT)
    (root / "benchmark_data_v2.json").write_text(json.dumps({"scenarios": []}))
    return root


def test_reads_the_agents_persona_and_tools(tmp_path: Path) -> None:
    release = load_release(write_release(tmp_path / "v3"))
    assert release.persona == "You are the test agent of the stand-in release. Call the tools right away."
    assert [t.name for t in release.tools] == ["track_order", "add_to_cart", "search_products"]
    track, cart, search = release.tools
    assert track.description == "Find where a parcel is right now."
    (order_id,) = track.params
    assert (order_id.name, order_id.annotation, order_id.required) == ("order_id", "str", True)
    assert order_id.description == "The order number, e.g. 'A1'"
    assert [(p.name, p.required, p.default) for p in cart.params] == [
        ("product_id", True, None),
        ("quantity", False, 1),
    ]
    assert search.params[1].annotation == "float" and not search.params[1].required
    assert release.scenarios_path == tmp_path / "v3" / "benchmark_data_v2.json" and release.data_dir is None
    world = release.describe()
    assert world["kind"] == "fdb-v3-release" and set(world["sha256"]) == {
        "mock_apis.py",
        "lk_agent_tool.py",
        "benchmark_data_v2.json",
    }


def test_tool_bank_calls_the_release_mock_apis(tmp_path: Path) -> None:
    release = load_release(write_release(tmp_path / "v3"))

    async def run() -> None:
        bank = await release.tool_bank()
        try:
            assert bank.names() == ["track_order", "add_to_cart", "search_products"]
            schema = {t["function"]["name"]: t["function"] for t in bank.openai_tools()}
            assert schema["track_order"]["description"] == "Find where a parcel is right now."
            assert schema["add_to_cart"]["parameters"]["required"] == ["product_id"]
            first = await bank.call("track_order", {"order_id": 55123})  # coerced to the declared str
            assert first.text == "order id 55123, status in transit, call number 1"
            second = await bank.call("add_to_cart", {"product_id": "P-1"})  # the release's default quantity
            assert second.data == {"status": "ok", "tool": "add_to_cart", "args": ["product_id", "quantity"]}
            # kinds from this project's catalogue: add_to_cart changes state
            assert bank.get("add_to_cart").kind == "action" and bank.get("track_order").kind == "read"
        finally:
            await bank.aclose()
        fresh = await release.tool_bank()  # a new registry: the call count starts again
        assert (await fresh.call("track_order", {"order_id": "A1"})).text.endswith("call number 1")
        await fresh.aclose()

    asyncio.run(run())


def test_bad_release_folders(tmp_path: Path) -> None:
    with pytest.raises(BenchDataError, match="is not a folder"):
        load_release(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BenchDataError, match=r"lacks mock_apis\.py, lk_agent_tool\.py"):
        load_release(tmp_path / "empty")
    with pytest.raises(BenchDataError, match="no instructions"):
        parse_agent("class A:\n    pass\n")
    broken = write_release(tmp_path / "broken")
    (broken / "mock_apis.py").write_text("raise RuntimeError('boom')\n")
    release = load_release(broken)
    with pytest.raises(BenchDataError, match="failed to import: RuntimeError: boom"):
        release.registry()


def test_each_release_imports_its_own_sibling_modules(tmp_path: Path) -> None:
    one = load_release(write_release(tmp_path / "one"))
    other = write_release(tmp_path / "other")
    (other / "latency_injector.py").write_text(LATENCY_INJECTOR.replace('"instant": 0.0', '"instant": 0.5'))
    assert one.registry().delay == 0.0
    assert load_release(other).registry().delay == 0.5
    assert one.registry().delay == 0.0
    import sys

    assert "latency_injector" not in sys.modules


@pytest.mark.slow
def test_run_against_the_release_world(
    tiny_checkpoint_dir, fixture_file, fake_chat_server, tool_call_message, tmp_path, cli, capsys
) -> None:
    import shutil

    release = write_release(tmp_path / "v3")
    folder = release / "fdb_v3_data_released" / "ecom_001_5f0c2a9e1b3d4c6a8e7f9012"
    folder.mkdir(parents=True)
    shutil.copyfile(fixture_file("audio", "question_exchange_24k.wav"), folder / "input.wav")
    scenario = {
        "id": "ecom_001",
        "domain": "ecommerce_support",
        "difficulty": "easy",
        "dialogue": [{"user": "Where is my order 55123?", "ai": "It is in transit."}],
        "expected_tool_calls": [{"function": "track_order", "args": {"order_id": "55123"}}],
    }
    (release / "benchmark_data_v2.json").write_text(json.dumps({"scenarios": [scenario]}))
    # the router's call and its empty answer after the tool's result, then the judge's verdicts (a judge that never
    # answers in its format makes the command exit 1)
    verdict = {"role": "assistant", "content": '{"correct": true, "explanation": "as expected"}'}
    server = fake_chat_server(
        [tool_call_message("track_order", {"order_id": "55123"}), {"role": "assistant", "content": ""}, verdict]
    )
    out = tmp_path / "out"
    rc = cli(
        "bench", "fdb-v3", "run", "--checkpoint", str(tiny_checkpoint_dir), "--fdb-v3-dir", str(release),
        "--out", str(out), "--router", server.url, "--router-model", "fake-router",
        "--force-ret", "input-end", "--tail-s", "1", "--quiet",
        "--judge-url", server.url, "--judge-attempts", "1", "--judge-key-env", "CSPAN_TEST_NO_SUCH_KEY",
    )  # fmt: skip
    assert rc == 0
    assert "fdb-v3: 1 scenario recording(s), rendered 1" in capsys.readouterr().out
    # the router was offered the release's tools, with the release's descriptions
    offered = {t["function"]["name"]: t["function"]["description"] for t in server.requests[0]["tools"]}
    assert offered == {
        "track_order": "Find where a parcel is right now.",
        "add_to_cart": "Put a product in the cart.",
        "search_products": "Search the catalogue.",
    }
    raw = json.loads((out / folder.name / "result_cspan.json").read_text())
    assert raw["world"]["kind"] == "fdb-v3-release" and raw["world"]["dir"] == str(release.resolve())
    assert raw["settings"]["prompt"] == "You are the test agent of the stand-in release. Call the tools right away."
    span = next(e for e in raw["retrieval_events"] if e["type"] == "span")
    assert span["text"] == "(tool result) order id 55123, status in transit, call number 1"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["world"]["kind"] == "fdb-v3-release" and summary["metrics"]["pass_rate"] == 1.0
    # the run analysed the response with the judge: the tiny model said no word the ASR heard, so there was
    # nothing to send (counted as silent, not as analysed), and nothing is guessed
    analysis = json.loads((out / folder.name / "latency_tool_analysis_cspan.json").read_text())
    assert analysis["judge"]["prompt_version"] == PROMPT_VERSION and analysis["judge"]["model"] == "gpt-4o"
    assert analysis["user_speech_end_rel"] == raw["user_speech_end_rel"]
    assert analysis["filler_sentence"] is None and analysis["task_completion_latency_s"] is None
    assert analysis["turn_take_success"] is False and analysis["notes"] == ["no agent words: nothing to analyse"]
    counts = summary["config"]["analysis"]
    assert (counts["analysed"], counts["silent"], counts["unfinished"]) == (0, 1, 0)
    assert raw["recording_metadata"] is None  # the recording has no metadata.json


@pytest.mark.parametrize(
    ("arguments", "recorded"),
    [
        ({"order_id": 0}, {"order_id": "0"}),  # the mock API raises: the validated arguments are what ran
        ({"order_id": "0", "colour": "red"}, {"order_id": "0"}),  # unknown keys are not part of the call
        ({"colour": "red"}, {}),  # order_id missing: the arguments never validated, nothing ran
    ],
)
def test_a_failed_tool_call_keeps_its_arguments(
    tmp_path: Path, fake_chat_server, tool_call_message, arguments: dict, recorded: dict
) -> None:
    from cspan.backends.router import LLMRouter
    from cspan.backends.router.base import RouteRequest
    from cspan.bench.session import RecordingRouter

    release = load_release(write_release(tmp_path / "v3"))
    server = fake_chat_server([tool_call_message("track_order", arguments)])

    async def run() -> tuple[object, list[dict]]:
        bank = await release.tool_bank()
        recorder = RecordingRouter(LLMRouter(server.url, "fake-router", bank), lambda: 1.5)
        try:
            return await recorder.route(RouteRequest(question="where is my order number zero")), recorder.calls
        finally:
            await recorder.aclose()
            await bank.aclose()

    result, calls = asyncio.run(run())
    assert result.tool == "track_order" and result.error and result.arguments == recorded  # type: ignore[attr-defined]
    # what the v3 result records: the attempted call with its arguments, scored for argument accuracy
    assert calls == [{"function": "track_order", "args": recorded, "timestamp_start": 1.5, "error": result.error}]  # type: ignore[attr-defined]
