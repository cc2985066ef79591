"""A verifiers environment in the shape of the Environments Hub's primeintellect/reverse-text (the cookbook's
verifiers_rl example), offline: reverse a short text character by character, answer in <reversed_text> tags,
reward = the longest-common-subsequence ratio (difflib) of the answer to the reversed text. The texts are drawn
from a fixed word list, so it needs no download. `examples/cookbook.toml#verifiers_rl` smokes on it (the Hub's
module is not installed offline), and it is a verifiers environment like any other:

    env = { kind = "verifiers", module = "examples.vf_reverse_text", args = { n = 256 } }
"""

from __future__ import annotations

import difflib
import random

import verifiers as vf
from datasets import Dataset

WORDS = ("river stone cloud amber north quiet lantern maple orbit velvet harbor candle meadow silver thunder "
         "willow copper garden falcon ember").split()
SYSTEM = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."


def _texts(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        rows.append({"question": text, "answer": text[::-1]})
    return Dataset.from_list(rows)


def load_environment(n: int = 256, test_n: int = 32, seed: int = 0) -> vf.Environment:
    parser = vf.XMLParser(["reversed_text"], answer_field="reversed_text")

    def lcs_reward(completion: vf.Messages, answer: str, **kwargs: object) -> float:
        given = parser.parse_answer(completion) or ""
        return difflib.SequenceMatcher(None, given, answer).ratio()

    rubric = vf.Rubric(funcs=[lcs_reward, parser.get_format_reward_func()], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(dataset=_texts(n, seed), eval_dataset=_texts(test_n, seed + 1), system_prompt=SYSTEM,
                            parser=parser, rubric=rubric)
