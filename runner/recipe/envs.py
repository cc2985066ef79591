"""The RL environments a recipe's `algo.env` may name (`kind = ...`). Part of the recipe schema
(runner/recipe/schema.py re-exports every name).

A built-in env is its struct here (a subclass of EnvBase: the `Env` union is every subclass, in order) whose
`implementation` names its module in runner/rl/envs/, which declares `ENV = EnvKind(build, headline)`
(runner/rl/envs/__init__.py finds it by that name). The config sits here, below the env's code, so `runner check`
validates a recipe without importing any env (docs/extending.md)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta

from runner.recipe.common import (
    TARGET_PATTERN,
    Base,
    DataSource,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    RecipeRef,
    Target,
    variants,
)

# ---------------------------------------------------------------- RL: environments

class EnvBase(Base, tag_field="kind", tag=str.lower):
    # The module that builds the env: it declares `ENV = EnvKind(...)` (runner/rl/envs/__init__.py). "": user code.
    implementation: ClassVar[str] = ""
    # Problems in the training split (batches = train_size // groups_per_batch) and held out for evals.
    train_size: PosInt = 10_000
    test_size: NonNegInt = 64


class Arithmetic(EnvBase):
    """Single turn: "What is x + y?". reward = correct + 0.1·(format − 1), format = an integer reply that ended
    on the stop token (the cookbook's math_rl `arithmetic`)."""

    min_value: int = 0
    max_value: int = 99
    # Prepend one solved example ("What is 4 + 5?" → "9") so a small model sees the answer format.
    few_shot: bool = True
    implementation: ClassVar[str] = "runner.rl.envs.arithmetic"

    def __post_init__(self) -> None:
        if self.max_value < self.min_value:
            raise ValueError("max_value must be >= min_value")


class GuessNumber(EnvBase, tag="guess_number"):
    """Multi-turn: guess a secret integer in [low, high]; the env answers "higher", "lower" or "correct".
    reward = 1 − (guesses − 1)/max_turns on success, 0 when out of turns, −1 for a reply that is not an integer."""

    low: int = 0
    high: int = 1023
    max_turns: PosInt = 10
    implementation: ClassVar[str] = "runner.rl.envs.guess_number"

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high must be >= low")


class TwentyQuestions(EnvBase, tag="twenty_questions"):
    """Multi-turn: find an object from a fixed table by yes/no questions about its attributes, then
    "Guess: <name>". reward 1 for a correct guess within max_turns, else 0. Test objects are held out."""

    # The table needs about five well-chosen questions; 12 turns keep a byte-level conversation inside the
    # tiny model's 2048-token context at max_tokens 32 (longer prompts drop the group: ContextOverflow).
    max_turns: PosInt = 12
    train_size: PosInt = 2_000
    test_size: NonNegInt = 4
    implementation: ClassVar[str] = "runner.rl.envs.twenty_questions"


class TicTacToe(EnvBase, tag="tictactoe"):
    """Reply with a cell 1-9. "self": both seats are the policy (group_size/2 games per group); otherwise the
    policy plays a random seat against a fixed opponent. win 1, draw 0, loss −1; an illegal move loses."""

    opponent: Literal["self", "random", "optimal"] = "self"
    test_opponent: Literal["random", "optimal"] = "random"
    implementation: ClassVar[str] = "runner.rl.envs.tictactoe"


class ModelJudge(Base, tag_field="kind", tag="model"):
    """A trained pairwise reward model as the preference judge: P(a better) from the logprobs of its "A"/"B" label
    tokens, averaged over both orders (runner/rewards/judge.py). When the RL recipe is chained (init_from), the
    final eval also reports test/win_rate_vs_init: the final policy's replies against the initial policy's, judged by
    it on the test prompts."""

    init_from: RecipeRef


class Preference(EnvBase):
    """Single turn; the group's replies are judged pairwise, round-robin, both orders; reward = win fraction
    + format_coef·(ended_on_stop − 1). The judge is fn(prompt, a, b) -> P(a better) in [0, 1]."""

    prompts: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["Who are you?"])
    # Held-out prompts for evals (test_size is not used here).
    test_prompts: list[str] = []
    # None: the shorter reply wins (the cookbook's `shorter` recipe); "pkg.mod:fn"; or {kind = "model", init_from =
    # "#reward_model_recipe"}: a trained reward model (algo kind reward_model), run first by `runner run`.
    judge: Target | ModelJudge | None = None
    format_coef: NonNegFloat = 0.1
    implementation: ClassVar[str] = "runner.rl.envs.preference"


class Math(EnvBase, kw_only=True):
    """Single turn: a math problem from `data`; the reply's final answer is graded against the reference (math-verify
    when installed, else runner's normalizer: runner/rewards/math_grading.py). reward = correct + format_coef·(format
    − 1), format = an answer found (in `answer_format`) and the reply ended on the stop token (cookbook math_rl)."""

    # Rows with a question and a reference answer: `question`/`problem` and `answer`/`solution` by default (GSM8K's
    # "#### x" and MATH's \boxed{x} solutions are reduced to x; a plain answer is taken as is).
    data: DataSource
    # Held-out problems for evals; None: test_size rows of `data` (shuffled by the seed) are held out.
    test_data: DataSource | None = None
    question_field: str | None = None
    answer_field: str | None = None
    # "boxed": only \boxed{x} counts (the cookbook); "auto": also "#### x", "the answer is x" or a bare number.
    answer_format: Literal["boxed", "auto"] = "boxed"
    # Appended to every question; None: the cookbook's " Write your answer in \boxed{} format." for "boxed", nothing
    # for "auto".
    question_suffix: str | None = None
    # Prepend one solved example in the answer format (the cookbook's "strawberry" example for "boxed").
    few_shot: bool = True
    format_coef: NonNegFloat = 0.1
    # "auto": math-verify when installed (the `math` extra), else the built-in normalizer.
    grader: Literal["auto", "builtin", "math_verify"] = "auto"
    implementation: ClassVar[str] = "runner.rl.envs.math"


class Code(EnvBase, kw_only=True):
    """Single turn: a programming problem; the reply's last ```python block runs in a local sandbox
    (runner/rewards/sandbox.py, docs/sandbox.md) against the problem's tests. reward = fraction of tests passed
    + format_coef·(format − 1), format = a code block found and the reply ended on the stop token."""

    # Rows: {"question": str, "tests": [{"input": str, "output": str}, ...] and/or "asserts": [str, ...]}.
    data: DataSource
    test_data: DataSource | None = None
    format_coef: NonNegFloat = 0.1
    # Per test run (seconds of CPU / wall, MiB of address space).
    cpu_s: PosInt = 2
    wall_s: PosFloat = 5.0
    memory_mb: Annotated[int, Meta(ge=64)] = 512
    # Sandboxed programs at once (None: the CPU count).
    max_parallel: PosInt | None = None
    implementation: ClassVar[str] = "runner.rl.envs.code"


BUILTIN_TOOLS = ("calculator", "search")


class ToolUse(EnvBase, tag="tool_use", kw_only=True):
    """Multi-turn tool calling (cookbook search_tool): the model may call `tools` (in the renderer's tool format, or
    `CALL name {json}` lines where it has none) up to max_turns, then answers; reward = correct + format_coef·(format
    − 1), format = an answer after `answer_prefix` and no malformed call (runner/rl/envs/tool_use.py)."""

    # Rows {question, answer}: answer a string, a number or a list of accepted answers.
    data: DataSource
    test_data: DataSource | None = None
    # Built-ins ("calculator", "search") and "pkg.mod:fn" functions (docstring + typed args -> a JSON-schema spec).
    tools: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["calculator"])
    # The `search` tool's collection: rows {id, title, text}.
    docs: DataSource | None = None
    top_k: PosInt = 3
    # Assistant turns per episode (tool-calling turns plus the answer).
    max_turns: PosInt = 4
    # The final answer is the text after the last `answer_prefix` (case-insensitive); "": the whole final reply.
    answer_prefix: str = "Answer:"
    # Prepended as the system prompt (with the tool declarations); None: a short default.
    system_prompt: str | None = None
    format_coef: NonNegFloat = 0.1
    # Characters of a tool result shown to the model.
    max_result_chars: PosInt = 1000
    tool_timeout_s: PosFloat = 10.0
    implementation: ClassVar[str] = "runner.rl.envs.tool_use"

    def __post_init__(self) -> None:
        for tool in self.tools:
            if tool not in BUILTIN_TOOLS and re.fullmatch(TARGET_PATTERN, tool) is None:
                raise ValueError(f"tool {tool!r} is neither a built-in {list(BUILTIN_TOOLS)} nor 'pkg.mod:fn'")
        if "search" in self.tools and self.docs is None:
            raise ValueError("the search tool needs `docs`, a data source of {id, title, text} rows")


class JudgeModel(Base, tag_field="kind", tag="model"):
    """A model that grades in text: a chained run's final weights (init_from), a saved sampler checkpoint, or a base
    model (`model`; default the recipe's own)."""

    init_from: RecipeRef | None = None
    checkpoint: str | None = None
    model: str | None = None
    # The judge's reply (the cookbook's grader gets 2048 to reason before its <score>).
    max_tokens: PosInt = 256
    temperature: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        if self.init_from is not None and self.checkpoint is not None:
            raise ValueError("give init_from or checkpoint, not both")


class PythonGrader(Base, tag_field="kind", tag="python"):
    """fn(messages, reply, item) -> a score in [0, 1] (number or bool), or a judge's text (parsed as a model's)."""

    target: Target


class Rubric(EnvBase, kw_only=True):
    """Single turn; a judge grades the reply against each rubric item of its prompt (cookbook rubric recipe): reward =
    mean item score in [0, 1] + format_coef·(ended_on_stop − 1); judge text that gives no score counts 0
    (runner/rl/envs/rubric.py)."""

    # Rows {prompt or messages, rubric: [items] or one string}, or the cookbook's {convo, rubric_items: [{rubric_str}]}.
    data: DataSource
    test_data: DataSource | None = None
    judge: JudgeModel | PythonGrader = JudgeModel()
    format_coef: NonNegFloat = 0.1
    implementation: ClassVar[str] = "runner.rl.envs.rubric"


class ReasoningGym(EnvBase, tag="reasoning_gym", kw_only=True):
    """Single turn: procedural tasks of the reasoning-gym library (the `reasoning` extra), scored by the library's
    own scorers (0..1). reward = score + format_coef·(format − 1), format = the reply ended on its stop sequence
    (and held `<answer>` tags when answer_tag). train_size problems, split over the tasks; test_size per task."""

    # reasoning-gym task names ("basic_arithmetic", "spell_backward", ...; `python -c "import reasoning_gym;
    # print(sorted(reasoning_gym.factory.DATASETS))"`).
    tasks: Annotated[list[str], Meta(min_length=1)]
    # The task's generator settings (its *Config dataclass's fields); with several tasks, a table per task name.
    config: dict[str, Any] = {}
    # The generators' seed (None: the recipe's seed).
    seed: NonNegInt | None = None
    # The user message: a format string over the item's `question`, `answer` and metadata fields.
    prompt: str = "{question}"
    # A system message: a reasoning-gym system prompt's name ("default" asks for <answer> tags) or the text itself.
    system_prompt: str | None = None
    # The answer is what the reply holds between <answer> and </answer> (else the whole reply).
    answer_tag: bool = False
    # Solved examples of the same task shown before the question (held out from train and test).
    few_shot: NonNegInt = 0
    format_coef: NonNegFloat = 0.1
    implementation: ClassVar[str] = "runner.rl.envs.reasoning_gym"

    def __post_init__(self) -> None:
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError("tasks holds a task twice")


class Verifiers(EnvBase, tag="verifiers", kw_only=True):
    """Any installed `verifiers` environment (chat; single- or multi-turn, tools included), rolled out through the
    recipe's sampler and renderer by an in-process OpenAI client; its rubric's reward is the reward and its metrics
    are logged. train_size rows of its dataset (repeated as needed), test_size of its eval dataset (else held out)."""

    # What `verifiers.load_environment` takes: an installed environment module ("reverse_text", "owner/env-id").
    module: str
    # Keyword arguments of the module's load_environment.
    args: dict[str, Any] = {}
    # The row order's seed (None: the recipe's).
    seed: NonNegInt | None = None
    # The model name the environment's requests carry (some environments log it).
    model_name: str = "runner"
    implementation: ClassVar[str] = "runner.rl.envs.verifiers_env"


class PythonEnv(EnvBase, tag="python", kw_only=True):
    """User code: target "pkg.mod:fn" is called as fn(**args) and returns a dataset builder, a callable
    builder(ctx: runner.rl.envs.EnvContext) -> (train: RLDataset, test: RLDataset | None).
    train_size / test_size are not used (the builder decides)."""

    target: Target
    args: dict[str, Any] = {}


# Every env, in the order declared above.
ENV_VARIANTS: tuple[type[EnvBase], ...] = variants(EnvBase)
if TYPE_CHECKING:
    Env = EnvBase
else:
    Env = Union[ENV_VARIANTS]  # noqa: UP007 - built from the variants at import
