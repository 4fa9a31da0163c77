"""Admission control (429 + Retry-After), and the real SmolLM2 through the whole stack."""

import asyncio

import aiohttp
import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import post


def test_admission_control_refuses_past_the_limit(ray_cluster, tiny_llama_dir):
    controller, url = start_service(tiny_llama_dir, **{"router.max_inflight_requests": 2})
    try:
        async def run():
            async with aiohttp.ClientSession() as session:
                body = {"model": "tiny", "prompt": list(range(3, 100)), "max_tokens": 400, "ignore_eos": True,
                        "stream": True}
                first = await session.post(url + "/v1/completions", json=body)
                second = await session.post(url + "/v1/completions", json=body)
                await first.content.readline()
                await second.content.readline()
                third = await session.post(url + "/v1/completions", json=body)
                result = (third.status, third.headers.get("Retry-After"), await third.json())
                first.close()
                second.close()
                return result

        status, retry_after, body = asyncio.run(run())
        assert status == 429 and retry_after == "1"
        assert "2 requests in flight (limit 2)" in body["error"]["message"]
    finally:
        stop_service(controller)


@pytest.mark.slow
def test_real_smollm2_chat_through_the_stack_matches_offline(ray_cluster, smollm2_dir):
    controller, url = start_service(smollm2_dir, served_model_name="smollm2")
    try:
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        offline = LLM(str(smollm2_dir)).chat(messages, SamplingParams(max_tokens=24, temperature=0))[0]
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="unused")
        out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                             extra_body={"return_token_ids": True})
        choice = out.choices[0]
        assert choice.model_extra["token_ids"] == offline.token_ids
        assert choice.message.content == offline.text
        assert "Paris" in choice.message.content
        status, body, _ = post(url + "/v1/completions", {"model": "smollm2", "prompt": "The capital of France is",
                                                         "max_tokens": 4, "temperature": 0})
        assert status == 200 and "Paris" in body["choices"][0]["text"]
    finally:
        stop_service(controller)
