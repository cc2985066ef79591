"""inspect_ai's default OpenAI provider (`openai/<model>`, which talks to OpenAI's Responses API) against a real
`runner serve`, configured as its users configure it for an OpenAI-compatible server: OPENAI_BASE_URL and
OPENAI_API_KEY in the environment (issue 40: it used to fail with `404 no route POST /v1/responses`). A 2-sample
local task: the sample whose target is the model's own greedy reply scores 1, the other 0.
(tests/test_openai_api.py runs inspect's `openai-api/<service>/` provider, which uses chat completions.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.test_serve import runner_serve

pytestmark = pytest.mark.extras("inspect")

QUESTION = "Name a fruit."


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """`runner serve`, its model loaded."""
    import httpx

    tmp = tmp_path_factory.mktemp("clients-inspect")
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    try:
        with runner_serve(tmp / "storage", "--device", "cpu") as (url, _):
            httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                       timeout=120).raise_for_status()  # the first request loads the model
            yield {"url": url, "tmp": tmp, "log": tmp / "storage.log"}
    finally:
        mp.undo()


@pytest.mark.parametrize("model_args", [
    # inspect's openai/ provider sends `store: false, include: ['reasoning.encrypted_content']` with every request for
    # a model it does not know (inspect_ai 0.3.285, providers/openai_responses.py): taken, there is nothing to include.
    pytest.param({}, id="defaults"),
    # Told that responses are stored, inspect sends neither `store` nor `include`: the rest of its Responses path.
    pytest.param({"responses_store": True}, id="responses_store"),
])
def test_inspect_default_openai_provider(served, monkeypatch, model_args):
    import inspect_ai
    import openai
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import exact

    url = served["url"]
    monkeypatch.setenv("OPENAI_BASE_URL", f"{url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    greedy = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=8).output_text
    assert greedy and greedy != "zzz"
    task = inspect_ai.Task(dataset=[Sample(input=QUESTION, target=greedy, id="greedy"),
                                    Sample(input=QUESTION, target="zzz", id="other")], scorer=exact())
    log = inspect_ai.eval(task, model="openai/tiny", temperature=0, max_tokens=8, log_dir=str(served["tmp"] / "logs"),
                          display="none", model_args=model_args)[0]
    assert log.status == "success", log.error
    assert log.results is not None and log.results.scores[0].metrics["mean"].value == 0.5
    scores = {s.id: s.scores["exact"].value for s in log.samples or [] if s.scores}
    assert scores == {"greedy": "C", "other": "I"}
    assert [s.output.completion for s in log.samples or []] == [greedy, greedy]
    # inspect's default provider went through the Responses API (its log keeps each model call's request): one call
    # per sample, with a Responses body (`input`, `max_output_tokens`), not a chat one (`messages`).
    calls = [e.call.request for s in log.samples or [] for e in s.events if e.event == "model" and e.call]
    assert len(calls) == 2 and all("input" in c and c["max_output_tokens"] == 8 and "messages" not in c for c in calls)
