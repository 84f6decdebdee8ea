"""One table of calls: `TrainingAPI`'s signatures, the request models, the routes and both clients agree."""

import inspect

from arctic_rl_core.api import TrainingAPI
from arctic_rl_core.calls import CALLS
from arctic_rl_core.client import ArcticRLClient, AsyncArcticRLClient
from arctic_rl_core.futures import ApiFutures


def test_every_api_call_is_in_the_table_and_takes_its_request_fields():
    assert set(TrainingAPI.__abstractmethods__) == set(CALLS)
    for call in CALLS.values():
        if call.attribute:
            assert isinstance(inspect.getattr_static(TrainingAPI, call.name), property)
            assert call.request.model_fields == {}
            continue
        params = list(inspect.signature(getattr(TrainingAPI, call.name)).parameters)[1:]
        assert params == list(call.request.model_fields), call.name


def test_both_clients_and_the_futures_derive_every_call():
    assert not inspect.isabstract(ArcticRLClient)
    futures = ApiFutures(ArcticRLClient("http://127.0.0.1:9", retries=0))
    for call in CALLS.values():
        sync = inspect.getattr_static(ArcticRLClient, call.name)
        asynchronous = getattr(AsyncArcticRLClient, call.name)
        assert inspect.iscoroutinefunction(asynchronous)
        if call.attribute:
            assert isinstance(sync, property)
        else:
            assert inspect.signature(sync) == inspect.signature(getattr(TrainingAPI, call.name))
            assert sync.__doc__ == getattr(TrainingAPI, call.name).__doc__
            assert callable(getattr(futures, call.name))


def test_a_bad_argument_is_refused_before_anything_is_sent():
    """The client validates against the request model first: the URL below is never contacted."""
    import pytest

    from arctic_rl_core.errors import InvalidRequest

    client = ArcticRLClient("http://127.0.0.1:9", retries=0)
    with pytest.raises(InvalidRequest, match="learning_rate"):
        client.step(learning_rate=-1.0)
    with pytest.raises(TypeError):
        client.step(1e-3, 2)


def test_refusals_survive_pickling_with_their_field():
    """A trainer rank's refusal reaches the driver through Ray (pickle) as the same error, naming its field."""
    import pickle

    from arctic_rl_core.errors import InvalidRequest, UnknownName
    from arctic_rl_core.wire import WireError

    for error in (InvalidRequest("loss", "is inf"), UnknownName("loss.name", "unknown loss 'x'"), WireError("short")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and (copy.field, copy.message, str(copy)) == (error.field, error.message, str(error))
