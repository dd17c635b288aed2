"""/v1/completions `echo` and `prompt_logprobs` in vLLM's shapes, against a real server on
dummy:tiny: the prompt echoed before the output, `logprobs` covering the prompt then the output
(the first token's entries null), `max_tokens: 0` with echo answering the prompt alone,
`prompt_logprobs` as {token_id: {logprob, rank, decoded_token}} per prompt token, streamed and
not, and the 400s vLLM gives (max_tokens 0 without echo, prompt_logprobs streamed)."""

import json

import httpx
import pytest

from helpers.serving import module_server

pytestmark = pytest.mark.startup

server = module_server("--profile", "ci")

PROMPT = "the quick brown fox jumps over"


def complete(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"model": "dummy:tiny", "temperature": 0, **body})


def choice(server, **body) -> tuple[dict, dict]:
    response = complete(server, **body)
    assert response.status_code == 200, response.text
    reply = response.json()
    return reply["choices"][0], reply["usage"]


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server):
    got, usage = choice(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    assert got["text"] == PROMPT
    lp, n = got["logprobs"], usage["prompt_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == PROMPT
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                 lp["top_logprobs"][1:]):
        assert value <= 0 and top[token] == value and len(top) in (2, 3)  # itself + top 2
    # vLLM's prompt_logprobs beside it: the same values, with ranks
    prompt = got["prompt_logprobs"]
    assert len(prompt) == n and prompt[0] is None
    for value, entry in zip(lp["token_logprobs"][1:], prompt[1:]):
        own = [e for e in entry.values() if e["logprob"] == value]
        assert own and all(set(e) == {"logprob", "rank", "decoded_token"} for e in entry.values())
        assert sorted(e["rank"] for e in entry.values())[0] >= 1


def test_echo_with_output_shows_prompt_then_output(server):
    plain, _ = choice(server, prompt=PROMPT, logprobs=1, max_tokens=4)
    echoed, usage = choice(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4)
    n = usage["prompt_tokens"]
    assert echoed["text"] == PROMPT + plain["text"]
    lp = echoed["logprobs"]
    assert len(lp["tokens"]) == n + 4
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"],
                                                     abs=1e-4)
    assert lp["text_offset"][n] == len("".join(lp["tokens"][:n]))
    # echo alone: the text, no logprobs; prompt_logprobs alone: no echo
    bare, _ = choice(server, prompt=PROMPT, echo=True, max_tokens=4)
    assert bare["text"] == echoed["text"] and bare["logprobs"] is None
    assert "prompt_logprobs" not in bare
    scored, _ = choice(server, prompt=PROMPT, prompt_logprobs=0, max_tokens=4)
    assert scored["text"] == plain["text"] and len(scored["prompt_logprobs"]) == n


def test_lm_evals_token_id_batch_of_one(server):
    """local-completions sends the prompt as [[token ids]] with echo, logprobs 1, max_tokens 1."""
    ids = [int(t) for t in httpx.post(server.url + "/tokenize", json={"prompt": PROMPT},
                                      timeout=30).json()["tokens"]]
    got, usage = choice(server, prompt=[ids], echo=True, logprobs=1, max_tokens=1, seed=1234)
    lp = got["logprobs"]
    assert usage["prompt_tokens"] == len(ids) and len(lp["token_logprobs"]) == len(ids) + 1
    assert got["text"].startswith(PROMPT)
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])


def stream_choice(server, **body) -> tuple[str, dict]:
    text, lists = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "dummy:tiny", "temperature": 0, "stream": True,
                            **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text += c["text"]
                for key, values in (c["logprobs"] or {}).items():
                    lists[key] += values
    return text, lists


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_equals_the_whole_answer(server, max_tokens):
    whole, _ = choice(server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens)
    text, lists = stream_choice(server, prompt=PROMPT, echo=True, logprobs=2,
                                max_tokens=max_tokens)
    assert text == whole["text"]
    assert lists["tokens"] == whole["logprobs"]["tokens"]
    assert lists["text_offset"] == whole["logprobs"]["text_offset"]
    assert lists["token_logprobs"][0] is None
    assert lists["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:],
                                                        abs=1e-4)


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_values_are_400s_naming_the_field(server, body, field):
    response = complete(server, prompt=PROMPT, **{"max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_chat_still_refuses_echo(server):
    response = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "dummy:tiny", "max_tokens": 2, "echo": True,
        "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo"


def test_every_choice_echoes_and_scores_the_prompt(server):
    """n choices share one prompt group: each is scored in a prefill of its own (a cached
    prefix would leave positions unscored), the lists equal."""
    response = complete(server, prompt=PROMPT + " again", echo=True, logprobs=1, max_tokens=0,
                        n=3)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    first = choices[0]["logprobs"]
    assert all(c["text"] == PROMPT + " again" for c in choices)
    for c in choices[1:]:
        assert c["logprobs"]["tokens"] == first["tokens"]
        assert c["logprobs"]["token_logprobs"][0] is None
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(first["token_logprobs"][1:],
                                                                    abs=1e-4)


def test_the_openapi_schema_takes_lm_evals_body(server):
    """/openapi.json's completions body accepts what local-completions sends."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    lm_eval_body = {"model": "m", "prompt": [[1, 2, 3]], "temperature": 0, "max_tokens": 0,
                    "logprobs": 1, "seed": 1234, "echo": True, "prompt_logprobs": 1}
    jsonschema.validate(lm_eval_body, body)
    assert set(body["properties"]) >= {"echo", "prompt_logprobs"}
