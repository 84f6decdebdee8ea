"""A multi-turn, tool-calling episode sampled through `/v1/chat/completions`, captured by session, and
trained as a prefix tree: the trained tokens are the sampled ones, the trainer's log-probs are the
sampler's, and ZoRRo's tree gives the loss and update of training each turn on its own, on fewer tokens."""

import json

import openai
import pytest
import torch

from arctic_rl_core.backend import InProcessBackend
from arctic_rl_core.client import ArcticRLClient
from arctic_rl_core.config import BackendConfig
from arctic_rl_core.engines.distributed import free_loopback_port
from arctic_rl_core.server.app import ServerSettings
from arctic_rl_core.server.run import ServerThread
from arctic_rl_core.trajectories import TrajectoryStore, UnknownSession
from arctic_rl_core.types import Completion
from tests.conftest import LIGHT_SAMPLER
from tests.test_backend import SGD, update, weights

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


class CalculatorEnv:
    """A toy tool environment. A random model cannot write a well-formed call, so the harness makes one
    call per assistant turn (as a parser would from a real model's reply) and answers it with the result."""

    def __init__(self, question: str):
        self.messages = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": question}]
        self.calls = 0

    def observe(self, reply: str) -> None:
        self.calls += 1
        a, b = self.calls, self.calls + 1
        call = {"id": f"call_{self.calls}", "type": "function",
                "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
        self.messages.append({"role": "assistant", "content": reply, "tool_calls": [call]})
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(a + b)})


def test_a_tool_episode_trains_on_exactly_its_sampled_tokens_as_a_prefix_tree(tmp_path):
    from arctic_rl_core.models.tiny import make_tiny_model

    tiny_model = make_tiny_model("qwen3", str(tmp_path / "qwen3"), max_positions=1024)  # room for four turns
    config = BackendConfig.model_validate({"model_path": tiny_model, "sampler": LIGHT_SAMPLER, "zorro": {"enable": True},
                                           "engine": {"ds_config": SGD}})
    server = ServerThread(ServerSettings(port=free_loopback_port()), config)
    with server as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        env = CalculatorEnv("What is 1 + 2, then 2 + 3, then 3 + 4? Use the add tool.")
        sampled = []
        for turn in range(4):
            out = sdk.chat.completions.create(model=tiny_model, messages=env.messages, tools=TOOLS, max_tokens=12,
                                              temperature=1.0, seed=turn, logprobs=True,
                                              extra_body={"return_token_ids": True, "session_id": "episode-1"})
            sampled.append((out.prompt_token_ids, out.choices[0].token_ids,
                            [e.logprob for e in out.choices[0].logprobs.content]))
            env.observe(out.choices[0].message.content)
        sdk.chat.completions.create(model=tiny_model, messages=env.messages, max_tokens=4,
                                    extra_body={"session_id": "another-episode"})

        client = ArcticRLClient(url, retries=0)
        episode = client.episode("episode-1")
        # Exactly what the sampler saw and produced, turn by turn: nothing re-tokenised.
        assert [(t.prompt_ids, t.token_ids, t.logprobs) for t in episode.turns] == sampled
        assert all(t.weight_version == 0 for t in episode.turns)
        seqs = episode.sequences(advantages=[1.0, -0.5, 0.25, 1.0])
        assert [(s.prompt_ids, s.response_ids) for s in seqs] == [(p, r) for p, r, _ in sampled]

        trainer = client.log_probs(seqs).logprobs
        gap = max(abs(a - b) for t, lp in zip(episode.turns, trainer) for a, b in zip(t.logprobs, lp))
        assert gap < 1e-3, gap

        server_backend = server.app.state.job.api
        start = weights(server_backend)
        tree = client.fwd_bwd(seqs, "grpo")
        client.step()
        tree_update = update(server_backend, start)

        separate = InProcessBackend(config.model_copy(update={"zorro": config.zorro.model_copy(update={"enable": False})}))
        assert all(torch.equal(w, start[n]) for n, w in weights(separate).items())
        flat = separate.fwd_bwd(seqs, "grpo")
        separate.step()
        flat_update = update(separate, start)

        assert tree.loss == pytest.approx(flat.loss, rel=1e-5, abs=1e-8)
        assert (tree_update - flat_update).norm() <= 1e-5 * flat_update.norm()
        full = sum(len(p) + len(r) for p, r, _ in sampled)
        print(f"\n{len(seqs)} turns, {full} tokens in full: the prefix tree computed {tree.computed_tokens}, "
              f"each turn on its own {flat.computed_tokens} (padding included)")
        assert tree.computed_tokens < full <= flat.computed_tokens

        # Released, the episode is gone; the other session is untouched.
        assert len(client.episode("episode-1", release=True).turns) == 4
        with pytest.raises(Exception, match="episode-1"):
            client.episode("episode-1")
        assert len(client.episode("another-episode").turns) == 1


def _completion(tokens, version=0):
    return Completion(prompt_index=0, token_ids=tokens, logprobs=[-1.0] * len(tokens), finish_reason="length",
                      weight_version=version)


def test_capture_evicts_the_least_recently_used_episodes_past_its_budget():
    store = TrajectoryStore(max_tokens=20)
    store.record("a", [[1, 2, 3]], [_completion([4, 5])])
    store.record("b", [[1, 2, 3]], [_completion([6, 7])])
    store.record("a", [[1, 2, 3, 4, 5]], [_completion([8])])  # a is now the most recently used
    store.record("c", [[9, 9, 9]], [_completion([1, 1])])
    assert store.describe() == {"episodes": 2, "tokens": 16, "recorded_turns": 4, "evicted": 1}
    assert len(store.episode("a").turns) == 2
    with pytest.raises(UnknownSession, match="'b'"):
        store.episode("b")


def test_a_turns_routing_record_counts_toward_the_capture_budget():
    from arctic_rl_core.types import RoutedExperts

    store = TrajectoryStore(max_tokens=60)
    routed = _completion([4, 5]).model_copy(update={"routed_experts": RoutedExperts(ids=[0, 1] * 8, layers=2, top_k=2)})
    store.record("a", [[1, 2, 3]], [routed])  # 5 tokens + 16 expert ids
    assert store.describe()["tokens"] == 21
    store.record("b", [[1, 2, 3]], [routed])
    store.record("c", [[1, 2, 3]], [routed])  # past 60: the oldest episode goes
    assert store.describe()["episodes"] == 2 and store.describe()["evicted"] == 1
