"""A prefix being computed is computed once: a waiting request whose next uncached block a
running request is still prefilling waits for the cache to have it, instead of computing the
same blocks beside it (measured: the shared-prefix mix's first 2,000-token system prompt was
prefilled by every request that arrived while it was). Pure Python, no model."""

from test_scheduler import make_request, make_scheduler, run_step


def test_a_burst_behind_one_new_prefix_computes_it_once():
    s = make_scheduler(num_blocks=512, block_size=4, budget=64)
    shared = list(range(7000, 7200))  # 50 blocks, four 64-token steps to compute
    s.add_request(make_request("a", prompt=shared + [1, 2, 3], max_tokens=2))
    s.add_request(make_request("b", prompt=shared + [4, 5, 6], max_tokens=2))
    computed_by_b = 0
    for _ in range(12):
        out = run_step(s)
        computed_by_b += sum(w.num_tokens for w in out.work if w.request.request_id == "b")
        if "b" in s.requests and s.requests["b"].output_token_ids:
            break
    # b waited while a computed the 200 shared tokens, then took them from the cache and
    # computed its own 3 (and sampled its first token there).
    assert s.requests["b"].output_token_ids == [7]
    assert computed_by_b == 3


def test_a_different_prefix_does_not_wait():
    s = make_scheduler(num_blocks=512, block_size=4, budget=256)
    s.add_request(make_request("a", prompt=list(range(7000, 7200)), max_tokens=2))
    s.add_request(make_request("b", prompt=list(range(8000, 8010)), max_tokens=2))
    out = run_step(s)
    assert any(w.request.request_id == "b" for w in out.work)


def test_a_request_scoring_its_prompt_is_not_held():
    # It takes no cache hits (its prompt's logprobs come from its own prefill): holding it
    # would gain nothing.
    s = make_scheduler(num_blocks=512, block_size=4, budget=256)
    shared = list(range(7000, 7200))
    s.add_request(make_request("a", prompt=shared + [1], max_tokens=2))
    s.add_request(make_request("b", prompt=shared + [2], max_tokens=2, prompt_logprobs=0))
    out = run_step(s)  # a's 201 tokens, and b beside it: not held for a's blocks
    assert any(w.request.request_id == "b" for w in out.work)
