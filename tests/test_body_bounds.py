"""Issue 33 item 1: a numeric sampling option's bounds are declared once, on its SamplingParams
field, and the two APIs' checks, the OpenAPI schema and SamplingParams' own check all follow
them. Each case below is derived from the declared bounds, so a route that checks other bounds
than its field declares, or a schema that says other bounds, fails here."""

import jsonschema
import pytest

from tokstream.body_bounds import APIS, Bound, body_bounds, widest
from tokstream.errors import UserInputError
from tokstream.sampling_params import SamplingParams
from tokstream.server.api_errors import ApiError
from tokstream.server.operations.openapi import CHAT_BODY, COMPLETION_BODY, MESSAGES_BODY
from tokstream.server.api.sampling_options import bounded_options

BODY_SCHEMAS = {"openai": (CHAT_BODY, COMPLETION_BODY), "anthropic": (MESSAGES_BODY,)}


def cases(api: str):
    for name, (bound, _) in body_bounds(SamplingParams, api).items():
        yield pytest.param(api, name, bound, id=f"{api}-{name}")


ALL = [case for api in APIS for case in cases(api)]


def outside(bound: Bound) -> list:
    """Values just past each end of bound."""
    step = 1 if bound.integer else 1e-6
    values = [bound.minimum if bound.exclusive_minimum else bound.minimum - step]
    if bound.maximum is not None:
        values.append(bound.maximum + step)
    return values


def inside(bound: Bound) -> list:
    step = 1 if bound.integer else 1e-6
    values = [bound.minimum + step if bound.exclusive_minimum else bound.minimum]
    if bound.maximum is not None:
        values.append(bound.maximum)
    return values


def test_both_apis_read_the_shared_options():
    assert {"temperature", "top_p", "top_k", "seed"} <= set(body_bounds(SamplingParams,
                                                                        "anthropic"))
    assert {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"} <= set(
        body_bounds(SamplingParams, "openai"))


@pytest.mark.parametrize("api,name,bound", ALL)
def test_a_route_refuses_just_outside_and_takes_just_inside(api, name, bound):
    for value in outside(bound):
        with pytest.raises(ApiError) as error:
            bounded_options({name: value}, api)
        assert error.value.param == name and error.value.status == 400
    for value in inside(bound):
        assert bounded_options({name: value}, api)[name] == value


@pytest.mark.parametrize("api,name,bound", ALL)
def test_the_schema_refuses_and_takes_what_the_route_does(api, name, bound):
    for body in BODY_SCHEMAS[api]:
        validator = jsonschema.Draft202012Validator(body["properties"][name])
        assert not any(validator.is_valid(value) for value in outside(bound)), body
        assert all(validator.is_valid(value) for value in inside(bound)), body


@pytest.mark.parametrize("api,name,bound", ALL)
def test_an_absent_option_takes_its_field_default(api, name, bound):
    default = next(f.default for f in SamplingParams.__dataclass_fields__.values()
                   if f.name == name)
    assert bounded_options({}, api)[name] == default


@pytest.mark.parametrize("name", sorted({n for api in APIS
                                         for n in body_bounds(SamplingParams, api)}))
def test_sampling_params_takes_what_some_api_takes_and_nothing_else(name):
    bounds = SamplingParams.__dataclass_fields__[name].metadata["body"]
    wide = widest(bounds)
    for value in inside(wide):
        assert getattr(SamplingParams(**{name: value}), name) == value
    for value in outside(wide):
        with pytest.raises(UserInputError, match=name):
            SamplingParams(**{name: value})


def test_the_apis_differ_where_they_should():
    openai = body_bounds(SamplingParams, "openai")
    anthropic = body_bounds(SamplingParams, "anthropic")
    assert openai["temperature"][0].maximum == 2 and anthropic["temperature"][0].maximum == 1
    assert openai["top_k"][0].minimum == -1 and anthropic["top_k"][0].minimum == 0
    assert "repetition_penalty" not in anthropic


def test_nan_and_non_numbers_are_refused():
    with pytest.raises(UserInputError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(UserInputError, match="top_k must be an integer"):
        SamplingParams(top_k=1.5)
    with pytest.raises(ApiError):
        bounded_options({"temperature": "hot"}, "openai")
