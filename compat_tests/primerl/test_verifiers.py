"""PrimeRL's rollout side against Arctic RL: verifiers 0.4.0 environments sampled through its TrainClient
(what PrimeRL's orchestrator trains from: PrimeRL's renderer turns messages into token ids and posts them
to vLLM's `/inference/v1/generate`), captured by our server under the rollout's session, and trained on.

The environment is a taskset of sums and a harness that runs a tool-calling chat loop in-process with one
tool, `add` (arctic_calc_taskset, arctic_calc_harness), in verifiers' subprocess runtime: no sandbox, no uv,
no network. The tiny model first learns the tool through the training API (the `tool_model` fixture).
"""

from __future__ import annotations

import asyncio
import math

import pytest

from arctic_calc_harness import ADD_TOOL
from arctic_calc_taskset import QUESTIONS
from conftest import SERVED_MODEL

SEED = 7
"""Sampling stays at PrimeRL's temperature 1.0; the seed makes each run's rollouts the same."""
MAX_TOKENS = 48
"""Room for the tool call (41 tokens with the tiny tokenizer) and the answer."""


def train_client(url: str, model_dir: str):
    import verifiers.v1 as vf
    from renderers import Qwen3RendererConfig

    # PrimeRL's orchestrator configures it so: the model's renderer, pinned to the base model's tokenizer.
    return vf.TrainClientConfig(base_url=f"{url}/v1", api_key_var="ARCTIC_RL_COMPAT_NO_KEY",
                                renderer=Qwen3RendererConfig(enable_thinking=False), renderer_model_name=model_dir)


def run_env(client_config, use_tools: bool = True) -> list:
    """Every task of the taskset once, concurrently, on verifiers' Env path (the taskset's environment,
    `run_slot` per rollout, as an env server runs them); the traces in task order."""
    import verifiers.v1 as vf

    async def main():
        env = vf.load_environment(vf.resolve_env_config({
            "taskset": {"id": "arctic_calc_taskset"},
            "agent": {"harness": {"id": "arctic_calc_harness", "use_tools": use_tools}, "runtime": {"type": "subprocess"}}}))
        ctx = vf.ModelContext(model=SERVED_MODEL, client=client_config,
                              sampling=vf.Sampling(temperature=1.0, max_tokens=MAX_TOKENS, seed=SEED))
        async with env.serving():
            episodes = await asyncio.gather(*(env.run_slot(slot, ctx) for task in env.taskset for slot in env.slots(task)))
        return [episode.traces[0] for episode in episodes]
    return asyncio.run(main())


def sampled_spans(mask: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs of sampled positions: one per model turn."""
    spans, start = [], None
    for i, sampled in enumerate(list(mask) + [False]):
        if sampled and start is None:
            start = i
        elif not sampled and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.fixture(scope="module")
def rollout(server, tiny_model, tool_model):
    return run_env(train_client(server, tiny_model))


def test_a_tool_rollout_is_captured_under_its_trace_id_token_for_token(rollout, client, renderer, tool_model):
    assert len(rollout) == len(QUESTIONS)
    for trace in rollout:
        question = trace.task.data.prompt
        assert trace.ok, [e.message for e in trace.errors]
        # Multi-turn with the tool: the model called `add`, the harness answered, the model answered.
        assert trace.num_turns == 2, trace.messages
        roles = [m.role for m in trace.messages]
        assert roles == ["system", "user", "assistant", "tool", "assistant"], roles
        call = trace.messages[2].tool_calls[0]
        assert call.name == "add" and trace.messages[3].content == QUESTIONS[question]
        assert trace.reward == 1.0, trace.last_reply
        assert [c.finish_reason for c in trace.calls] == ["tool_calls", "stop"]

        [branch] = trace.branches
        assert branch.trainable
        tokens, mask, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs

        # verifiers sends X-Session-ID: <trace id> on every call; the server kept the turns under it.
        episode = client.episode(trace.id)
        assert episode.session == trace.id
        turns = episode.turns
        spans = sampled_spans(mask)
        assert len(turns) == len(spans) == trace.num_turns
        for turn, (start, end) in zip(turns, spans):
            # The sampled tokens and their log-probs are exactly those verifiers recorded for training.
            assert turn.token_ids == tokens[start:end]
            assert turn.logprobs == logprobs[start:end]
            # Each turn's prompt is the branch up to that turn: what the renderer (or its bridge) built.
            assert turn.prompt_ids == tokens[:start]
            assert turn.weight_version == tool_model
        assert [t.finish_reason for t in turns] == ["stop", "stop"]  # the engine's; verifiers promotes a call's
        assert turns[-1].prompt_ids + turns[-1].token_ids == tokens  # nothing after the last turn

        # The prompts are PrimeRL's renderer's token ids: the first renders the task, the next bridges the
        # previous prompt and sampled tokens with the tool's reply (a prefix extension, not a re-render).
        messages = [m.model_dump(exclude_none=True) for m in trace.messages]
        assert turns[0].prompt_ids == renderer.render(messages[:2], tools=[ADD_TOOL], add_generation_prompt=True).token_ids
        bridged = renderer.bridge_to_next_turn(turns[0].prompt_ids, turns[0].token_ids,
                                               [{"role": "tool", "tool_call_id": call.id, "content": messages[3]["content"]}],
                                               tools=[ADD_TOOL])
        assert bridged is not None and turns[1].prompt_ids == bridged.token_ids
        assert turns[1].prompt_ids[:len(turns[0].prompt_ids) + len(turns[0].token_ids)] == turns[0].prompt_ids + turns[0].token_ids
        print(f"\n{question!r}: {trace.num_turns} turns, {len(tokens)} tokens ({sum(mask)} sampled), "
              f"reply {trace.last_reply!r}")
    assert len({t.id for t in rollout}) == len(rollout)


def test_b_the_captured_episodes_train_and_the_next_rollout_samples_the_new_weights(rollout, client, server, tiny_model,
                                                                                     tool_model):
    seqs = [s for trace in rollout for s in client.episode(trace.id).sequences(advantages=trace.reward or 1.0)]
    assert len(seqs) == sum(t.num_turns for t in rollout)
    full = sum(len(s.prompt_ids) + len(s.response_ids) for s in seqs)
    # The trainer scores the sampled tokens as the sampler did (the log-probs verifiers recorded).
    recorded = [lp for trace in rollout for lp, m in zip(trace.branches[0].logprobs, trace.branches[0].sampled_mask) if m]
    trainer = [lp for row in client.log_probs(seqs).logprobs for lp in row]
    assert len(trainer) == len(recorded) and max(abs(a - b) for a, b in zip(trainer, recorded)) < 1e-3
    out = client.fwd_bwd(seqs, "grpo")
    assert math.isfinite(out.loss)
    print(f"\n{len(seqs)} turns, {full} tokens in full: the prefix tree computed {out.computed_tokens}")
    # Each episode's second turn extends its first: the prefix tree computes an episode's history once, so
    # no more positions than the episodes' final sequences (here fewer: the tasks share the system prompt).
    assert out.computed_tokens <= sum(len(trace.branches[0].token_ids) for trace in rollout) < full, (out.computed_tokens, full)
    assert math.isfinite(client.step().grad_norm)
    version = client.sync_weights()
    assert version == tool_model + 1

    again = run_env(train_client(server, tiny_model))
    for trace in again:
        assert trace.ok, [e.message for e in trace.errors]
        turns = client.episode(trace.id).turns
        assert turns and len(turns) == trace.num_turns
        assert {t.weight_version for t in turns} == {version}


def test_c_the_eval_client_relays_chat_completions_and_the_turn_is_captured(server, client, tokenizer, tool_model):
    """verifiers' EvalClient (evaluation, and PrimeRL's eval runs) relays the harness's own request to
    `/v1/chat/completions`; here through `vf.Agent(...).run(task)`, the single-rollout API."""
    import verifiers.v1 as vf
    from arctic_calc_taskset import SYSTEM_PROMPT, SumTask
    from verifiers.v1.runtimes import SubprocessConfig

    question = next(iter(QUESTIONS))

    async def main():
        agent = vf.Agent(vf.AgentConfig(
            model=SERVED_MODEL, client=vf.EvalClientConfig(base_url=f"{server}/v1", api_key_var="ARCTIC_RL_COMPAT_NO_KEY"),
            sampling=vf.SamplingConfig(temperature=1.0, max_tokens=8, seed=SEED),
            harness={"id": "arctic_calc_harness", "use_tools": False}, runtime=SubprocessConfig()))
        async with agent:
            return await agent.run(SumTask(vf.TaskData(prompt=question, system_prompt=SYSTEM_PROMPT)))
    trace = asyncio.run(main())
    assert trace.ok, [e.message for e in trace.errors]
    assert [m.role for m in trace.messages] == ["system", "user", "assistant"]
    [call] = trace.calls
    assert call.usage.completion_tokens <= 8

    # The X-Session-ID the EvalClient sends captures the turn too: the prompt as our server renders the chat
    # with the model's own template, the reply's text decoded from the sampled tokens.
    [turn] = client.episode(trace.id).turns
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    assert turn.prompt_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert len(turn.token_ids) == call.usage.completion_tokens
    # (as vLLM writes it: less a last character whose bytes never all came)
    assert (trace.messages[-1].content or "") == tokenizer.decode(turn.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert turn.weight_version >= tool_model
    print(f"\neval: {len(turn.prompt_ids)} prompt tokens, reply {trace.messages[-1].content!r}")
