"""Recipe files and overrides: every mistake is reported, naming the key or file, before any model loads."""

import os

import pytest
import yaml

from arctic_rl_core.cli import main as cli_main
from arctic_rl_core.errors import InvalidRequest
from arctic_rl_recipes.config import apply_override, bundled_recipes, load_recipe, resolve_recipe


def write_recipe(tmp_path, **changes) -> str:
    tree = yaml.safe_load(open(resolve_recipe("text2sql_tiny")))
    tree["output_dir"] = str(tmp_path / "run")
    tree["model"]["path"] = str(tmp_path / "model")
    for key, value in changes.items():
        apply_override(tree, f"{key}={value}")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_bundled_recipes_parse_and_overrides_apply():
    assert {"text2sql_tiny", "multihop_tiny", "multihop_16k_tiny"} <= set(bundled_recipes())
    config = load_recipe("text2sql_tiny", ["grpo.steps=7", "+backend.engine.zero_stage=0", "pipeline.max_staleness=0",
                                           "grpo.loss.config={eps_clip: 0.1}", "backend.url=null"])
    assert config.grpo.steps == 7 and config.backend.engine.zero_stage == 0 and config.pipeline.max_staleness == 0
    assert config.grpo.loss.config == {"eps_clip": 0.1} and config.backend.url is None
    assert load_recipe("multihop_tiny").task.name == "multihop_qa"
    long_context = load_recipe("multihop_16k_tiny")
    assert long_context.task.distractors.budget_tokens == 16000 and long_context.model.rope_scaling.factor == 4


@pytest.mark.parametrize("overrides,field,words", [
    (["grpo.stepz=5"], "grpo.stepz", "unknown key (from override 'grpo.stepz=5')"),
    (["task.schema_rowz=3"], "task.schema_rowz", "unknown key"),
    (["grpo.steps=-1"], "grpo.steps", "greater than or equal"),
    (["grpo.steps=many"], "grpo.steps", "integer"),
    (["task.name=poetry"], "task", "does not match any of the expected tags"),
    (["grpo.steps"], "overrides", "key.path=value"),
    (["grpo.steps.x=1"], "grpo.steps", "cannot set"),
])
def test_bad_overrides_name_the_key(overrides, field, words):
    with pytest.raises(InvalidRequest) as err:
        load_recipe("text2sql_tiny", overrides)
    assert err.value.field == field and words in err.value.message


@pytest.mark.parametrize("changes,field", [
    ({"task.synthetic": "null", "task.train": "/nonexistent/train.json", "task.eval": "/nonexistent/dev.json",
      "task.db_root": "/nonexistent"}, "task.train"),
    ({"task.synthetic": "null"}, "task.train"),
    ({"task.synthetic.train_questions": "0"}, "task.synthetic.train_questions"),
    ({"model.tiny": "null"}, "model.path"),
    ({"grpo.loss.name": "no_such_loss"}, "grpo.loss.name"),
    ({"grpo.loss.config": "{eps_clipp: 0.2}"}, "grpo.loss.config.eps_clipp"),
    ({"model.rope_scaling": "{rope_type: dynamic, factor: 2}"}, "model.rope_scaling.rope_type"),
])
def test_bad_recipe_input_fails_before_any_model_loads(tmp_path, capsys, changes, field):
    path = write_recipe(tmp_path, **changes)
    assert cli_main(["train", path]) == 2
    message = capsys.readouterr().err
    assert f"arctic-rl train: {field}" in message
    assert not os.path.exists(tmp_path / "model")  # nothing was built or loaded


def test_wrong_format_and_empty_dataset(tmp_path, capsys):
    spider_like = tmp_path / "spider.json"
    spider_like.write_text('[{"db_id": "x", "question": "q", "query": "SELECT 1"}]')
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    (tmp_path / "dbs").mkdir()
    for train, field in ((spider_like, "task.train[0].SQL"), (empty, "task.train")):
        path = write_recipe(tmp_path, **{"task.synthetic": "null", "task.train": str(train), "task.eval": str(train),
                                         "task.db_root": str(tmp_path / "dbs")})
        assert cli_main(["train", path]) == 2
        assert f"arctic-rl train: {field}" in capsys.readouterr().err
    assert cli_main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "arctic-rl train: recipe: file not found" in capsys.readouterr().err
