"""A user's reward as the recipes call it: a wrong signature is refused when the config is read,
and a reward that does not return stops the run after ``reward_timeout`` seconds, naming the prompt."""

from __future__ import annotations

import threading
import time

import pytest

from nopad.recipes.config import load_config
from nopad.recipes.grpo_config import GRPORecipeConfig
from nopad.recipes.reward_calls import with_timeout

RELEASE = threading.Event()  # set by the tests when they are done: a stuck reward's thread then ends


def one_argument_reward(completion: str) -> float:
    return float(len(completion))


def stuck_reward(completion: str, example: dict) -> float:
    RELEASE.wait(60)
    return 0.0


def failing_reward(completion: str, example: dict) -> float:
    raise KeyError("answer")


@pytest.fixture(autouse=True)
def release_stuck_rewards():
    RELEASE.clear()
    yield
    RELEASE.set()


def test_a_reward_with_the_wrong_signature_is_refused_when_the_config_is_read(capsys):
    from nopad.recipes.grpo import main

    with pytest.raises(SystemExit) as exit_:
        main(["reward=tests.recipes.test_recipes_reward_calls:one_argument_reward"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    reward = "tests.recipes.test_recipes_reward_calls:one_argument_reward"
    assert err.startswith(
        f"nopad.recipes.grpo: error: reward='{reward}' takes (completion), but the recipe calls "
        "it as fn(completion: str, example: dict) -> float: give it those two parameters "
        "(any others need defaults)"
    ), err
    with pytest.raises(ValueError, match=r"^scorer 'test_a_reward.*<lambda>' takes \(\)"):
        from nopad.recipes.evaluate import EvaluateConfig

        EvaluateConfig(scorer=lambda: 1.0)
    load_config(GRPORecipeConfig, overrides={"reward": lambda text, example, scale=1.0: scale})  # defaults


def test_a_reward_that_does_not_return_stops_at_the_timeout_naming_the_prompt():
    timed = with_timeout(stuck_reward, 0.2, "reward_timeout")
    start = time.perf_counter()
    with pytest.raises(TimeoutError) as err:
        timed("12", {"prompt": "What is 7 +\n 5?", "answer": "12"})
    assert time.perf_counter() - start < 5
    assert str(err.value).endswith(
        "test_recipes_reward_calls:stuck_reward did not return within 0.2 s for "
        "the prompt 'What is 7 + 5?'; make it faster or set reward_timeout higher "
        "(seconds; null: no limit)"
    )


def test_a_timed_reward_keeps_its_value_its_errors_and_its_name():
    timed = with_timeout(failing_reward, 5.0, "reward_timeout")
    with pytest.raises(KeyError, match="answer") as err:
        timed("x", {"prompt": "p"})
    assert err.traceback[-1].name == "failing_reward"  # the user's line, not the wrapper's
    assert timed.__name__ == "failing_reward"
    assert with_timeout(lambda text, example: 1.5, 5.0, "reward_timeout")("x", {}) == 1.5
    assert with_timeout(stuck_reward, None, "reward_timeout") is stuck_reward  # null: called directly
    with pytest.raises(ValueError, match="reward_timeout must be > 0 seconds or null"):
        load_config(GRPORecipeConfig, overrides=["reward_timeout=0"])


def test_grpo_stops_at_the_reward_timeout(tmp_path, one_thread):
    from nopad.recipes.grpo import run_grpo
    from nopad.recipes.tiny_model import AsciiTokenizer
    from tests.recipes.test_recipes_grpo import tiny_config
    from tests.recipes.test_recipes_sft import _reset_accelerate
    from tests.support.models import tiny_model

    cfg = tiny_config(reward=stuck_reward, reward_timeout=0.5)
    try:
        with pytest.raises(
            TimeoutError,
            match=r"^the reward .*:stuck_reward did not return within 0.5 s for "
            r"the prompt 'What is ",
        ):
            run_grpo(cfg, model=tiny_model("llama"), tokenizer=AsciiTokenizer(), progress=False)
    finally:
        _reset_accelerate()
