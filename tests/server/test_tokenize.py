"""vLLM's `/tokenize` and `/detokenize` on the real engine (`tiny`): the ids are those the generation
endpoints compute for the same prompt or messages (checked against `return_token_ids` of an actual
request), the generation prompt is a suffix that `add_generation_prompt` leaves off, ids round-trip
through `/detokenize`, and bad input is a 400 in OpenAI's error shape."""

import httpx
import openai
import pytest

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tokenize <｜User｜> me"},
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": "Again"},
]


def _post(srv, path, body):
    return httpx.post(srv.base_url + path, json=body, timeout=60)


def test_tokenize_prompt_matches_the_completion_and_round_trips(served):
    srv, engine, _ = served
    prompt = "héllo wörld <｜User｜> x"
    r = _post(srv, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.max_model_len
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    done = client.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
    )
    assert body["tokens"] == done.model_extra["prompt_token_ids"] and body["count"] == done.usage.prompt_tokens
    assert body["tokens"][0] == engine.tokenizer.bos_id
    assert body["token_strs"] == [engine.tokenizer.id_to_token(t) for t in body["tokens"]]
    plain = _post(srv, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == body["tokens"][1:] and plain["token_strs"] is None
    back = _post(srv, "/detokenize", {"tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}


def test_tokenize_messages_matches_the_chat_completion(served):
    srv, engine, _ = served
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    done = client.chat.completions.create(
        model=engine.model_name, messages=MESSAGES, max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
    )
    with_prompt = _post(srv, "/tokenize", {"messages": MESSAGES}).json()
    assert with_prompt["tokens"] == done.model_extra["prompt_token_ids"]
    without = _post(srv, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    n = without["count"]
    assert 0 < n < with_prompt["count"] and with_prompt["tokens"][:n] == without["tokens"]
    # the message text stays text: the marker typed by the user is not the control token
    user_marker = engine.tokenizer.token_to_id("<｜User｜>")
    assert with_prompt["tokens"].count(user_marker) == 2
    thinking = _post(srv, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"thinking": True}}).json()
    assert thinking["tokens"] != with_prompt["tokens"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"messages": MESSAGES, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/detokenize", {"tokens": [5, 1024]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_tokenizer_endpoint_errors(served, path, body, param):
    r = _post(served[0], path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert r.status_code == (404 if param == "model" else 400)
