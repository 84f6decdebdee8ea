"""Multi-hop QA: the HotpotQA, MuSiQue and 2WikiMultihopQA loaders and the substring exact-match reward."""

import json

import pytest

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_recipes.multihop.synthetic import SyntheticQAConfig, generate_multihop
from arctic_rl_recipes.multihop.task import MultihopConfig, MultihopTask, normalize_answer, substring_match_reward

MUSIQUE = [
    {"id": "2hop__1_2", "question": "Who founded the company that makes the Walkman?",
     "paragraphs": [{"idx": 0, "title": "Walkman", "paragraph_text": "The Walkman is made by Sony.", "is_supporting": True},
                    {"idx": 1, "title": "Banana", "paragraph_text": "Bananas are yellow.", "is_supporting": False},
                    {"idx": 2, "title": "Sony", "paragraph_text": "Sony was founded by Masaru Ibuka.", "is_supporting": True}],
     "question_decomposition": [{"id": 1, "question": "Who makes the Walkman?", "answer": "Sony", "paragraph_support_idx": 0},
                                {"id": 2, "question": "Who founded #1?", "answer": "Masaru Ibuka", "paragraph_support_idx": 2}],
     "answer": "Masaru Ibuka", "answer_aliases": ["Ibuka"], "answerable": True},
    {"id": "2hop__3_4", "question": "Unanswerable?", "paragraphs": [], "question_decomposition": [],
     "answer": "", "answer_aliases": [], "answerable": False},
]
TWO_WIKI = [
    {"_id": "8813f87c0bdd11eba7f7acde48001122", "type": "compositional",
     "question": "Who is the mother of the director of film Polish-Russian War?",
     "context": [["Xawery Żuławski", ["Xawery Żuławski is a Polish film director.", "His mother is Małgorzata Braunek."]],
                 ["Polish-Russian War (film)", ["Polish-Russian War is a 2009 film directed by Xawery Żuławski."]],
                 ["Bananas", ["Bananas grow in bunches."]]],
     "supporting_facts": [["Polish-Russian War (film)", 0], ["Xawery Żuławski", 1]],
     "evidences": [["Polish-Russian War", "director", "Xawery Żuławski"], ["Xawery Żuławski", "mother", "Małgorzata Braunek"]],
     "answer": "Małgorzata Braunek"},
]


def test_normalised_substring_match():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert substring_match_reward("I think it is the United States.", answers=["United States"]).correct
    assert substring_match_reward("Masaru Ibuka", answers=["ibuka"]).reward == 1.0
    assert not substring_match_reward("Franceville", answers=["France"]).correct  # whole words only
    assert not substring_match_reward("", answers=["France"]).correct


def test_hotpotqa_format_from_the_synthetic_generator(tmp_path):
    paths = generate_multihop(str(tmp_path / "data"), SyntheticQAConfig(train_questions=30, eval_questions=10, distractors=4))
    task = MultihopTask(MultihopConfig(name="multihop_qa", format="hotpotqa", **paths), str(tmp_path))
    train, held_out = task.load("train"), task.load("eval")
    assert len(train) == 30 and len(held_out) == 10
    record = json.load(open(paths["train"]))[0]
    assert set(record) >= {"_id", "question", "answer", "supporting_facts", "context", "type", "level"}
    example = train[0]
    assert example.prompt.count("Document ") == len(record["context"]) == 6
    assert substring_match_reward(example.reference, **example.reward_args).correct
    asked = {e.prompt.rsplit("Question: ", 1)[1] for e in train}
    assert not any(e.prompt.rsplit("Question: ", 1)[1] in asked for e in held_out)


def test_musique_jsonl_skips_unanswerable_and_keeps_aliases(tmp_path):
    path = tmp_path / "musique_ans_v1.0_dev.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in MUSIQUE))
    task = MultihopTask(MultihopConfig(name="multihop_qa", format="musique", train=str(path), eval=str(path),
                                       max_paragraphs=2), str(tmp_path))
    [example] = task.load("train")
    # max_paragraphs keeps both supporting paragraphs, in the data set's order.
    assert "Walkman is made by Sony" in example.prompt and "founded by Masaru Ibuka" in example.prompt
    assert "Bananas" not in example.prompt
    assert substring_match_reward("It was Ibuka.", **example.reward_args).correct


def test_2wikimultihopqa_format(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(TWO_WIKI))
    task = MultihopTask(MultihopConfig(name="multihop_qa", format="2wikimultihopqa", train=str(path), eval=str(path)), str(tmp_path))
    [example] = task.load("eval")
    assert "Document 2 (Polish-Russian War (film))" in example.prompt
    assert substring_match_reward("małgorzata braunek", **example.reward_args).correct


def test_wrong_format_names_the_record(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(TWO_WIKI))
    task = MultihopTask(MultihopConfig(name="multihop_qa", format="musique", train=str(path), eval=str(path)), str(tmp_path))
    with pytest.raises(InvalidRequest) as err:
        task.load("train")
    assert err.value.field == "task.train[0].id"


@pytest.fixture(scope="module")
def synthetic_task(tmp_path_factory):
    """A synthetic HotpotQA-format set of 300 training questions, loaded, and a byte-level BPE tokenizer trained
    on its prompts (as the recipe's tiny model's is)."""
    from arctic_rl_core.models.tiny import train_tokenizer

    def task(**distractors):
        config = MultihopConfig(name="multihop_qa", synthetic=SyntheticQAConfig(train_questions=300, eval_questions=8),
                                distractors=distractors or None)
        loaded = MultihopTask(config, str(tmp_path_factory.mktemp("distractors")))
        return loaded, loaded.load("train")

    _, examples = task()
    tokenizer = train_tokenizer(corpus=[e.prompt for e in examples])
    return task, lambda text: len(tokenizer.encode(text))


def _documents(prompt: str) -> list[str]:
    return [line.split("): ", 1)[1] for line in prompt.split("\nQuestion:")[0].splitlines()]


@pytest.mark.parametrize("budget", [512, 1024, 3000])
def test_distractor_contexts_fill_the_token_budget_and_keep_the_supporting_paragraphs(synthetic_task, budget):
    make_task, count_tokens = synthetic_task
    standard_task, standard = make_task()
    task, examples = make_task(budget_tokens=budget, seed=3)
    examples = examples[:60]  # padded from the whole split's paragraphs
    padded = task.fit_contexts("train", examples, count_tokens)
    assert [e.id for e in padded] == [e.id for e in examples]
    lengths = [count_tokens(e.prompt) for e in padded]
    assert all(0.98 * budget <= n <= budget for n in lengths), (min(lengths), max(lengths))
    assert max(count_tokens(e.prompt) for e in standard) < 0.98 * budget  # the padding made the length
    for example, question in zip(padded, task._questions["train"]):
        documents = _documents(example.prompt)
        assert all(text in documents for _, text, supporting in question.paragraphs if supporting)
        assert example.prompt.endswith(f"Question: {question.question}\nAnswer:")
    # The seed and the question decide everything drawn: a second build is the same, another seed is not.
    assert [e.prompt for e in task.fit_contexts("train", examples, count_tokens)] == [e.prompt for e in padded]
    other_task, _ = make_task(budget_tokens=budget, seed=4)
    assert [e.prompt for e in other_task.fit_contexts("train", examples, count_tokens)] != [e.prompt for e in padded]
    assert standard_task.fit_contexts("train", standard, count_tokens) == standard  # the standard variant


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0, None])
def test_the_needle_sits_at_the_depth_asked_for(synthetic_task, depth):
    make_task, count_tokens = synthetic_task
    task, examples = make_task(budget_tokens=1024, needle_depth=depth)
    positions = []
    for example, question in zip(task.fit_contexts("train", examples[:40], count_tokens), task._questions["train"]):
        documents = _documents(example.prompt)
        needle = [text for _, text, supporting in question.paragraphs if supporting]
        at = documents.index(needle[0])
        assert documents[at:at + len(needle)] == needle  # together, in their order
        positions.append(at / (len(documents) - len(needle)))
    if depth is None:  # a random depth per question, spread over the context
        assert min(positions) < 0.2 and max(positions) > 0.8
    else:
        assert all(abs(p - depth) <= 0.02 for p in positions), positions
