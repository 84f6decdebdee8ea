"""`arctic-rl eval longbench`: LongBench v1's QA metric on known predictions, its middle truncation, its data
format's checks, and the command end to end on fixture files in LongBench's schema."""

import json
import os

import pytest
from transformers import AutoTokenizer

from arctic_rl_core.errors import InvalidRequest
from arctic_rl_recipes.longbench import TEMPLATES, load_task, prompt_ids, qa_f1, task_score
from tests.preimported import arctic_rl


def test_qa_f1_is_longbenchs_word_level_f1_after_squad_normalisation():
    assert qa_f1("The Eiffel Tower, Paris.", "Eiffel Tower") == pytest.approx(0.8)  # P 2/3, R 1
    assert qa_f1("an apple", "The Apple!") == 1.0  # case, punctuation and articles do not count
    assert qa_f1("Barack Obama was president", "Obama") == pytest.approx(0.4)  # P 1/4, R 1
    assert qa_f1("the cat cat", "cat") == pytest.approx(2 / 3)  # a multiset: the second "cat" is extra
    assert qa_f1("", "Paris") == 0.0 and qa_f1("yes", "no") == 0.0
    # A task's score: each prediction's best gold answer, averaged, x100, 2 places (LongBench's eval.py).
    assert task_score(["Eiffel Tower", "no idea"], [["Paris", "Eiffel Tower"], ["London"]]) == 50.0
    assert task_score(["The Eiffel Tower, Paris.", "Barack Obama was president", "the cat cat"],
                      [["Eiffel Tower"], ["Obama"], ["cat"]]) == 62.22


def _record(i: int, context: str, question: str, answers: list[str]) -> dict:
    """A record in LongBench's published schema."""
    return {"input": question, "context": context, "answers": answers, "length": len(context.split()),
            "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": f"id{i}"}


def _write(folder, task: str, records: list[dict]) -> None:
    with open(os.path.join(folder, f"{task}.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_a_prompt_past_the_window_is_cut_from_the_middle_keeping_both_ends(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    context = " ".join(f"Passage {i}: the river number {i} runs north." for i in range(200))
    record = _record(0, context, "Which river runs north?", ["river 7"])
    full = tokenizer(TEMPLATES["hotpotqa"].format(context=context, input=record["input"])).input_ids
    ids = prompt_ids(record, "hotpotqa", tokenizer, max_length=64, chat=False)
    assert len(full) > 200 and abs(len(ids) - 64) <= 2  # re-encoding the joined halves may merge at the joint
    text = tokenizer.decode(ids)
    assert text.startswith("Answer the question based on the given passages.")  # the instructions at both ends
    assert text.endswith("Question: Which river runs north?\nAnswer:")
    short = prompt_ids(_record(1, "Passage: a river.", "Which?", ["a"]), "hotpotqa", tokenizer, 512, chat=False)
    assert tokenizer.decode(short) == TEMPLATES["hotpotqa"].format(context="Passage: a river.", input="Which?")
    chatted = tokenizer.decode(prompt_ids(record, "hotpotqa", tokenizer, 64, chat=True))
    assert chatted.startswith("<|im_start|>user") and "Question: Which river runs north?" in chatted


def test_records_the_evaluation_cannot_read_are_refused_naming_the_field(tmp_path):
    _write(tmp_path, "musique", [_record(0, "c", "q", ["a"]), {"input": "q", "context": "c", "answers": []}])
    with pytest.raises(InvalidRequest) as err:
        load_task(str(tmp_path), "musique")
    assert err.value.field == "data/musique.jsonl[1].answers"
    _write(tmp_path, "hotpotqa", [{"input": 3, "context": "c", "answers": ["a"]}])
    with pytest.raises(InvalidRequest) as err:
        load_task(str(tmp_path), "hotpotqa")
    assert err.value.field == "data/hotpotqa.jsonl[0].input"
    with pytest.raises(InvalidRequest) as err:
        load_task(str(tmp_path), "2wikimqa")  # no such file
    assert err.value.field == "data/2wikimqa.jsonl"
    with pytest.raises(InvalidRequest) as err:
        load_task(str(tmp_path), "gov_report")  # scored by ROUGE, not a QA task
    assert err.value.field == "tasks"


def test_eval_longbench_prints_each_tasks_f1_and_the_average(tiny_model, tmp_path):
    for task in ("hotpotqa", "musique"):
        _write(tmp_path, task, [_record(i, " ".join(f"Passage {j}: town {j} lies on river {i + j}." for j in range(40)),
                                        f"Which river is town {i} on?", [f"river {2 * i}", "unknown"])
                                for i in range(3)])
    out = tmp_path / "scores.json"
    proc = arctic_rl("eval", "longbench", "--data", str(tmp_path), "--model", tiny_model, "--sampler", "transformers",
                     "--tasks", "hotpotqa", "musique", "--max-length", "96", "--output", str(out),
                     "--rope-scaling", '{"rope_type": "yarn", "factor": 4}', timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = json.loads(out.read_text())
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.split()}
    for task in ("hotpotqa", "musique"):
        result = scores["tasks"][task]
        assert result["examples"] == 3 and len(result["predictions"]) == 3
        # The printed score is LongBench's, recomputed from the predictions it saved.
        assert result["f1"] == task_score([p["pred"] for p in result["predictions"]],
                                          [p["answers"] for p in result["predictions"]])
        assert rows[task] == ["3", f"{result['f1']:.2f}"]
    assert scores["average"] == round((scores["tasks"]["hotpotqa"]["f1"] + scores["tasks"]["musique"]["f1"]) / 2, 2)
    assert rows["average"] == ["6", f"{scores['average']:.2f}"] and scores["max_length"] == 96
    assert scores["context"] == 4 * 256  # the model's 256 positions under the YaRN asked for
